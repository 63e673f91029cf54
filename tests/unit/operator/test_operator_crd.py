"""The CRD: a valid apiextensions/v1 object whose schema equals the pydantic model's, accepts
every example and rejects bad specs naming the field."""

from __future__ import annotations

import argparse
import re
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from operator_fixtures import EXAMPLES, REPO, crd, crd_schema, load_example, with_changes

from kubesgl.engine.server.options import build_parser as engine_parser
from kubesgl.operator.render.autoscaling import DEFAULT_SCALE_UP
from kubesgl.operator.spec import InferenceServiceSpec
from kubesgl.router.cli import build_parser as router_parser

K8S_VERSION = kubernetes_validate.utils.latest_version()


def test_the_crd_validates_against_the_kubernetes_schema() -> None:
    kubernetes_validate.validate(crd(), K8S_VERSION, strict=True)


def test_names_columns_and_status_subresource() -> None:
    spec = crd()["spec"]
    assert (spec["group"], spec["names"]["kind"], spec["names"]["shortNames"]) == (
        "kubesgl.io",
        "InferenceService",
        ["kisvc"],
    )
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = {column["name"] for column in version["additionalPrinterColumns"]}
    assert {"Mode", "Ready", "Prefill", "Decode", "Mixed", "Router", "Age"} <= columns


# Properties that need no description here: the API server publishes a custom resource's
# apiVersion and kind with TypeMeta's own schema and its metadata as a reference to ObjectMeta,
# each with Kubernetes' description (apiextensions-apiserver, controller/openapi/builder), so
# `kubectl explain inferenceservice.metadata` shows Kubernetes' text, not the CRD's.
DESCRIBED_BY_KUBERNETES = {".apiVersion", ".kind", ".metadata"}


def _undescribed(schema: dict[str, Any], path: str = "") -> list[str]:
    """The properties under `schema` (through array items and map values) without a description:
    `kubectl explain` would show nothing for them."""
    missing = []
    for name, sub in (schema.get("properties") or {}).items():
        field = f"{path}.{name}"
        if not str(sub.get("description", "")).strip() and field not in DESCRIBED_BY_KUBERNETES:
            missing.append(field)
        missing += _undescribed(sub, field)
    if isinstance(schema.get("items"), dict):
        missing += _undescribed(schema["items"], path + "[]")
    if isinstance(schema.get("additionalProperties"), dict):
        missing += _undescribed(schema["additionalProperties"], path + "{}")
    return missing


def test_every_field_has_a_description() -> None:
    """A platform engineer reads the CRD through `kubectl explain inferenceservice.spec...`:
    every property has a description (the anchors' once for each place they are used)."""
    assert _undescribed(crd_schema()) == []


def test_the_default_scale_up_is_the_one_the_crd_and_the_docs_state() -> None:
    """The operator's default scale-up is declared once (render/autoscaling.py); the CRD's
    description (`kubectl explain`) and docs/operator.md restate it."""
    autoscaling = crd_schema()["properties"]["spec"]["properties"]["autoscaling"]
    scale_up = autoscaling["properties"]["behavior"]["properties"]["scaleUp"]["description"]
    policies = ", ".join(
        f"{{type: {p['type']}, value: {p['value']}, periodSeconds: {p['periodSeconds']}}}"
        for p in DEFAULT_SCALE_UP["policies"]
    )
    assert (
        f"(stabilizationWindowSeconds {DEFAULT_SCALE_UP['stabilizationWindowSeconds']}, "
        f"selectPolicy {DEFAULT_SCALE_UP['selectPolicy']}, policies [{policies}])"
    ) in scale_up
    docs = (REPO / "docs" / "operator.md").read_text()
    section = docs[docs.index("**Scale-up while engines load**") :]
    start = section.index("```yaml\n") + len("```yaml\n")
    block = section[start : section.index("```", start)]
    assert yaml.safe_load(block)["autoscaling"]["behavior"]["scaleUp"] == DEFAULT_SCALE_UP


