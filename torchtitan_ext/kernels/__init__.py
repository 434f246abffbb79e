"""Triton kernels for MoE expert compute, each with a plain-torch reference."""
