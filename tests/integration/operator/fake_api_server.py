"""A Kubernetes API for tests and benchmarks: kmock's stateful emulator plus the API-server
behaviour the operator relies on. Needs the `test` extra (kmock).

kmock keeps objects as plain JSON and merges patches into them. On top of that, this adds:
- metadata the API server assigns: uid, creationTimestamp, resourceVersion, a generation
  that grows when the spec changes, and a name from a generateName;
- server-side apply: a PATCH with `application/apply-patch+yaml` creates a missing object, and
  fields that the same field manager applied before but no longer applies are removed unless
  another manager applies them too (shared ownership); `metadata.managedFields` lists what
  each manager applies; an apply that changes nothing writes nothing and sends no watch
  event, like the real server;
- two of the server's own checks, for the tests of a refused apply: a container's resource
  request above its limit is a 422 Invalid, and with `fieldValidation=Strict` a field a
  built-in kind's schema does not declare is a 400 BadRequest (kubernetes-validate's strict
  schemas), each with the server's kind of message.
Not emulated: controllers (no pods or replica sets are made), garbage collection, admission,
defaulting (a field removed by an apply is absent, not reset to its default), ownership taken
by plain PATCH, PUT or /scale writes (every managedFields entry is an Apply), and conflicts
(an apply without force never answers 409).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import itertools
import re
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp.web
import kmock
import kubernetes
import kubernetes_validate
import yaml
from kmock._internal import rendering
from kubernetes.utils import parse_quantity

from kubesgl.operator.kube import CHILD_KINDS, INFERENCE_SERVICE

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
_SCHEMA_VERSION = kubernetes_validate.utils.latest_version()


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """Maps merge key by key; lists and scalars are replaced."""
    merged = copy.deepcopy(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _without(
    obj: dict[str, Any], old: dict[str, Any], new: dict[str, Any], others: list[dict[str, Any]]
) -> dict[str, Any]:
    """obj minus the fields present in old but absent from new (what a manager stopped
    applying), except those that another manager's applied configuration (`others`) holds."""
    result = copy.deepcopy(obj)
    for key, value in old.items():
        if key not in new:
            if not any(key in other for other in others):
                result.pop(key, None)
        elif (
            isinstance(value, dict)
            and isinstance(new[key], dict)
            and isinstance(result.get(key), dict)
        ):
            deeper = [other[key] for other in others if isinstance(other.get(key), dict)]
            result[key] = _without(result[key], value, new[key], deeper)
    return result


def _fields_v1(applied: dict[str, Any]) -> dict[str, Any]:
    """The API server's FieldsV1 of an applied configuration (maps field by field, lists whole)."""
    return {
        f"f:{key}": _fields_v1(value) if isinstance(value, dict) else {}
        for key, value in applied.items()
        if key not in ("apiVersion", "kind")
    }


