"""The converted SmolLM2 is right: it answers, its perplexity is low, and a deliberately broken
conversion (wrong RoPE layout) is caught by the same measure."""

import math

import mlx.core as mx
import pytest
from mlx_lm import generate
from mlx_lm.utils import load

pytestmark = pytest.mark.slow

PARAGRAPH = (
    "The city of Paris is the capital of France and its largest city. It is located on the river Seine, "
    "in the north of the country. Paris is known for its museums and monuments, such as the Louvre and "
    "the Eiffel Tower, which was built for the World's Fair in 1889. Millions of tourists visit the city "
    "every year to see its art, its architecture and its famous cafes."
)
PPL_THRESHOLD = 12.0


def perplexity(model, tokenizer, text: str) -> float:
    ids = mx.array(tokenizer.encode(text))[None]
    logits = model(ids[:, :-1]).astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logprobs, ids[:, 1:, None], axis=-1)
    return math.exp(-picked.mean().item())


@pytest.fixture(scope="module")
def smollm(smollm_dir):
    return load(str(smollm_dir))


def test_greedy_answer_names_paris(smollm):
    model, tokenizer = smollm
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    answer = generate(model, tokenizer, prompt, max_tokens=20)
    assert "Paris" in answer


def test_perplexity_separates_right_and_broken_rope(smollm, smollm_dir):
    model, tokenizer = smollm
    good = perplexity(model, tokenizer, PARAGRAPH)
    broken_model, _ = load(str(smollm_dir), model_config={"rope_traditional": False})
    broken = perplexity(broken_model, tokenizer, PARAGRAPH)
    print(f"perplexity: converted {good:.2f}, wrong RoPE layout {broken:.2f}")
    assert good < PPL_THRESHOLD
    assert broken > PPL_THRESHOLD
    assert broken > 3 * good


def test_keep_quantized_and_float32_give_close_logits(smollm, tmp_path):
    from mlx_kvserve.config import default_home
    from mlx_kvserve.models.default import fetch_default_gguf
    from mlx_kvserve.models.gguf import convert_gguf

    src = fetch_default_gguf(default_home() / "models")
    keep_model, _ = load(str(convert_gguf(src, tmp_path / "keep", "keep")))
    model, tokenizer = smollm
    ids = mx.array(tokenizer.encode(PARAGRAPH[:120]))[None]
    a = model(ids).astype(mx.float32)
    b = keep_model(ids).astype(mx.float32)
    # Same quantized weights, dequantized ahead of time vs on the fly: same predictions.
    assert mx.array_equal(a.argmax(-1), b.argmax(-1))
    probs_a, probs_b = mx.softmax(a, axis=-1), mx.softmax(b, axis=-1)
    max_logit_diff = mx.abs(a - b).max().item()
    max_prob_diff = mx.abs(probs_a - probs_b).max().item()
    print(f"keep vs float32: max logit diff {max_logit_diff:.4f}, max prob diff {max_prob_diff:.4f}")
    assert max_logit_diff < 0.5
    assert max_prob_diff < 0.02
