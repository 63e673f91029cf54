"""What the operator asks the API server to watch: of the child kinds and pods, only its own."""

from __future__ import annotations

import kopf
from kopf._cogs.structs import references

from kubesgl.operator.handlers import watch_only_children
from kubesgl.operator.kube import CHILD_KINDS, INFERENCE_SERVICE
from kubesgl.operator.pods import POD


def resource(kind) -> references.Resource:
    return references.Resource(group=kind.group, version=kind.version, plural=kind.plural)


def test_child_kinds_are_watched_with_the_operators_label_as_selector():
    """kopf's `labels=` on a handler filters after every object of the kind, cluster-wide,
    has come over the wire; a watch's label selector filters in the API server."""
    settings = kopf.OperatorSettings()
    watch_only_children(settings)
    for kind in (*CHILD_KINDS, POD):  # the pods too: their health is read (pods.py)
        assert settings.watching.label_selectors.collect(resource(kind)) == [
            "app.kubernetes.io/managed-by=kubesgl-operator"
        ], kind.plural
    # every InferenceService, whoever made it
    assert settings.watching.label_selectors.collect(resource(INFERENCE_SERVICE)) == []