class KubernetesApiServer(kmock.KubernetesEmulator):
    """Serve it with `kmock.Server(api)`; `api.objects` holds what the operator wrote."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(1)
        self._applied: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.resources.load_bundled()
        self.resources[f"{INFERENCE_SERVICE.api_version}/{INFERENCE_SERVICE.plural}"] = (
            kmock.ResourceInfo(
                kind=INFERENCE_SERVICE.kind,
                namespaced=True,
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
                subresources={"status"},
                shortnames={"kisvc"},
            )
        )
        for kind in CHILD_KINDS:
            if kind.group in ("keda.sh", "monitoring.coreos.com"):
                self.resources[f"{kind.api_version}/{kind.plural}"] = kmock.ResourceInfo(
                    kind=kind.kind,
                    namespaced=True,
                    verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
                )

    async def _serve_list(self, request: rendering.Request) -> Any:
        # Label selectors filter as on the real server (equality terms only); the list names its
        # kind, which clients such as the dynamic client need.
        listing = await super()._serve_list(request)
        assert isinstance(listing, dict)  # kmock lists are {"metadata": ..., "items": [...]}
        selector = _parse_selector(request.params.get("labelSelector", ""))
        listing["items"] = [
            item
            for item in listing["items"]
            if selector.items() <= (item.get("metadata", {}).get("labels") or {}).items()
        ]
        resource = request.resource
        assert resource is not None  # only resource requests are lists
        kind = self.resources[resource].kind if resource in self.resources else None
        api_version = f"{resource.group}/{resource.version}" if resource.group else "v1"
        return {"apiVersion": api_version, "kind": f"{kind}List", **listing}

    def _stamp(self, meta: dict[str, Any]) -> None:
        meta["resourceVersion"] = str(next(self._versions))

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if request.resource is not None and request.method == "PATCH" and request.name:
            content_type = request.headers.get("Content-Type", "")
            if content_type.startswith(APPLY_CONTENT_TYPE):
                return await self._apply(request)
            self._prepare_update(request)
        if (
            request.resource is not None
            and request.method == "POST"
            and isinstance(request.data, dict)
        ):
            self._prepare_create(request.data)
        return await super()._handle(request)

    def _prepare_create(self, data: dict[str, Any]) -> None:
        meta = data.setdefault("metadata", {})
        if "name" not in meta and "generateName" in meta:  # kopf's Events: each its own
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        meta["generation"] = 1
        self._stamp(meta)

    def _prepare_update(self, request: rendering.Request) -> None:
        key = _object_key(request)
        if (
            key not in self.objects
            or self.objects[key].deleted
            or not isinstance(request.data, dict)
        ):
            return
        current = self.objects[key].raw
        meta = request.data.setdefault("metadata", {})
        if request.subresource is None and "spec" in request.data:
            new_spec = _merge({"spec": current.get("spec", {})}, {"spec": request.data["spec"]})
            if new_spec["spec"] != current.get("spec", {}):
                meta["generation"] = current["metadata"].get("generation", 1) + 1
        self._stamp(meta)

    async def _apply(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        applied = request.data
        assert isinstance(applied, dict)  # an apply's body is a YAML or JSON object
        invalid = _requests_above_limits(applied)
        if invalid:
            message = f'{applied.get("kind")} "{request.name}" is invalid: {invalid}'
            return _failure(422, "Invalid", message)
        undeclared = (
            _undeclared_field(applied) if request.params.get("fieldValidation") == "Strict" else ""
        )
        if undeclared:
            kind = f"{applied.get('apiVersion')}, Kind={applied.get('kind')}"
            return _failure(
                400, "BadRequest", f"failed to create typed patch object ({kind}): {undeclared}"
            )
        manager = request.params.get("fieldManager", "")
        key = _object_key(request)
        async with self._lock:
            exists = key in self.objects and not self.objects[key].deleted
            if not exists:  # a new life: what managers applied to an earlier one is gone
                for entry in [entry for entry in self._applied if entry[:-1] == key]:
                    del self._applied[entry]
            previous = self._applied.get((*key, manager), {})
            self._applied[(*key, manager)] = copy.deepcopy(applied)
            managed = [
                {
                    "manager": entry[-1],
                    "operation": "Apply",
                    "apiVersion": config.get("apiVersion"),
                    "fieldsType": "FieldsV1",
                    "fieldsV1": _fields_v1(config),
                }
                for entry, config in self._applied.items()
                if entry[:-1] == key
            ]
            if not exists:
                obj = copy.deepcopy(applied)
                self._prepare_create(obj)
                obj["metadata"]["managedFields"] = managed
                event = "ADDED"
            else:
                current = self.objects[key].raw
                others = [
                    config
                    for entry, config in self._applied.items()
                    if entry[:-1] == key and entry[-1] != manager
                ]
                obj = _merge(_without(current, previous, applied, others), applied)
                obj["metadata"]["managedFields"] = managed
                if obj == current:
                    return aiohttp.web.json_response(current)
                if obj.get("spec") != current.get("spec"):
                    obj["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
                self._stamp(obj["metadata"])
                event = "MODIFIED"
            if exists:
                self.objects[key].history.append(obj)
            elif key in self.objects:  # deleted before: a new life in the same history
                self.objects[key].create(obj)
            else:
                self.objects[key] = obj
            raw = self.objects[key].raw
            await self._buses[key[0]].put({"type": event, "object": raw})
        return aiohttp.web.json_response(raw)


def _failure(code: int, reason: str, message: str) -> aiohttp.web.Response:
    status = {"kind": "Status", "apiVersion": "v1", "status": "Failure"}
    return aiohttp.web.json_response(
        {**status, "reason": reason, "code": code, "message": message}, status=code
    )


def _undeclared_field(obj: dict[str, Any]) -> str:
    """The API server's words for the first field of a built-in kind that its schema does not
    declare, or "" (kinds of CRDs are not checked)."""
    try:
        kubernetes_validate.validate(obj, _SCHEMA_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return ""
    except kubernetes_validate.ValidationError as error:
        unexpected = re.search(r"\('([^']+)' was unexpected", error.message)
        if error.validator == "additionalProperties" and unexpected:
            path = "".join(
                f"[{part}]" if isinstance(part, int) else f".{part}" for part in error.absolute_path
            )
            return f"{path}.{unexpected.group(1)}: field not declared in schema"
    return ""


def _requests_above_limits(obj: dict[str, Any]) -> str:
    """The API server's error for a pod template's container requesting more of a resource
    than its limit, or "" (quantities compared as Kubernetes reads them)."""
    template = obj.get("spec", {}).get("template", {}).get("spec", {})
    for i, container in enumerate(template.get("containers", [])):
        resources = container.get("resources", {})
        limits = resources.get("limits", {})
        for name, request in resources.get("requests", {}).items():
            if name in limits and parse_quantity(request) > parse_quantity(limits[name]):
                return (
                    f"spec.template.spec.containers[{i}].resources.requests: Invalid value: "
                    f'"{request}": must be less than or equal to {name} limit of {limits[name]}'
                )
    return ""


def _object_key(request: rendering.Request) -> tuple[kmock.resource, str | None, str]:
    """The key of the object a PATCH names (its resource, namespace and name)."""
    assert request.resource is not None and request.name is not None
    return request.resource, request.namespace, request.name


def _parse_selector(selector: str) -> dict[str, str]:
    terms = [term.split("=", 1) for term in selector.split(",") if term]
    if any(len(term) != 2 or term[0].endswith("!") for term in terms):
        raise NotImplementedError(f"only k=v label selectors are emulated: {selector!r}")
    return {key: value.lstrip("=") for key, value in terms}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class RunningApiServer:
    api: KubernetesApiServer
    url: str

    def write_kubeconfig(self, path: Path) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "emulator"}}],
            "contexts": [
                {"name": "emulator", "context": {"cluster": "emulator", "user": "tester"}}
            ],
            "current-context": "emulator",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def client(self) -> kubernetes.client.ApiClient:
        configuration = kubernetes.client.Configuration()
        configuration.host = self.url
        return kubernetes.client.ApiClient(configuration)


@contextlib.contextmanager
def running_api_server() -> Iterator[RunningApiServer]:
    """The emulator on a loopback port, served from its own thread so that callers can use
    blocking clients (the kubernetes client, an operator in a subprocess)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="kube-api-emulator", daemon=True)
    thread.start()
    stack = contextlib.AsyncExitStack()

    async def start() -> RunningApiServer:
        api = await stack.enter_async_context(KubernetesApiServer())
        server = await stack.enter_async_context(kmock.Server(api))
        return RunningApiServer(api, str(server.url).rstrip("/"))

    try:
        yield asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
    finally:
        asyncio.run_coroutine_threadsafe(stack.aclose(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
