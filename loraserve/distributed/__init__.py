"""Tensor parallelism: the process group of one engine and its worker processes."""
