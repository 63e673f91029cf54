"""Shared fixtures: tiny models made on the spot (tests never download anything)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is available on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch, seed=0, head_dim=16) -> path of a tiny checkpoint, made once per session."""
    from kubesgl.engine.models.tiny import make_tiny_model

    made: dict[tuple[str, int, int], str] = {}

    def get(arch: str, seed: int = 0, head_dim: int = 16) -> str:
        key = (arch, seed, head_dim)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}-{seed}-{head_dim}")
            made[key] = str(make_tiny_model(folder, arch, seed, head_dim))
        return made[key]

    return get
