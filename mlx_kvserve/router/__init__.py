"""A cache-aware router across several mlx-kvserve instances (the policies of seed 004)."""
