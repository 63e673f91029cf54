"""From an InferenceService to the processes that serve it on this machine: every replica of
every engine role, and one router in front of them.

Each command line is the one the operator renders into the pod (kubesgl.operator.render), with
only what must differ on one machine replaced (docs/up.md, What differs from a cluster): the
model's path, the engines' host and ports, the prefill engines' bootstrap ports, the device when
there is no GPU, and the router's pod discovery, which becomes the list of engines.
"""

from __future__ import annotations

import os
import random
import socket
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kubesgl import contract
from kubesgl.contract import ADMIN_KEY_ENV, API_KEY_ENV
from kubesgl.engine.config import ENGINE_OPTIONS
from kubesgl.operator.render import render
from kubesgl.operator.render.common import expand_references
from kubesgl.operator.render.engine import COMPILE_CACHE_VARIABLES
from kubesgl.operator.spec import EngineSpec, InferenceService, ModelSpec
from kubesgl.operator.validation import InvalidSpec, Problem, argv_sections

ENGINE_HOST = "127.0.0.1"  # engines serve the router only; the router listens on --host
# UCX's TCP transport (NIXL's, moving the KV from prefill to decode engines) listens on every
# network device it finds, the host's external address included, although the engines are all
# on this machine: kept to the loopback device, it listens on 127.0.0.1 only, as the engines'
# HTTP and bootstrap servers do, and the KV still moves. Not where the spec
# (kvTransfer.ucx.netDevices) or this environment names the devices, nor where UCX_TLS names no
# tcp or an RDMA transport beside it (an RDMA transport has no loopback device: lo turns it off).
UCX_LOOPBACK = {"UCX_NET_DEVICES": "lo"}
# A pod's grace period when its spec sets none (the router's)
KUBERNETES_GRACE_PERIOD_S = 30
_MODEL_FLAG = ENGINE_OPTIONS["model"].flag
_DEVICE_FLAG = ENGINE_OPTIONS["device"].flag
_BOOTSTRAP_FLAG = ENGINE_OPTIONS["disaggregation_bootstrap_port"].flag
_DISCOVERY_FLAGS = ("--kube-namespace", "--kube-selector")  # each with one value
_ROUTER_WORKER_FLAGS = {
    contract.MIXED: "--worker",
    contract.PREFILL: "--prefill",
    contract.DECODE: "--decode",
}
# Keys that pods take from Secrets, by the field naming the Secret: here they come from this
# environment, and a process whose pod has no such variable does not inherit it either.
_SECRET_KEYS = {
    API_KEY_ENV: "spec.engine.apiKeySecret",
    ADMIN_KEY_ENV: "spec.router.adminKeySecret",
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kubesgl"


# Where the ports of the processes come from: below the kernel's range for outgoing
# connections (Linux 32768-60999, macOS 49152-65535 by default). A port from that range
# (what binding port 0 gives) is free when picked, but any connection may take it before the
# engine binds it, and a replica restarts on the same port.
PORT_RANGE = range(20000, 32768)


def _outgoing_ports() -> range:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):  # not Linux
        return range(49152, 65536)
    return range(low, high + 1)


class NoFreePort(Exception):
    """Every port of the range given is in use or handed out already; `needed` is how many
    the whole plan takes, where the plan says."""

    def __init__(self, needed: int | None = None) -> None:
        super().__init__(needed)
        self.needed = needed


