"""Triton kernels of model layers."""
