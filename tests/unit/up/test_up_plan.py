"""`kubesgl up`'s plan: for every example, the local command lines are the rendered pods' args
with only the documented local values replaced (docs/up.md); replicas, GPUs, secrets and model
sources as a cluster would have them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubesgl import contract
from kubesgl.engine.server.options import build_parser as serve_parser
from kubesgl.operator.render import render
from kubesgl.operator.validation import InvalidSpec, parse_inference_service
from kubesgl.router.cli import build_parser as router_parser
from kubesgl.router.cli import check_router_args
from kubesgl.up.plan import (
    ENGINE_HOST,
    LocalPlan,
    LocalSettings,
    NotEnoughGpus,
    plan,
    serving_on,
)

EXAMPLES_DIR = Path(__file__).resolve().parents[3] / "examples"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.yaml"))
KUBESGL = [sys.executable, "-m", "kubesgl"]
# What may differ between a pod's command line and the local one, and nothing else
ENGINE_LOCAL = {"model", "host", "port", "disaggregation_bootstrap_port", "device"}
ROUTER_LOCAL = {"host", "port", "kube_namespace", "kube_selector", "worker", "prefill", "decode"}


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def example(name: str) -> dict[str, Any]:
    return load(EXAMPLES_DIR / f"{name}.yaml")


def counting_ports():
    ports = iter(range(41000, 42000))
    return lambda: next(ports)


def local_plan(document: dict[str, Any], gpus: int = 0, **settings: Any) -> LocalPlan:
    isvc = parse_inference_service(document)
    if isvc.spec.model.pvc is not None:
        settings.setdefault("model", "/local/copy")
    settings.setdefault("free_port", counting_ports())
    return plan(
        isvc,
        LocalSettings(
            gpus=tuple(str(i) for i in range(gpus)), cache_dir=Path("/cache"), **settings
        ),
    )


def rendered_containers(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        obj["metadata"]["labels"][contract.ROLE_LABEL]: obj["spec"]["template"]["spec"][
            "containers"
        ][0]
        for obj in render(parse_inference_service(document))
        if obj["kind"] == "Deployment"
    }


@pytest.mark.parametrize("gpus", [0, 8], ids=["no-gpu", "8-gpus"])
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_local_command_lines_are_the_rendered_pods_args(path, gpus):
    document = load(path)
    local = local_plan(document, gpus, host="0.0.0.0", port=9000)
    pods = rendered_containers(document)
    isvc = parse_inference_service(document)
    on_gpus = gpus > 0 and isvc.spec.engine.device == "cuda"

    for engine in local.engines:
        container = pods[engine.role]
        assert container["command"] == ["kubesgl"] and list(engine.argv[:3]) == KUBESGL
        assert engine.argv[3] == container["args"][0] == "serve"
        ours = vars(serve_parser().parse_args(engine.argv[4:]))
        theirs = vars(
            serve_parser().parse_args(
                [a.replace("$(KUBESGL_API_KEY)", "k") for a in container["args"][1:]]
            )
        )
        assert {k: v for k, v in ours.items() if k not in ENGINE_LOCAL} == {
            k: v for k, v in theirs.items() if k not in ENGINE_LOCAL
        }
        assert (ours["model"], ours["host"], ours["port"]) == (
            local.model_path,
            ENGINE_HOST,
            engine.port,
        )
        assert ours["device"] == ("cuda" if on_gpus else "cpu")
        assert len(engine.gpus) == (
            isvc.spec.engine_roles()[engine.role].tensor_parallel_size if on_gpus else 0
        )
        if engine.role == contract.PREFILL:
            assert (
                ours["disaggregation_bootstrap_port"]
                == engine.bootstrap_port
                != theirs["disaggregation_bootstrap_port"]
            )

    router = local.router
    ours = vars(router_parser().parse_args(router.argv[4:]))
    theirs = vars(router_parser().parse_args(pods[contract.ROUTER]["args"][1:]))
    assert router.argv[3] == "router"
    assert {k: v for k, v in ours.items() if k not in ROUTER_LOCAL} == {
        k: v for k, v in theirs.items() if k not in ROUTER_LOCAL
    }
    assert (ours["host"], ours["port"], ours["kube_selector"], ours["kube_namespace"]) == (
        "0.0.0.0",
        9000,
        [],
        None,
    )
    by_role = {role: [e for e in local.engines if e.role == role] for role in contract.ENGINE_ROLES}
    assert ours["worker"] == [e.url for e in by_role[contract.MIXED]]
    assert ours["prefill"] == [f"{e.url}@{e.bootstrap_port}" for e in by_role[contract.PREFILL]]
    assert ours["decode"] == [e.url for e in by_role[contract.DECODE]]
    assert local.base_url == "http://127.0.0.1:9000/v1"
    assert len(
        {p.port for p in local.processes} | {e.bootstrap_port for e in by_role[contract.PREFILL]}
    ) == len(local.processes) + len(by_role[contract.PREFILL])  # every port its own


def test_replicas_are_the_deployments_or_the_autoscalers_minimum():
    def counts(local):
        return {
            r: sum(e.role == r for e in local.engines) for r in (contract.PREFILL, contract.DECODE)
        }

    assert counts(local_plan(example("autoscaled-hpa"), gpus=8)) == {
        "prefill": 1,
        "decode": 2,
    }  # minReplicas
    document = example("autoscaled-hpa")
    del document["spec"]["autoscaling"]
    document["spec"]["decode"]["replicas"] = 3
    assert counts(local_plan(document, gpus=8)) == {"prefill": 1, "decode": 3}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_role_with_no_replicas_is_refused_since_up_scales_nothing(role):
    """Before, `up` started the router and waited for a service that could never be ready."""
    document = example("quickstart")
    document["spec"][role]["replicas"] = 0
    with pytest.raises(InvalidSpec, match=rf"^spec.{role}.replicas: kubesgl up scales nothing"):
        local_plan(document)


def tp2_spec() -> dict[str, Any]:
    document = example("disaggregated")
    for role in ("prefill", "decode"):
        document["spec"][role].update(replicas=1, tensorParallelSize=2)
    return document


def test_each_replica_gets_its_own_gpus_as_cuda_visible_devices_names_them():
    local = plan(
        parse_inference_service(tp2_spec()),
        LocalSettings(gpus=("3", "5", "GPU-6", "GPU-7"), free_port=counting_ports()),
    )
    assert [(e.name, e.env["CUDA_VISIBLE_DEVICES"]) for e in local.engines] == [
        ("prefill-0", "3,5"),
        ("decode-0", "GPU-6,GPU-7"),
    ]


def test_more_gpus_than_there_are_is_a_clear_error():
    with pytest.raises(
        NotEnoughGpus, match=r"needs 4 GPUs .*prefill: 1 x 2, decode: 1 x 2.*has 3 \(0, 1, 2\)"
    ):
        plan(
            parse_inference_service(tp2_spec()),
            LocalSettings(gpus=("0", "1", "2"), free_port=counting_ports()),
        )


def test_without_a_gpu_or_with_device_cpu_the_engines_run_on_the_cpu():
    local = local_plan(tp2_spec(), gpus=0)
    assert local.notes == ("no GPU here: the engines run on the CPU",)
    assert {e.env["CUDA_VISIBLE_DEVICES"] for e in local.engines} == {""}  # no GPU in sight
    document = tp2_spec()
    document["spec"]["engine"]["device"] = "cpu"
    local = local_plan(document, gpus=4)
    assert not local.notes and all(e.gpus == () and "cpu" in e.argv for e in local.engines)


def test_a_claim_exists_only_in_a_cluster():
    document = example("mixed")
    with pytest.raises(InvalidSpec) as error:
        plan(parse_inference_service(document), LocalSettings(free_port=counting_ports()))
    assert str(error.value).startswith(
        "spec.model.pvc: a PersistentVolumeClaim exists only in a cluster"
    )
    assert local_plan(document).model_path == "/local/copy"


def test_the_api_key_comes_from_the_environment_instead_of_the_secret():
    document = example("quickstart")
    document["spec"]["engine"]["apiKeySecret"] = {"name": "keys", "key": "api"}
    with pytest.raises(InvalidSpec, match="spec.engine.apiKeySecret: .*set KUBESGL_API_KEY"):
        local_plan(document)
    local = local_plan(document, environ={"KUBESGL_API_KEY": "sk-local"})
    for process in local.processes:  # engines and router, in their environment and never in argv
        assert process.env["KUBESGL_API_KEY"] == "sk-local" and "--api-key" not in process.argv
        assert not [arg for arg in process.argv if "sk-local" in arg]
        inherited = process.environment(
            {"KUBESGL_API_KEY": "sk-local", "KUBESGL_ROUTER_ADMIN_KEY": "adm", "A": "1"}
        )
        assert (
            inherited["KUBESGL_API_KEY"] == "sk-local"
            and "KUBESGL_ROUTER_ADMIN_KEY" not in inherited
        )
        assert inherited["A"] == "1"


def test_the_router_admin_key_comes_from_the_environment_instead_of_the_secret():
    document = example("quickstart")
    document["spec"]["router"]["adminKeySecret"] = {"name": "keys", "key": "admin"}
    document["spec"]["engine"]["apiKeySecret"] = {"name": "keys", "key": "api"}
    with pytest.raises(InvalidSpec) as error:
        local_plan(document)
    assert [str(p) for p in error.value.problems] == [
        "spec.engine.apiKeySecret: kubesgl up reads no Secrets: set KUBESGL_API_KEY in the environment",
        "spec.router.adminKeySecret: kubesgl up reads no Secrets: set KUBESGL_ROUTER_ADMIN_KEY in the environment",
    ]
    local = local_plan(
        document, environ={"KUBESGL_API_KEY": "sk", "KUBESGL_ROUTER_ADMIN_KEY": "adm"}
    )
    assert local.router.env["KUBESGL_ROUTER_ADMIN_KEY"] == "adm"
    for engine in local.engines:
        assert "KUBESGL_ROUTER_ADMIN_KEY" not in engine.environment(
            {"KUBESGL_ROUTER_ADMIN_KEY": "adm"}
        )


def test_keys_in_this_environment_reach_no_process_whose_pod_lacks_them():
    """Without apiKeySecret the pods run without a key: so do the processes here, whatever this
    environment holds."""
    local = local_plan(example("quickstart"), environ={"KUBESGL_API_KEY": "sk"})
    for process in local.processes:
        environment = process.environment(
            {"KUBESGL_API_KEY": "sk", "KUBESGL_ROUTER_ADMIN_KEY": "adm", "PATH": "/bin"}
        )
        assert environment == {**process.env, "PATH": "/bin"}


@pytest.mark.parametrize("compile_cache", [None, {"claimName": "kernels"}])
def test_the_pods_environment_except_its_cache_folders(compile_cache):
    """A compile cache's folders are a claim's mount in the pod, none here: the engines tried
    to write FlashInfer's and Triton's kernels under /var/cache/kubesgl."""
    document = example("quickstart")
    if compile_cache is not None:
        document["spec"].setdefault("engine", {})["compileCache"] = compile_cache
    local = local_plan(document)
    for engine in local.engines:
        assert engine.env == {
            "HF_HUB_OFFLINE": "1",
            "UCX_TLS": "tcp",
            "UCX_NET_DEVICES": "lo",  # the one variable pods do not have (below)
            "CUDA_VISIBLE_DEVICES": "",
        }


def ucx_net_devices(document: dict[str, Any], environ: dict[str, str] | None = None) -> set:
    local = local_plan(document, environ=environ or {})
    return {engine.environment(environ or {}).get("UCX_NET_DEVICES") for engine in local.engines}


def test_ucx_keeps_to_the_loopback_device():
    """UCX's TCP transport (NIXL's) listened on the host's external address too, as well as on
    127.0.0.1, where docs/up.md said the engines listen only on 127.0.0.1."""
    assert ucx_net_devices(example("quickstart")) == {"lo"}
    document = example("quickstart")
    del document["spec"]["kvTransfer"]  # UCX takes every transport it has, tcp among them
    assert ucx_net_devices(document) == {"lo"}
    for transports in ("tcp,cuda_copy", "^rc", "all"):
        document["spec"]["kvTransfer"] = {"ucx": {"transports": transports}}
        assert ucx_net_devices(document) == {"lo"}, transports


def test_ucx_devices_named_by_the_spec_or_this_environment_stay():
    document = example("quickstart")
    document["spec"]["kvTransfer"]["ucx"]["netDevices"] = "eth1"
    assert ucx_net_devices(document) == {"eth1"}
    assert ucx_net_devices(example("quickstart"), {"UCX_NET_DEVICES": "eth2"}) == {"eth2"}
    # RDMA alone has no loopback device; tcp named only here counts too
    document = example("quickstart")
    document["spec"]["kvTransfer"]["ucx"]["transports"] = "rc,cuda_copy"
    assert ucx_net_devices(document) == {None}
    del document["spec"]["kvTransfer"]
    assert ucx_net_devices(document, {"UCX_TLS": "rc"}) == {None}
    assert ucx_net_devices(document, {"UCX_TLS": "tcp"}) == {"lo"}
    # mixed engines move no KV
    assert ucx_net_devices(example("mixed")) == {None}


@pytest.mark.parametrize(
    "transports",
    [
        "rc,tcp",
        "rc_mlx5,tcp",
        "tcp,rc_verbs",
        "ud,tcp",
        "tcp,ud_x",
        "dc_mlx5,tcp",
        "ib,tcp",
        "mlx5,tcp",
        "tcp,cuda_copy,rc_x",
        "tcp,ud:aux",
    ],
)
def test_ucx_keeps_its_devices_where_rdma_is_named_beside_tcp(transports):
    """UCX_NET_DEVICES=lo leaves UCX no InfiniBand device: an RDMA transport asked for beside tcp
    (rc,tcp) was silently left out, and the KV went over TCP on 127.0.0.1."""
    document = example("quickstart")
    document["spec"]["kvTransfer"]["ucx"]["transports"] = transports
    assert ucx_net_devices(document) == {None}
    del document["spec"]["kvTransfer"]
    assert ucx_net_devices(document, {"UCX_TLS": transports}) == {None}


def test_a_variable_with_an_empty_value_is_set_empty():
    """Render leaves an empty value out, as the API server does; the pod's variable is still
    set, to "", and so is the local process's."""
    document = example("quickstart")
    document["spec"]["decode"]["env"] = [{"name": "EMPTY", "value": ""}]
    (decode,) = (e for e in local_plan(document).engines if "decode" in e.name)
    assert decode.env["EMPTY"] == ""


