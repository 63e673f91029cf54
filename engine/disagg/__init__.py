"""Prefill/decode disaggregation (DESIGN.md, P/D protocol): moving a request's KV from a
prefill engine's pool into a decode engine's pool."""
