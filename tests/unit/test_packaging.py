"""The repository's own promises: every package is installed, nothing shadows the standard
library, and CI runs exactly the README's test command."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    found = set()
    for name, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert found <= listed, f"missing from pyproject.toml: {sorted(found - listed)}"


def test_no_top_level_operator_module():
    import importlib.util
    import operator as stdlib_operator

    assert stdlib_operator.__file__ is None or "site-packages" not in stdlib_operator.__file__
    assert hasattr(stdlib_operator, "itemgetter")
    assert importlib.util.find_spec("kubesgl.operator") is not None


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S)
    assert len(blocks) >= 2, "README must start with the run command and the test command"
    test_command = blocks[1].strip()
    ci_lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert test_command in ci_lines