def test_models_made_or_downloaded_by_init_containers_go_to_the_cache():
    quickstart = example("quickstart")
    step = local_plan(quickstart).model_step
    assert step is not None and step.path == Path("/cache/models/tiny-llama")
    prefill = next(
        o for o in render(parse_inference_service(quickstart)) if o["kind"] == "Deployment"
    )
    (init,) = prefill["spec"]["template"]["spec"]["initContainers"]
    assert init["command"] + init["args"] == [
        "kubesgl",
        "make-tiny-model",
        "/models/tiny",
        "--arch",
        "llama",
    ]
    assert step.argv(Path("/tmp/x")) == [*KUBESGL, "make-tiny-model", "/tmp/x", "--arch", "llama"]

    disaggregated = example("disaggregated")
    commit = disaggregated["spec"]["model"]["huggingFace"]["revision"]
    hf = local_plan(disaggregated, environ={"HF_TOKEN": "hf_x"}).model_step
    assert hf is not None and hf.path == Path(
        f"/cache/models/hf/meta-llama/Llama-3.1-8B-Instruct/{commit}"
    )
    assert hf.argv(Path("/tmp/x")) == [
        "hf",
        "download",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--revision",
        commit,
        "--local-dir",
        "/tmp/x",
        "--exclude",
        "original/*",  # Meta's original checkpoint, which the engine never reads
    ]
    assert hf.env == {"HF_TOKEN": "hf_x"}

    keda = local_plan(example("autoscaled-keda"), gpus=4)
    assert (
        keda.model_step is None and keda.model_path == "/mnt/models/llama-3.1-8b-instruct"
    )  # hostPath


