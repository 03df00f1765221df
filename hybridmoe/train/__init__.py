"""Training: optimizer, the pure train step, checkpoints, metrics and the loop around them."""
