"""`kubesgl make-tiny-model`: the architectures the operator may render (kubesgl.contract), and
files every user can read whatever the umask (the engine in a pod runs as uid 1000, maybe not
the init container's user)."""

from __future__ import annotations

import stat
import subprocess
import sys

from kubesgl import contract
from kubesgl.engine.models import tiny


def test_makes_every_architecture_of_the_contract():
    assert tuple(tiny._ARCHS) == contract.TINY_ARCHS


def test_files_are_readable_by_other_users_under_a_strict_umask(tmp_path):
    out = tmp_path / "models" / "tiny"
    subprocess.run(
        [sys.executable, "-m", "kubesgl", "make-tiny-model", str(out), "--arch", "llama"],
        check=True,
        capture_output=True,
        umask=0o077,
        timeout=300,
    )
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    files = list(out.iterdir())
    assert {f.name for f in files} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    for file in files:
        assert stat.S_IMODE(file.stat().st_mode) == 0o644, file.name
