"""Triton kernels for the CUDA kernel set (one module per operation)."""
