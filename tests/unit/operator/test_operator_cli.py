"""`kubesgl operator` where no cluster can be reached: one line saying what it tried, status 1,
no traceback and no retrying (kopf alone would log tracebacks and retry forever)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import yaml

from kubesgl.operator.cli import parse_args


def run_operator(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")
    }
    return subprocess.run(
        [sys.executable, "-m", "kubesgl", "operator", "--liveness-port", "0"],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_without_credentials_it_names_what_it_tried(tmp_path):
    missing = tmp_path / "no-such-kubeconfig"
    result = run_operator({"KUBECONFIG": str(missing)})
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(
        "kubesgl operator: no Kubernetes cluster reachable: tried in-cluster credentials"
    )
    assert str(missing) in result.stderr


def test_an_api_server_that_does_not_answer_is_named(tmp_path):
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = f"https://127.0.0.1:{port}"
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    result = run_operator({"KUBECONFIG": str(kubeconfig)})
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert f"tried the Kubernetes API at {server}: " in result.stderr and "refused" in result.stderr


def test_a_liveness_port_out_of_range_is_a_usage_error(capsys):
    """It was taken as any integer: kopf failed to bind it only once the cluster answered."""
    for bad in ("70000", "-1", "http"):
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--liveness-port", bad])
        assert exit_.value.code == 2
        assert f"a port from 0 to 65535, not '{bad}'" in capsys.readouterr().err
    assert parse_args(["--liveness-port", "0"]).liveness_port == 0  # 0 turns the probe off
