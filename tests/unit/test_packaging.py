"""The repository's own promises: every package is installed, nothing shadows the standard
library, and CI runs exactly the README's test command."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# The component folders and the links in kubesgl/ that make them kubesgl's subpackages
COMPONENTS = {
    "engine": "kubesgl/engine",
    "router": "kubesgl/router",
    "operator": "kubesgl/operator",
}


def test_the_component_folders_are_kubesgls_subpackages_through_links():
    """kubesgl/ is the whole package: Python run from the root (pytest over tests/gpu beside a
    regular install), static tools and the build all resolve kubesgl.engine.* to engine/ by the
    links, which git keeps as links."""
    for folder, link in COMPONENTS.items():
        path = ROOT / link
        assert path.is_symlink() and path.readlink() == Path("..") / folder, link
        assert path.resolve() == ROOT / folder


def test_every_package_folder_is_listed_in_pyproject():
    """The build reads the folders through the links (wheel contents: kubesgl/engine/... from
    engine/...); a package missing from the list would be left out of a regular install."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    assert "package-dir" not in config, "kubesgl/ holds every package through its links"
    found = {"kubesgl", "kubesgl.operator"}  # operator/ is a namespace package (below)
    for init in (ROOT / "kubesgl").rglob("__init__.py"):
        found.add(".".join(init.parent.relative_to(ROOT).parts))
    for folder in COMPONENTS:  # rglob does not descend into links
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join(["kubesgl", *init.parent.relative_to(ROOT).parts]))
    assert found == listed, (
        f"missing from pyproject.toml: {sorted(found - listed)}; not a package: {sorted(listed - found)}"
    )


def test_the_package_resolves_to_the_repositorys_files_from_the_root():
    import subprocess
    import sys

    code = "import kubesgl.engine.config, kubesgl.router, kubesgl.operator.spec as s; print(kubesgl.engine.config.__file__, s.__file__)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        str(ROOT / "kubesgl" / "engine" / "config.py"),
        str(ROOT / "kubesgl" / "operator" / "spec.py"),
    ]


def test_the_operator_folder_never_shadows_the_standard_library():
    """Python run from the repository root puts the root on sys.path; `import operator` must
    still find the standard library's module, not the folder operator/ (docs/architecture.md, Layout),
    so operator/ is a namespace package (no __init__.py) that only kubesgl.operator names."""
    import subprocess
    import sys

    # -S: no site hooks, which may import the standard module first and hide the problem
    bare = subprocess.run(
        [sys.executable, "-S", "-c", "import operator; print(operator.__file__)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert bare.returncode == 0, bare.stderr
    assert str(ROOT / "operator") not in bare.stdout, (
        f"operator/ shadows the standard library: {bare.stdout}"
    )
    installed = subprocess.run(
        [sys.executable, "-c", "import kubesgl.operator.render, operator; operator.itemgetter"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert installed.returncode == 0, installed.stderr


def test_the_package_imports_nothing_only_the_test_extra_installs():
    """The Kubernetes API emulator the operator tests and its benchmark run against is theirs
    (tests/integration/operator/fake_api_server.py): a module of the package importing kmock
    would fail in a plain install."""
    test_only = ("kmock", "kubernetes_validate", "pytest")
    pattern = re.compile(rf"^\s*(?:import|from)\s+(?:{'|'.join(test_only)})\b", flags=re.M)
    folders = [ROOT / "kubesgl", *(ROOT / folder for folder in COMPONENTS)]
    offenders = [
        str(path.relative_to(ROOT))
        for folder in folders
        for path in folder.rglob("*.py")  # rglob does not descend into kubesgl/'s links
        if pattern.search(path.read_text())
    ]
    assert offenders == []


def readme_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    assert len(blocks) >= 2, "README must start with the run command and the test command"
    return [block.strip() for block in blocks]


def test_ci_runs_the_readme_test_command():
    test_command = readme_commands()[1]
    ci_lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert test_command in ci_lines


def test_the_readme_first_command_needs_nothing_a_fresh_machine_lacks():
    """A plain install (torch's CPU build first, no extras) and `kubesgl up` on the quickstart:
    an InferenceService on the CPU with the tiny model (no download, no GPU), whose prefill and
    decode engines need NIXL from the plain install."""
    import yaml

    from kubesgl.cli import SUBCOMMANDS

    assert (
        readme_commands()[0]
        == "pip install torch==2.13.0 && pip install -e . && kubesgl up -f examples/quickstart.yaml"
    )
    assert "up" in SUBCOMMANDS
    spec = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())["spec"]
    assert spec["engine"]["device"] == "cpu" and "tiny" in spec["model"]
    assert spec["mode"] == "disaggregated"
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(
        re.match(r"nixl\b.*sys_platform == 'linux'", dependency) for dependency in dependencies
    )
