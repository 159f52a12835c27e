"""Images in, cached like text: vision-language models (mlx-vlm's vision towers) behind the engine.

images.py decodes and bounds what clients send; families.py knows each family's preprocessing,
placeholder tokens and embedding merge (Gemma 3; Qwen2-VL and its M-RoPE positions in qwen.py);
encoder_cache.py keeps vision-tower outputs by image digest; runtime.py is the engine's one door
to all of it (prompt building on HTTP threads, encoder and prefill on the MLX worker).
docs/vision.md says how images enter the block chain.
"""
