"""Prefill/decode disaggregation (docs/disaggregation.md): moving a request's KV from a
prefill engine's pool into a decode engine's pool."""
