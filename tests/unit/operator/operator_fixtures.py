"""Shared helpers for the operator unit tests."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
CRD_PATH = REPO / "crds" / "inferenceservice.yaml"


def load_example(name: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / "examples" / name).read_text())


def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def crd_schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def with_changes(document: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A copy of document with the field at a dotted path set (or removed when value is ...)."""
    changed = copy.deepcopy(document)
    *parents, last = dotted.split(".")
    target = changed
    for part in parents:
        target = target.setdefault(part, {})
    if value is ...:
        target.pop(last, None)
    else:
        target[last] = value
    return changed
