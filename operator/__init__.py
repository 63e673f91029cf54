"""kubesgl.operator: the kopf operator that turns an InferenceService into Kubernetes objects.

Importing this package loads neither kopf nor torch; `kubesgl render` needs only pydantic,
pyyaml and the kubernetes client.
"""

if __name__ == "operator":
    # Python started in the repository root has the root on sys.path, so `import operator`
    # finds this folder before the standard library (the folder keeps its name:
    # docs/architecture.md, Layout).
    # Hand the importer the standard module instead. Only modules that never import
    # `operator` may be used here: that name is this half-made module until the swap.
    import os
    import sys
    from importlib.machinery import SourceFileLoader

    _loader = SourceFileLoader("operator", os.path.join(os.path.dirname(os.__file__), "operator.py"))
    _stdlib = type(sys)("operator")
    _stdlib.__file__, _stdlib.__loader__ = _loader.path, _loader
    sys.modules["operator"] = _stdlib
    _loader.exec_module(_stdlib)
