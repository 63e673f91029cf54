"""`kubesgl render -f FILE` in a fresh interpreter: a YAML stream, errors naming the field,
and no torch."""

from __future__ import annotations

import subprocess
import sys

import yaml
from operator_fixtures import REPO, load_example

from kubesgl.operator.render import render
from kubesgl.operator.validation import parse_inference_service


def run_render(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kubesgl", "render", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def test_prints_the_rendered_objects_as_a_yaml_stream() -> None:
    result = run_render("-f", "examples/autoscaled-keda.yaml")
    assert result.returncode == 0, result.stderr
    printed = list(yaml.safe_load_all(result.stdout))
    expected = render(parse_inference_service(load_example("autoscaled-keda.yaml")))
    assert printed == expected
    assert "&id" not in result.stdout  # no YAML anchors


def test_a_bad_spec_exits_2_naming_the_field() -> None:
    document = load_example("disaggregated.yaml")
    del document["spec"]["decode"]
    document["spec"]["prefill"]["replicas"] = -3
    result = run_render("-f", "-", stdin=yaml.safe_dump(document))
    assert result.returncode == 2
    assert "spec.prefill.replicas: Input should be greater than or equal to 0" in result.stderr
    assert result.stdout == ""


def test_metadata_that_is_no_mapping_is_a_problem_not_a_traceback() -> None:
    """A metadata that is a string or a list (a YAML slip) crashed the printing of the spec's
    problems with AttributeError, and a spec without a name printed "InferenceService ?"."""
    for metadata in ("oops", ["name", "x"], {"namespace": "ns"}):
        document = load_example("mixed.yaml")
        document["metadata"] = metadata
        result = run_render("-f", "-", stdin=yaml.safe_dump(document))
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
        assert result.stderr.startswith(
            "kubesgl render: -: InferenceService without metadata.name:"
        )
        assert "metadata" in result.stderr.splitlines()[1]


def test_render_does_not_import_torch_or_kopf() -> None:
    code = (
        "import sys; from kubesgl.operator import render_cli;"
        "render_cli.main(['-f', 'examples/mixed.yaml']);"
        "assert 'torch' not in sys.modules and 'kopf' not in sys.modules, 'heavy import'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert result.returncode == 0, result.stderr


def test_an_empty_file_is_an_error(tmp_path) -> None:
    for text in ("", "---\n---\n", "# only a comment\n"):
        empty = tmp_path / "empty.yaml"
        empty.write_text(text)
        result = run_render("-f", str(empty))
        assert result.returncode == 2 and result.stdout == ""
        assert (
            result.stderr
            == f"kubesgl render: {empty}: no InferenceService in it (no YAML document)\n"
        )


def test_a_reader_that_goes_away_is_no_traceback() -> None:
    """`kubesgl render ... | head`: the pipe's reader is gone before the objects are written."""
    import os

    read, write = os.pipe()
    os.close(read)
    process = subprocess.run(
        [sys.executable, "-m", "kubesgl", "render", "-f", "examples/disaggregated.yaml"],
        stdout=write,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    os.close(write)
    assert process.stderr == ""
    assert process.returncode == 141  # as a tool that SIGPIPE ended


def test_a_key_given_twice_is_an_error_naming_both_lines() -> None:
    """Two files pasted together without `---` between them: PyYAML keeps each last key, a
    mix of both services; kubectl refuses such a file, and so does render (and `kubesgl up`)."""
    both = (REPO / "examples" / "quickstart.yaml").read_text() + (
        REPO / "examples" / "disaggregated.yaml"
    ).read_text()
    result = run_render("-f", "-", stdin=both)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("kubesgl render: cannot read -: key 'apiVersion' given")
    assert "and again" in result.stderr and '"<stdin>", line' in result.stderr