def test_stop_timeouts_are_the_pods_grace_periods_without_the_prestop_pause():
    document = example("quickstart")
    document["spec"]["engine"]["shutdownTimeoutSeconds"] = 7
    local = local_plan(document)
    assert {e.stop_timeout_s for e in local.engines} == {
        7 + 22 + 5
    }  # the drain, the exit after it, slack
    # the router's graceful shutdown (the engines' drain, its --shutdown-timeout), and slack
    assert local.router.stop_timeout_s == 7 + 5
    assert local.router.waits_for == (contract.PREFILL, contract.DECODE)


def test_the_routers_url_brackets_an_ipv6_address():
    router = local_plan(example("quickstart"), host="::1").router
    assert router.url == f"http://[::1]:{router.port}"


def test_the_router_serving_the_socket_of_kubesgl_up_is_given_no_address_beside_it():
    """The router refuses --host and --port beside --fd, which it would ignore."""
    local = local_plan(example("quickstart"), host="0.0.0.0", port=9000)
    argv = serving_on(local, 7).router.argv
    assert list(argv[:4]) == [*KUBESGL, "router"] and argv[-2:] == ("--fd", "7")
    assert "--host" not in argv and "--port" not in argv
    check_router_args(list(argv[4:]), {})


def test_the_routers_address_in_its_extra_args_gives_way_to_the_socket_too():
    """Router extraArgs may repeat the rendered address as --port=8000 (the operator refuses
    only a changed one): dropped beside --fd as --port 8000 is, not refused by the router."""
    document = example("quickstart")
    document["spec"].setdefault("router", {})["extraArgs"] = ["--port=8000", "--host=0.0.0.0"]
    argv = serving_on(local_plan(document), 7).router.argv
    assert not any(arg.startswith(("--host", "--port")) for arg in argv), argv
    check_router_args(list(argv[4:]), {})


