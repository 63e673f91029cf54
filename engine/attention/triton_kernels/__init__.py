"""Triton kernels for paged attention (prefill with cached prefixes, and decode)."""