class PortPicker:
    """Hands out ports free now, never the same twice: a plan picks every port before any
    process binds one. From `ports` where given (`--port-range`), all of them tried before it
    gives up; else from PORT_RANGE outside the range of outgoing connections (where there is
    one), and what binding port 0 gives where none of those is free."""

    def __init__(self, ports: range | None = None) -> None:
        self.handed_out: set[int] = set()
        self.ports = ports
        self.outgoing = _outgoing_ports()  # read once: a plan picks several ports

    def __call__(self) -> int:
        if self.ports is not None:
            candidates = [p for p in self.ports if p not in self.handed_out]
            return self._first_free(random.sample(candidates, len(candidates)))
        candidates = [p for p in PORT_RANGE if p not in self.outgoing and p not in self.handed_out]
        try:
            return self._first_free(random.sample(candidates, min(len(candidates), 64)))
        except NoFreePort:
            return self._any_free()

    def _first_free(self, candidates: list[int]) -> int:
        for port in candidates:
            if _free(port):
                self.handed_out.add(port)
                return port
        raise NoFreePort

    def _any_free(self) -> int:
        while True:  # the kernel's range covers them all: what it gives
            with socket.socket() as s:
                s.bind((ENGINE_HOST, 0))
                port = s.getsockname()[1]
            if port not in self.handed_out:
                self.handed_out.add(port)
                return port


def _besides(fixed: frozenset[int], free_port: Callable[[], int]) -> Callable[[], int]:
    """`free_port` less the plan's fixed ports: the router's --port is free when the engines'
    ports are picked, as `kubesgl up` listens on it only once the plan is made, and an engine
    given it left the router unable to listen."""

    def pick() -> int:
        while (port := free_port()) in fixed:
            pass
        return port

    return pick


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((ENGINE_HOST, port))
        except OSError:
            return False
        return True


class NotEnoughGpus(Exception):
    """The spec asks for more GPUs than this machine lets us hand out."""


@dataclass(frozen=True)
class LocalProcess:
    """One replica, as the supervisor starts it."""

    name: str  # prefill-0, decode-1, router
    role: contract.PodRole
    argv: tuple[str, ...]
    env: Mapping[str, str]  # set over the environment of `kubesgl up`
    port: int
    stop_timeout_s: (
        float  # from SIGTERM to SIGKILL: the pod's grace period, less what only pods need
    )
    bootstrap_port: int | None = None  # prefill engines
    gpus: tuple[str, ...] = ()  # CUDA_VISIBLE_DEVICES; none: the CPU
    waits_for: tuple[
        contract.EngineRole, ...
    ] = ()  # roles that need a ready replica before this starts
    host: str = ENGINE_HOST  # where it answers on this machine
    unset_env: tuple[str, ...] = ()  # variables of the environment of `kubesgl up` it does not get
    pass_fds: tuple[int, ...] = ()  # file descriptors of `kubesgl up` it inherits
    # an engine's command line as rendered, in parts by the spec field each comes from, in
    # order: (spec.engine, its fields' flags), (spec.engine.extraArgs, ...), (spec.decode.extraArgs,
    # ...); where a flag it refuses was set (`spec_fields`)
    spec_args: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """Its variables: `env` over `base` less `unset_env`."""
        return {**{k: v for k, v in base.items() if k not in self.unset_env}, **self.env}

    @property
    def url(self) -> str:
        return contract.http_url(self.host, self.port)


@dataclass(frozen=True)
class ModelStep:
    """What a pod's init container does to its model volume, done here into a local folder."""

    command: tuple[str, ...]
    args: tuple[str, ...]
    pod_path: str  # the model's path in the pod, which `argv` replaces
    env: Mapping[str, str]
    path: Path  # the model's folder on this machine once the step has run
    downloads: bool = False  # from the Hub (hf download), else made here (make-tiny-model)
    size_limit: str | None = None  # of the pod's volume for a download, where the spec sets one

    @property
    def action(self) -> str:
        return "downloading" if self.downloads else "making"

    def argv(self, into: Path) -> list[str]:
        return [*self.command, *(str(into) if arg == self.pod_path else arg for arg in self.args)]


@dataclass(frozen=True)
class LocalSettings:
    host: str = "127.0.0.1"  # of the router
    port: int = contract.ROUTER_PORT
    gpus: tuple[str, ...] = ()  # the GPUs to hand out, as CUDA_VISIBLE_DEVICES names them
    model: str | None = None  # a local folder that replaces spec.model
    cache_dir: Path = field(default_factory=default_cache_dir)  # models made or downloaded here
    environ: Mapping[str, str] = field(default_factory=dict)  # where Secrets' values come from
    free_port: Callable[[], int] = field(default_factory=PortPicker)


