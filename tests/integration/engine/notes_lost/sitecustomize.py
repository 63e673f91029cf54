"""A test double for test_pd_serving.py: on PYTHONPATH, it makes every KV transfer agent of
the process drop the NIXL notifications it receives, as a firewall that let the NIXL
handshake through but nothing after it would. Every process of the engine starts with it;
the agent's module is patched when it is first imported."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

MODULE = "kubesgl.engine.disagg.kv_transfer"


class _DropNotes(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.loader is not None
        load = spec.loader.exec_module

        def exec_module(module) -> None:
            load(module)
            receive = module.KVTransferAgent.notifications

            def notifications(agent) -> list[bytes]:
                receive(agent)  # taken from NIXL, and lost
                return []

            module.KVTransferAgent.notifications = notifications

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _DropNotes())
