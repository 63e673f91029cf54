"""A test double for test_server_lifecycle.py: on PYTHONPATH, it makes every scheduler rank's
reading of the checkpoint's weights wait forever, as a checkpoint on a network volume that
stopped answering would: the engine stays loading, its scheduler never reports ready. Every
process of the engine starts with it; the weights' module is patched when it is first
imported (only the scheduler ranks read weights). Each rank that reaches the weights says so in
a file of its own in $HELD_DIR, named after its process id."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import threading
from pathlib import Path

MODULE = "kubesgl.engine.models.weights"


class _HoldLoading(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.loader is not None
        load = spec.loader.exec_module

        def exec_module(module) -> None:
            load(module)

            def read_safetensors(*args, **kwargs):
                (Path(os.environ["HELD_DIR"]) / str(os.getpid())).touch()
                threading.Event().wait()  # never set: loading never ends
                yield from ()

            module.read_safetensors = read_safetensors

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _HoldLoading())