@dataclass(frozen=True)
class LocalPlan:
    name: str
    mode: str
    model_path: str
    model_step: ModelStep | None  # None: the model is there already
    engines: tuple[LocalProcess, ...]
    router: LocalProcess
    notes: tuple[str, ...]  # what a person should know, e.g. that the engines run on the CPU

    @property
    def processes(self) -> tuple[LocalProcess, ...]:
        return (*self.engines, self.router)

    @property
    def base_url(self) -> str:
        """The OpenAI base URL clients use."""
        return self.router.url + "/v1"


def spec_fields(processes: Iterable[LocalProcess], flag: str) -> list[str]:
    """The spec fields that gave these engines a flag, each one's last (extraArgs override
    what comes before them): the spec.engine field it is rendered from (--context-length:
    spec.engine.contextLength), or the extraArgs that carry it (spec.decode.extraArgs)."""
    name = flag.removeprefix("--").replace("-", "_")
    flags = ENGINE_OPTIONS[name].flags if name in ENGINE_OPTIONS else (flag,)
    fields: list[str] = []
    for process in processes:
        given = [source for source, args in process.spec_args if _carries(args, flags)]
        blamed = given[-1] if given else None
        if blamed == "spec.engine":  # a flag no spec.engine field sets (--port) names none
            blamed = _engine_field(name)
        if blamed is not None and blamed not in fields:
            fields.append(blamed)
    return fields


def _engine_field(name: str) -> str | None:
    """The spec.engine field of an engine option, if one sets it."""
    if name not in ENGINE_OPTIONS or name not in EngineSpec.model_fields:
        return None
    return f"spec.engine.{EngineSpec.model_fields[name].alias}"


def _carries(args: Sequence[str], flags: tuple[str, ...]) -> bool:
    """Whether the arguments give one of these flags (`--flag value` or `--flag=value`)."""
    return any(arg.split("=", 1)[0] in flags for arg in args if arg.startswith("--"))


def serving_on(local: LocalPlan, fd: int) -> LocalPlan:
    """The plan with its router serving on `fd`, a socket `kubesgl up` listens on from its own
    start, in place of its --host and --port (the router refuses them beside --fd): no other
    process can take the port while the engines load (the router starts only once they are
    ready), and what answers on it is this plan's router."""
    argv = (*_without(local.router.argv, ("--host", "--port")), "--fd", str(fd))
    router = replace(local.router, argv=argv, pass_fds=(fd,))
    return replace(local, router=router)


