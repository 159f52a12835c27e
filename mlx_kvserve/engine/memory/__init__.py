"""Memory: the device's memory and MLX's hold on it, the facts read off this machine, the plan decided at start."""
