"""What exists only for a Linux CPU: installed by the CLI (`mlx-kvserve run`), never by the engine."""
