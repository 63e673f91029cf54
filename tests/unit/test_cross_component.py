"""Contracts between components: the command lines the operator renders are the ones the
engine and the router accept."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubesgl.operator.render import render
from kubesgl.operator.validation import parse_inference_service

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def containers(source: Path | dict):
    """Containers of the Deployments rendered from an example file or an InferenceService."""
    obj = yaml.safe_load(source.read_text()) if isinstance(source, Path) else source
    for child in render(parse_inference_service(obj)):
        if child["kind"] == "Deployment":
            yield from child["spec"]["template"]["spec"]["containers"]


def engine_args(source: Path | dict) -> list[str]:
    return next(c for c in containers(source) if c["args"][0] == "serve")["args"][1:]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_rendered_engine_args_parse_with_kubesgl_serve(path):
    from kubesgl.engine.server.options import build_parser

    engines = [c for c in containers(path) if c["args"][0] == "serve"]
    assert engines
    for container in engines:
        args = [a.replace("$(KUBESGL_API_KEY)", "key") for a in container["args"][1:]]
        parsed = build_parser().parse_args(args)
        assert parsed.port == int(container["ports"][0]["containerPort"])
        engine_spec = yaml.safe_load(path.read_text())["spec"].get("engine", {})
        assert parsed.kv_cache_dtype == engine_spec.get("kvCacheDtype", "auto")
        assert parsed.dtype == engine_spec.get("dtype", "auto")


def test_the_engine_pod_settings_of_the_crd_reach_the_engine():
    """The `spec.engine` fields that are no engine option (test_engine_options.py holds those
    to their exact values): the pod's log level and shutdown timeout."""
    from kubesgl.engine.server.options import build_parser

    spec = yaml.safe_load(EXAMPLES[0].read_text())
    spec["spec"].setdefault("engine", {}).update(logLevel="debug", shutdownTimeoutSeconds=7)
    parsed = build_parser().parse_args(engine_args(spec))
    assert parsed.log_level == "debug" and parsed.shutdown_timeout == 7


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_rendered_router_args_parse_with_kubesgl_router(path):
    from kubesgl.router.cli import build_parser, config_from_args

    routers = [c for c in containers(path) if c["args"][0] == "router"]
    assert len(routers) == 1
    args = build_parser().parse_args(routers[0]["args"][1:])
    config_from_args(args)  # the rendered options are consistent, not only parseable
    assert args.port == int(routers[0]["ports"][0]["containerPort"])
    assert args.kube_namespace and args.kube_selector  # discovers the engine pods by label


def test_the_crds_router_policies_are_the_routers():
    from kubesgl.operator.spec import RouterSpec
    from kubesgl.router.policies import POLICY_NAMES

    crd = yaml.safe_load((EXAMPLES[0].parents[1] / "crds" / "inferenceservice.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    policy = spec["properties"]["router"]["properties"]["policy"]
    assert tuple(policy["enum"]) == POLICY_NAMES
    assert typing.get_args(RouterSpec.model_fields["policy"].annotation) == POLICY_NAMES


def test_engine_pods_name_the_port_the_router_looks_for():
    """The router finds a pod's engine at the container port named `http`."""
    for path in EXAMPLES:
        for container in containers(path):
            if container["args"][0] == "serve":
                assert container["ports"][0]["name"] == "http"


def test_the_key_variables_the_pods_get_are_the_ones_engine_and_router_read():
    """The operator renders the keys as environment variables (never flags), under the
    contract's names, which the engine and the router read."""
    from kubesgl.contract import ADMIN_KEY_ENV, API_KEY_ENV

    document = yaml.safe_load(EXAMPLES[0].read_text())
    document["spec"].setdefault("engine", {})["apiKeySecret"] = {"name": "keys", "key": "api"}
    document["spec"].setdefault("router", {})["adminKeySecret"] = {"name": "keys", "key": "admin"}
    for container in containers(document):
        names = {variable["name"] for variable in container["env"]}
        assert API_KEY_ENV in names
        assert (ADMIN_KEY_ENV in names) == (container["args"][0] == "router")


def _router_sequences(path: str, body: dict) -> int | None:
    """The sequences the router counts in a request (a bootstrap room each); None: a 400."""
    from kubesgl.router.errors import RouterError
    from kubesgl.router.request_parsing import parse_generation_request

    try:
        return parse_generation_request(path, json.dumps(body).encode()).choices
    except RouterError:
        return None


def _engine_takes(model: type, body: dict) -> Any:
    """The engine's reading of a request body, or None where it answers 400."""
    from pydantic import ValidationError

    try:
        return model.model_validate(body)
    except ValidationError:
        return None


@pytest.mark.parametrize("n", [1, 2, 2.0, 64, 64.0, 0, 65, 2.5, -1.0, True, "2", 1e300])
def test_the_router_takes_exactly_the_n_an_engine_takes(n):
    """The router counts the sequences of a request (one bootstrap room each) from `n`: it must
    read it as engines do (`"n": 2.0` was a 400 at the router, a 200 at the engine)."""
    from kubesgl.engine.server.protocol import CompletionRequest

    body = {"model": "m", "prompt": "x", "n": n}
    request = _engine_takes(CompletionRequest, body)
    assert _router_sequences("/v1/completions", body) == (request.n if request else None)


@pytest.mark.parametrize(
    "body",
    [{"n": 2}, {"sampling_params": {"n": 2}}, {"sampling_params": {"n": 1.0}}, {"n": "x"}],
    ids=["top-level-n", "sampling-n", "sampling-n-1.0", "top-level-junk"],
)
def test_the_router_counts_the_sequences_of_generate_as_engines_answer_them(body):
    """/generate answers one sequence per prompt: engines drop a top-level `n` and refuse
    `sampling_params.n` other than 1; the router drew a bootstrap room per `n`, so P/D
    answered 400 where a mixed engine answered 200."""
    from kubesgl.engine.server.protocol import GenerateRequestBody

    body = {"text": "x", **body}
    engine_sequences = 1 if _engine_takes(GenerateRequestBody, body) else None
    assert _router_sequences("/generate", body) == engine_sequences
