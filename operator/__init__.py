"""kubesgl.operator: the kopf operator that turns an InferenceService into Kubernetes objects.

Importing this package loads neither kopf nor torch; `kubesgl render` needs only pydantic,
pyyaml and the kubernetes client.
"""