def _flag_default(parser: argparse.ArgumentParser, field: str) -> object:
    flag = "--" + re.sub(r"([A-Z])", r"-\1", field).lower()
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    return action.default


@pytest.mark.parametrize(
    ("block", "parser"), [("engine", engine_parser), ("router", router_parser)]
)
def test_a_default_a_description_names_is_its_flags(block, parser) -> None:
    """A field the operator leaves unset takes its flag's default, which its description
    names ("unset: 256"): the two must agree, or `kubectl explain` tells what no engine does.
    A flag without a default (resolved at start, as memFractionStatic by device) is not checked."""
    fields = crd_schema()["properties"]["spec"]["properties"][block]["properties"]
    checked = 0
    for field, schema in fields.items():
        named = re.findall(r"unset: ([0-9.]+)\b", schema["description"])
        default = _flag_default(parser(), field) if named else None
        if default is not None:
            assert [float(n) for n in named] == [float(default)], field
            checked += 1
    assert checked >= 2  # engine: pageSize, maxRunningRequests, ...; router: the thresholds


def _canonical(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Reduce a CRD or pydantic JSON schema to what both must agree on."""
    if "$ref" in schema:  # pydantic puts a model-valued field's default beside the reference
        default = schema.get("default")
        schema = defs[schema["$ref"].rsplit("/", 1)[1]]
        if default is not None:
            schema = {**schema, "default": default}
    options = schema.get("anyOf")
    if options:
        kinds = [option.get("type") for option in options if option.get("type") != "null"]
        if "string" in kinds and None in kinds:  # a string or a model: untyped in the CRD
            return {"type": "any"}
        if sorted(kinds) == ["integer", "string"]:
            (string,) = [option for option in options if option.get("type") == "string"]
            return _int_or_string(string.get("pattern"))
        (schema,) = [option for option in options if option.get("type") != "null"]
        return _canonical(schema, defs)
    if schema.get("x-kubernetes-int-or-string"):
        return _int_or_string(schema.get("pattern"))
    if schema.get("x-kubernetes-preserve-unknown-fields") and "type" not in schema:
        return {"type": "any"}
    result: dict[str, Any] = {"type": schema.get("type", "object")}
    for key in ("enum", "minimum", "maximum", "pattern", "minLength", "maxLength", "minItems"):
        if key in schema:
            result[key] = schema[key]
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if schema.get(exclusive) is True:  # OpenAPI v3.0 (CRD) form
            result[exclusive] = result.pop(bound)
        elif exclusive in schema:  # JSON Schema (pydantic) form
            result[exclusive] = schema[exclusive]
    if "const" in schema:
        result["enum"] = [schema["const"]]
    if schema.get("default") not in (None, {}, []):
        result["default"] = _without_nulls(schema["default"])
    if "properties" in schema:
        result["properties"] = {
            name: _canonical(sub, defs) for name, sub in schema["properties"].items()
        }
        result["required"] = sorted(schema.get("required", []))
    if isinstance(schema.get("additionalProperties"), dict):
        result["additionalProperties"] = _canonical(schema["additionalProperties"], defs)
    if "items" in schema:
        result["items"] = _canonical(schema["items"], defs)
    return result


def _int_or_string(pattern: str | None) -> dict[str, Any]:
    """A quantity's schema: its pattern applies to the string form."""
    return {"type": "int-or-string"} | ({} if pattern is None else {"pattern": pattern})


def _without_nulls(value: Any) -> Any:
    """pydantic writes the unset fields of a model in a default as null; the CRD leaves them out."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def test_the_pydantic_model_mirrors_the_crd_schema() -> None:
    model = InferenceServiceSpec.model_json_schema(by_alias=True)
    ours = _canonical(model, model.get("$defs", {}))
    theirs = _canonical(crd_schema()["properties"]["spec"], {})
    assert ours == theirs


def _strict(schema: Any) -> Any:
    """The CRD schema with unknown fields rejected, as kubectl's strict field validation does."""
    if isinstance(schema, dict):
        schema = {key: _strict(value) for key, value in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    return schema


def crd_errors(document: dict[str, Any]) -> list[str]:
    schema = _strict(crd_schema())
    schema["properties"]["metadata"] = {"type": "object"}
    validator = jsonschema.Draft4Validator(schema)
    return [
        ".".join(str(part) for part in error.absolute_path) + ": " + error.message
        for error in validator.iter_errors(document)
    ]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_passes_the_crd_schema(path) -> None:
    assert crd_errors(yaml.safe_load(path.read_text())) == []


@pytest.mark.parametrize(
    ("example", "path", "value", "field", "words"),
    [
        ("mixed.yaml", "spec.mode", "split", "spec.mode", "is not one of"),
        ("mixed.yaml", "spec.mixed.replicas", -1, "spec.mixed.replicas", "less than the minimum"),
        ("mixed.yaml", "spec.mixed.replica", 2, "spec.mixed", "'replica' was unexpected"),
        ("mixed.yaml", "spec.image", ..., "spec", "'image' is a required property"),
        (
            "mixed.yaml",
            "spec.model.hostPath",
            {"path": "/m"},
            "spec.model",
            "is valid under each of",
        ),
        ("mixed.yaml", "spec.model.pvc.path", 3, "spec.model.pvc.path", "is not of type 'string'"),
        ("mixed.yaml", "spec.engine.dtype", "fp8", "spec.engine.dtype", "is not one of"),
        (
            "autoscaled-hpa.yaml",
            "spec.autoscaling.decode.target",
            0.0004,
            "spec.autoscaling.decode.target",
            "is less than the minimum of 0.001",
        ),
        (
            "autoscaled-hpa.yaml",
            "spec.autoscaling.decode.maxReplicas",
            ...,
            "spec.autoscaling.decode",
            "'maxReplicas' is a required property",
        ),
        (
            "autoscaled-hpa.yaml",
            "spec.autoscaling.provider",
            "vpa",
            "spec.autoscaling.provider",
            "is not one of",
        ),
        (
            "autoscaled-hpa.yaml",
            "spec.autoscaling.behavior",
            {"scaleUp": {"stabilizationWindowSeconds": 3601}},
            "spec.autoscaling.behavior.scaleUp.stabilizationWindowSeconds",
            "is greater than the maximum of 3600",
        ),
        (
            "autoscaled-keda.yaml",
            "spec.autoscaling.behavior",
            {"scaleDown": {"policies": []}},
            "spec.autoscaling.behavior.scaleDown.policies",
            "should be non-empty",
        ),
        (
            "autoscaled-hpa.yaml",
            "spec.autoscaling.behavior",
            {"scaleUp": {"policies": [{"type": "Pods", "value": 2}]}},
            "spec.autoscaling.behavior.scaleUp.policies.0",
            "'periodSeconds' is a required property",
        ),
        (
            "mixed.yaml",
            "spec.mixed.resources.limits.memory",
            "64 Gi",
            "spec.mixed.resources.limits.memory",
            "does not match",
        ),
        (
            "disaggregated.yaml",
            "spec.model.huggingFace.sizeLimit",
            "40 Gi",
            "spec.model.huggingFace.sizeLimit",
            "does not match",
        ),
        (
            "quickstart.yaml",
            "spec.decode.shmSizeLimit",
            "-1Gi",
            "spec.decode.shmSizeLimit",
            "does not match",
        ),
        (
            "disaggregated.yaml",
            "spec.monitoring.podMonitor.interval",
            "often",
            "spec.monitoring.podMonitor.interval",
            "does not match",
        ),
    ],
)
def test_the_crd_schema_rejects_bad_specs_naming_the_field(
    example, path, value, field, words
) -> None:
    errors = crd_errors(with_changes(load_example(example), path, value))
    assert any(error.startswith(field + ":") and words in error for error in errors), errors
