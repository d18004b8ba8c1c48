"""Triton kernels, installed as loraserve.kernels."""