def plan(isvc: InferenceService, settings: LocalSettings) -> LocalPlan:
    """Raises InvalidSpec naming the field for what cannot run outside a cluster, and
    NotEnoughGpus."""
    pods = _rendered_pods(isvc)
    roles = isvc.spec.engine_roles()
    replicas = {role: _replicas(isvc, role) for role in roles}
    _refuse_idle_roles(replicas)
    notes = []
    use_gpus = isvc.spec.engine.device == "cuda" and bool(settings.gpus)
    gpus_needed = sum(replicas[role] * block.tensor_parallel_size for role, block in roles.items())
    if use_gpus and gpus_needed > len(settings.gpus):
        wanted = ", ".join(
            f"{role}: {replicas[role]} x {block.tensor_parallel_size}"
            for role, block in roles.items()
        )
        raise NotEnoughGpus(
            f"the spec needs {gpus_needed} GPUs (replicas x tensorParallelSize: {wanted}); "
            f"this machine has {len(settings.gpus)} ({', '.join(settings.gpus)})"
        )
    if isvc.spec.engine.device == "cuda" and not use_gpus:
        notes.append("no GPU here: the engines run on the CPU")
    secrets = {
        API_KEY_ENV: isvc.spec.engine.api_key_secret,
        ADMIN_KEY_ENV: isvc.spec.router.admin_key_secret,
    }
    missing = [
        Problem(_SECRET_KEYS[name], f"kubesgl up reads no Secrets: set {name} in the environment")
        for name, secret in secrets.items()
        if secret is not None and name not in settings.environ
    ]
    if missing:
        raise InvalidSpec(missing)

    first_pod = pods[next(iter(roles))]
    model_path, model_step = _local_model(isvc.spec.model, first_pod, settings)
    free_gpus = list(settings.gpus)
    free_port = _besides(frozenset({settings.port}), settings.free_port)
    engines = []
    try:
        for role, block in roles.items():
            for index in range(replicas[role]):
                gpus: tuple[str, ...] = ()
                if use_gpus:
                    gpus = tuple(free_gpus[: block.tensor_parallel_size])
                    del free_gpus[: block.tensor_parallel_size]
                engine = _engine(
                    f"{role}-{index}", role, pods[role], model_path, gpus, settings, free_port
                )
                engines.append(replace(engine, spec_args=_spec_args(isvc, role, pods[role])))
    except NoFreePort:
        raise NoFreePort(sum(replicas[role] * _ports_of(role) for role in roles)) from None
    router = _router(pods[contract.ROUTER], tuple(engines), tuple(roles), settings)
    return LocalPlan(
        isvc.metadata.name,
        isvc.spec.mode,
        model_path,
        model_step,
        tuple(engines),
        router,
        tuple(notes),
    )


def _rendered_pods(isvc: InferenceService) -> dict[str, dict[str, Any]]:
    """The pod spec of each role's Deployment, as the operator renders it."""
    return {
        obj["metadata"]["labels"][contract.ROLE_LABEL]: obj["spec"]["template"]["spec"]
        for obj in render(isvc)
        if obj["kind"] == "Deployment"
    }


