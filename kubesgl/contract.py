"""The names and numbers the engine, the router and the operator agree on
(docs/architecture.md, Contracts): default ports, role names, the environment variables of
the keys, pod labels and annotations, the architectures of the tiny model.

Constants only, and no imports beyond typing: every component imports this module, the
torch-free router and operator included.
"""

from __future__ import annotations

from typing import Final, Literal

# Default ports
ENGINE_PORT: Final = 30000  # `kubesgl serve --port`: the engine's HTTP API
BOOTSTRAP_PORT: Final = (
    8998  # `--disaggregation-bootstrap-port`: a prefill engine's KV bootstrap server
)
ROUTER_PORT: Final = 8000  # `kubesgl router --port`, and the port of the router's Service

# Roles: an engine's `--role`, and the value of ROLE_LABEL on every pod the operator makes
MIXED: Final = "mixed"  # one engine runs whole requests
PREFILL: Final = "prefill"
DECODE: Final = "decode"
ROUTER: Final = "router"  # the router's own pods; routers never route to them
EngineRole = Literal["mixed", "prefill", "decode"]
PodRole = Literal["mixed", "prefill", "decode", "router"]
ENGINE_ROLES: Final[tuple[EngineRole, ...]] = (MIXED, PREFILL, DECODE)

# Keys given through the environment (the operator fills them from Secrets), so that they are
# in no command line
API_KEY_ENV: Final = "KUBESGL_API_KEY"  # the engines' API key: engines and routers read it
ADMIN_KEY_ENV: Final = "KUBESGL_ROUTER_ADMIN_KEY"  # the key of the router's admin API

# Labels the operator puts on everything it makes; the router finds engine pods by them
NAME_LABEL: Final = "app.kubernetes.io/name"
INSTANCE_LABEL: Final = "app.kubernetes.io/instance"  # the InferenceService's name
MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
ROLE_LABEL: Final = "kubesgl.io/role"

# A prefill pod's bootstrap port, under kubesgl's name and under SGLang's (SGLang's router
# discovers prefill pods' bootstrap ports by the latter); pods carry both
BOOTSTRAP_PORT_ANNOTATION: Final = "kubesgl.io/bootstrap-port"
SGLANG_BOOTSTRAP_PORT_ANNOTATION: Final = "sglang.ai/bootstrap-port"

# Architectures `kubesgl make-tiny-model --arch` writes: the operator renders that command for
# `spec.model.tiny`, and `kubesgl up` runs it
TinyArch = Literal["llama", "mistral", "qwen2", "qwen3", "qwen3-moe"]
TINY_ARCHS: Final[tuple[TinyArch, ...]] = ("llama", "mistral", "qwen2", "qwen3", "qwen3-moe")
