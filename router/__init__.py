"""kubesgl router: the front door in front of engine workers.

It speaks the engine's HTTP surface, chooses a worker per request with a routing policy
(cache-aware, round robin, power of two choices, random), drives prefill/decode pairs in
disaggregated mode, watches worker health and, on Kubernetes, discovers engine pods.
It never imports torch: it moves bytes and JSON, nothing else.
"""