def test_a_router_on_every_address_is_reached_on_127_0_0_1():
    """An empty --host is every IPv4 address, as 0.0.0.0 (kubesgl/listen.py, as uvicorn)."""
    for host in ("", "0.0.0.0", "::"):
        router = local_plan(example("quickstart"), host=host).router
        assert router.url == f"http://127.0.0.1:{router.port}"


def test_ports_come_from_outside_the_range_of_outgoing_connections(monkeypatch) -> None:
    """A port that binding port 0 gives is in the kernel's range for outgoing connections: any
    connection could take it before the engine binds it, and a prefill engine crash-looped on
    its bootstrap port so (a replica restarts on the same port)."""
    import socket

    from kubesgl.up import plan as plan_module

    monkeypatch.setattr(plan_module, "_outgoing_ports", lambda: range(32768, 61000))
    pick = plan_module.PortPicker()
    ports = [pick() for _ in range(40)]
    assert all(port in plan_module.PORT_RANGE for port in ports)
    assert len(set(ports)) == len(ports)  # a plan picks them all before any is bound
    with socket.socket() as taken:
        taken.bind((ENGINE_HOST, 0))
        busy = taken.getsockname()[1]
        taken.listen()
        monkeypatch.setattr(plan_module, "PORT_RANGE", range(busy, busy + 1))
        monkeypatch.setattr(plan_module, "_outgoing_ports", lambda: range(0))
        assert plan_module.PortPicker()() != busy  # in use: another free port instead


def test_no_engine_gets_the_routers_port(monkeypatch) -> None:
    """The router binds its --port only once the engines are ready: free when the engines' ports
    were picked, it went to an engine, and the router could not listen ("a configuration
    error")."""
    from kubesgl.up import plan as plan_module

    router_port = 27490
    monkeypatch.setattr(plan_module, "PORT_RANGE", range(router_port, router_port + 1))
    monkeypatch.setattr(plan_module, "_outgoing_ports", lambda: range(0))
    local = local_plan(example("quickstart"), port=router_port, free_port=plan_module.PortPicker())
    assert local.router.port == router_port
    taken = [engine.port for engine in local.engines]
    taken += [engine.bootstrap_port for engine in local.engines if engine.bootstrap_port]
    assert router_port not in taken and len(set(taken)) == len(taken)

    ports = iter([41000, 41001, 41002, 41003])  # any picker: the router's comes first here
    local = local_plan(example("quickstart"), port=41000, free_port=lambda: next(ports))
    assert {engine.port for engine in local.engines} == {41001, 41003}
