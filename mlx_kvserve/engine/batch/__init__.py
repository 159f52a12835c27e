"""Continuous batching on mlx-lm's BatchGenerator: the Scheduler, its requests' state, admission and start order, the mlx-lm batch."""