def _spec_args(
    isvc: InferenceService, role: contract.EngineRole, pod: dict[str, Any]
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The engine's rendered arguments in parts by the field each comes from, as the
    operator's validation cuts them (argv_sections)."""
    args = pod["containers"][0]["args"]
    sections = argv_sections(isvc, role, isvc.spec.engine_roles()[role], len(args))
    starts = [0, *(end for _, end in sections[:-1])]
    return tuple((source, tuple(args[start:end])) for (source, end), start in zip(sections, starts))


def _refuse_idle_roles(replicas: dict[contract.EngineRole, int]) -> None:
    """A cluster may scale a role from 0 later; up never does, so such a service never answers."""
    idle = [
        Problem(
            f"spec.{role}.replicas",
            "kubesgl up scales nothing: a role with 0 replicas never serves",
        )
        for role, count in replicas.items()
        if count == 0
    ]
    if idle:
        raise InvalidSpec(idle)


def _replicas(isvc: InferenceService, role: contract.EngineRole) -> int:
    """The Deployment's replicas, or the least an autoscaler keeps where one owns the count."""
    scaling = isvc.spec.autoscaling_for(role)
    if scaling is not None:
        return scaling.min_replicas
    return isvc.spec.engine_roles()[role].replicas_at_creation


def _local_model(
    model: ModelSpec, pod: dict[str, Any], settings: LocalSettings
) -> tuple[str, ModelStep | None]:
    if settings.model is not None:
        return settings.model, None
    if model.host_path is not None:  # the node's folder is this machine's
        return model.host_path.path, None
    if model.pvc is not None:
        raise InvalidSpec(
            [
                Problem(
                    "spec.model.pvc",
                    "a PersistentVolumeClaim exists only in a cluster: give "
                    "kubesgl up --model DIR, a local copy of the model",
                )
            ]
        )
    # Downloaded or made by an init container into an emptyDir: here, once, into the cache.
    (init,) = pod["initContainers"]
    pod_path = _flag_value(pod["containers"][0]["args"], _MODEL_FLAG)
    step = ModelStep(
        tuple(_local_command(init["command"])),
        tuple(init["args"]),
        pod_path,
        _local_env(init, settings.environ),
        settings.cache_dir / "models" / _cache_key(model),
        downloads=model.hugging_face is not None,
        size_limit=_size_limit(model),
    )
    return str(step.path), step


def _size_limit(model: ModelSpec) -> str | None:
    hub = model.hugging_face
    return str(hub.size_limit) if hub is not None and hub.size_limit is not None else None


def _cache_key(model: ModelSpec) -> str:
    if model.tiny is not None:
        return f"tiny-{model.tiny.arch}"
    assert model.hugging_face is not None  # the other sources need no init container
    return f"hf/{model.hugging_face.repo}/{model.hugging_face.revision}"


def _ports_of(role: contract.EngineRole) -> int:
    """An engine's HTTP port, and a prefill engine's bootstrap server's."""
    return 2 if role == contract.PREFILL else 1


def _engine(
    name: str,
    role: contract.EngineRole,
    pod: dict[str, Any],
    model_path: str,
    gpus: tuple[str, ...],
    settings: LocalSettings,
    free_port: Callable[[], int],  # settings.free_port less the plan's fixed ports
) -> LocalProcess:
    container = pod["containers"][0]
    args = list(container["args"])
    port = free_port()
    _set_flag_value(args, _MODEL_FLAG, model_path)
    _set_flag_value(args, "--host", ENGINE_HOST)
    _set_flag_value(args, "--port", str(port))
    bootstrap_port = None
    if role == contract.PREFILL:
        bootstrap_port = free_port()
        _set_flag_value(args, _BOOTSTRAP_FLAG, str(bootstrap_port))
    if not gpus:
        _set_flag_value(args, _DEVICE_FLAG, "cpu")
    env = {**_local_env(container, settings.environ), "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
    if role != contract.MIXED and _ucx_tcp_on_every_device({**settings.environ, **env}):
        env.update(UCX_LOOPBACK)
    return LocalProcess(
        name,
        role,
        (*_local_command(container["command"]), *expand_references(args, env)),
        env,
        port,
        _stop_timeout(pod),
        bootstrap_port,
        gpus,
        unset_env=_unset_secret_keys(container),
    )


def _router(
    pod: dict[str, Any],
    engines: tuple[LocalProcess, ...],
    roles: tuple[contract.EngineRole, ...],
    settings: LocalSettings,
) -> LocalProcess:
    container = pod["containers"][0]
    args = _without(container["args"], _DISCOVERY_FLAGS)
    _set_flag_value(args, "--host", settings.host)
    _set_flag_value(args, "--port", str(settings.port))
    # the engines by flag, as `kubesgl router --prefill URL@PORT --decode URL`
    for engine in engines:
        bootstrap = f"@{engine.bootstrap_port}" if engine.bootstrap_port is not None else ""
        args += [_ROUTER_WORKER_FLAGS[engine.role], engine.url + bootstrap]
    env = _local_env(container, settings.environ)
    # Started once every role can serve: its first health check then finds the engines ready.
    return LocalProcess(
        contract.ROUTER,
        contract.ROUTER,
        (*_local_command(container["command"]), *args),
        env,
        settings.port,
        _stop_timeout(pod),
        waits_for=roles,
        host=ENGINE_HOST if settings.host in ("", "0.0.0.0", "::") else settings.host,
        unset_env=_unset_secret_keys(container),
    )


def _local_command(command: list[str]) -> list[str]:
    """`kubesgl` runs with this interpreter, so a virtual environment need not be on PATH."""
    return (
        [sys.executable, "-m", "kubesgl", *command[1:]]
        if command[0] == "kubesgl"
        else list(command)
    )


# The pod's cache folders, which are no folders of this machine (render/engine.py)
_POD_CACHE_VARIABLES = frozenset({"HOME", *COMPILE_CACHE_VARIABLES})


def _local_env(container: dict[str, Any], environ: Mapping[str, str]) -> dict[str, str]:
    """The container's variables: plain values as rendered, except the cache folders (pods point
    HOME at /tmp for their read-only root filesystem, and the compile caches at a claim's mount:
    here caches stay in the user's home); values from Secrets
    come from this environment under the same name, where set. A variable with neither is set
    to "" (render leaves an empty value out, as the API server does)."""
    env = {}
    for variable in container.get("env", []):
        name = variable["name"]
        if "valueFrom" not in variable and name not in _POD_CACHE_VARIABLES:
            env[name] = variable.get("value", "")
        elif "valueFrom" in variable and name in environ:
            env[name] = environ[name]
    return env


# UCX's InfiniBand (RDMA) transports and their aliases, by the start of their names: rc, rc_verbs,
# rc_mlx5, rc_v, rc_x; ud, ud_verbs, ud_mlx5, ud_v, ud_x; dc, dc_mlx5, dc_x; ib (all of them);
# mlx5; gga (gga_mlx5, BlueField). Each runs on an InfiniBand or RoCE device, which
# UCX_NET_DEVICES=lo leaves out.
_UCX_RDMA_TRANSPORTS = ("rc", "ud", "dc", "ib", "mlx", "gga")


def _ucx_tcp_on_every_device(environment: Mapping[str, str]) -> bool:
    """Whether UCX would use its TCP transport on every network device, and only TCP among the
    network transports named: no UCX_NET_DEVICES, and UCX_TLS unset (UCX takes all it has),
    all, excluding (^...) others than tcp, or naming tcp and no RDMA transport. Where tcp is
    named beside an RDMA one (rc,tcp), lo would leave the RDMA transport no device and silently
    turn it off. Unset, all and ^... stay with lo: they ask for no RDMA transport, and the
    engines of `kubesgl up` share one host, where the transports that carry the KV between local
    processes (shared memory, cuda_ipc) use no network device and stay; whoever
    wants RDMA between them names it (or UCX_NET_DEVICES)."""
    if "UCX_NET_DEVICES" in environment:
        return False
    transports = environment.get("UCX_TLS")
    if transports is None:
        return True
    if transports.startswith("^"):
        return "tcp" not in transports[1:].split(",")
    # a transport may carry a suffix such as :aux (ud:aux, for connection setup only)
    names = {transport.split(":")[0] for transport in transports.split(",")}
    if any(name.startswith(_UCX_RDMA_TRANSPORTS) for name in names):
        return False
    return bool({"tcp", "all"} & names)


def _unset_secret_keys(container: dict[str, Any]) -> tuple[str, ...]:
    """The keys from Secrets that the pod does not have: an engine started with KUBESGL_API_KEY
    in its environment would require it where the pod would not."""
    present = {variable["name"] for variable in container.get("env", [])}
    return tuple(name for name in _SECRET_KEYS if name not in present)


def _stop_timeout(pod: dict[str, Any]) -> float:
    """The pod's grace period less its preStop pause: locally the router stops before the
    engines instead, so no pause is needed for it to stop sending them requests."""
    grace = pod.get("terminationGracePeriodSeconds", KUBERNETES_GRACE_PERIOD_S)
    pause = (
        pod["containers"][0]
        .get("lifecycle", {})
        .get("preStop", {})
        .get("sleep", {})
        .get("seconds", 0)
    )
    return float(grace - pause)


def _flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _set_flag_value(args: list[str], flag: str, value: str) -> None:
    args[args.index(flag) + 1] = value


def _without(args: Sequence[str], flags: tuple[str, ...]) -> list[str]:
    """The arguments less each of these flags and its value, given apart or as --flag=value."""
    dropped = {i + offset for i, arg in enumerate(args) if arg in flags for offset in (0, 1)}
    joined = {i for i, arg in enumerate(args) if arg.partition("=")[0] in flags and "=" in arg}
    return [arg for i, arg in enumerate(args) if i not in dropped | joined]
