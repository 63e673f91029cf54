"""YAML that ships (CRD, chart values, examples) has no duplicate keys: PyYAML keeps the last
one silently, while the API server's strict decoding rejects or warns about the object."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
FILES = sorted(
    {
        p.resolve()
        for pattern in (
            "crds/*.yaml",
            "examples/*.yaml",
            "charts/*/values.yaml",
            "charts/*/Chart.yaml",
            "charts/*/crds/*.yaml",
        )
        for p in ROOT.glob(pattern)
    }
)


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
        duplicates = {k for k in keys if keys.count(k) > 1}
        if duplicates:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate keys {sorted(duplicates)}", node.start_mark
            )
        return super().construct_mapping(node, deep=deep)


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_no_duplicate_keys(path):
    list(yaml.load_all(path.read_text(), Loader=_StrictLoader))


def test_the_check_catches_a_duplicate():
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate keys"):
        yaml.load("a: 1\nb: {c: 1, c: 2}\n", Loader=_StrictLoader)
