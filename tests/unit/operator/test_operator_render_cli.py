"""`kubesgl render -f FILE` in a fresh interpreter: a YAML stream, errors naming the field,
and no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from operator_fixtures import REPO, load_example, with_changes

from kubesgl.operator import render_cli
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


COMMIT = "0e9e39f249a16976918f6564b8830bc894c89659"  # a Hugging Face commit id's form


@pytest.mark.parametrize(("revision", "warned"), [(None, True), ("v1.0", True), (COMMIT, False)])
def test_a_hugging_face_branch_is_rendered_with_a_warning(tmp_path, capsys, revision, warned):
    """As the operator's UnpinnedRevision Event: the spec renders, and the note says that its
    pods may load different commits."""
    document = load_example("disaggregated.yaml")
    source = document["spec"]["model"]["huggingFace"]
    source.pop("revision")
    if revision is not None:
        source["revision"] = revision
    (tmp_path / "isvc.yaml").write_text(yaml.safe_dump(document))
    status, printed, err = _render_main(capsys, "-f", str(tmp_path / "isvc.yaml"))
    assert (status, printed) == (0, _rendered(document))
    if warned:
        assert err == (
            f"kubesgl render: {tmp_path / 'isvc.yaml'}: InferenceService default/llama-pd: "
            f"warning: spec.model.huggingFace.revision {revision or 'main'!r} is a branch or "
            "tag, not a commit id (40 hex digits): each pod downloads the model when it starts, "
            "so pods started at different times may load different commits; give a commit id "
            "to pin them\n"
        )
    else:
        assert err == ""


def test_replicas_an_autoscaler_overrides_are_rendered_with_a_warning(tmp_path, capsys):
    """As the operator's ReplicasIgnored Event: the spec renders, without the count."""
    document = with_changes(load_example("autoscaled-keda.yaml"), "spec.prefill.replicas", 2)
    (tmp_path / "isvc.yaml").write_text(yaml.safe_dump(document))
    status, printed, err = _render_main(capsys, "-f", str(tmp_path / "isvc.yaml"))
    assert (status, printed) == (0, _rendered(document))
    (deployment,) = [
        o
        for o in printed
        if o["metadata"]["name"] == "llama-keda-prefill" and o["kind"] == "Deployment"
    ]
    assert "replicas" not in deployment["spec"]
    assert err.startswith(
        f"kubesgl render: {tmp_path / 'isvc.yaml'}: InferenceService default/llama-keda: "
        "warning: spec.prefill.replicas (2) is ignored while spec.autoscaling.prefill scales "
        "the role (1 to 4 replicas)"
    )
    assert err.count("\n") == 1


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
        [sys.executable, "-m", "kubesgl", "render", "-f", "examples/autoscaled-keda.yaml"],
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


# Several inputs, as kubectl takes them. In-process: main prints the stream to sys.stdout.


def _render_main(capsys, *args: str) -> tuple[int, list, str]:
    """(status, the objects printed, standard error) of `kubesgl render ARGS`."""
    status = render_cli.main(list(args))
    out, err = capsys.readouterr()
    return status, list(yaml.safe_load_all(out)), err


def _example_named(name: str, example: str = "mixed.yaml") -> dict:
    document = load_example(example)
    document["metadata"]["name"] = name
    return document


def _rendered(*documents: dict) -> list:
    return [obj for document in documents for obj in render(parse_inference_service(document))]


def test_every_file_given_is_rendered_in_order(tmp_path, capsys) -> None:
    """argparse kept the last -f alone: `-f a.yaml -f b.yaml` rendered b.yaml only."""
    first, second = _example_named("first"), _example_named("second", "autoscaled-keda.yaml")
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(first))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(second))
    status, printed, err = _render_main(
        capsys, "-f", str(tmp_path / "a.yaml"), "--filename", str(tmp_path / "b.yaml")
    )
    assert (status, err) == (0, "")
    assert printed == _rendered(first, second)


def test_a_directory_renders_its_manifests_in_name_order(tmp_path, capsys) -> None:
    """As kubectl's -f DIR: the .json, .yaml and .yml files in it, not other files, not its
    subfolders; it failed with "Is a directory"."""
    documents = [_example_named(name) for name in ("one", "two", "three")]
    (tmp_path / "2.yml").write_text(yaml.safe_dump(documents[1]))
    (tmp_path / "1.yaml").write_text(yaml.safe_dump(documents[0]))
    (tmp_path / "3.json").write_text(json.dumps(documents[2]))
    (tmp_path / "README.md").write_text("not a manifest")
    (tmp_path / "sub.yaml").mkdir()
    (tmp_path / "sub.yaml" / "4.yaml").write_text(yaml.safe_dump(_example_named("four")))
    status, printed, err = _render_main(capsys, "-f", str(tmp_path))
    assert (status, err) == (0, "")
    assert printed == _rendered(*documents)


def test_a_directory_without_manifests_is_an_error(tmp_path, capsys) -> None:
    (tmp_path / "README.md").write_text("not a manifest")
    status, printed, err = _render_main(capsys, "-f", str(tmp_path))
    assert (status, printed) == (2, [])
    assert err == f"kubesgl render: cannot read {tmp_path}: no .json, .yaml or .yml file in it\n"


def test_a_list_renders_its_items(tmp_path, capsys) -> None:
    """`kubectl get kisvc -o yaml` prints a List; its items were refused as one object with
    "metadata.name: Field required"."""
    items = [_example_named("first"), _example_named("second", "autoscaled-keda.yaml")]
    listed = {"apiVersion": "v1", "kind": "List", "items": items, "metadata": {}}
    (tmp_path / "list.yaml").write_text(yaml.safe_dump(listed))
    status, printed, err = _render_main(capsys, "-f", str(tmp_path / "list.yaml"))
    assert (status, err) == (0, "")
    assert printed == _rendered(*items)


def test_objects_of_other_kinds_are_skipped_with_a_note(tmp_path, capsys) -> None:
    """A Secret beside the InferenceService, as one file for kubectl apply: it was refused as
    "kind: Input should be 'InferenceService'"."""
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token"}}
    isvc = load_example("disaggregated.yaml")
    isvc["spec"]["model"]["huggingFace"]["revision"] = COMMIT  # no warning of a branch
    (tmp_path / "all.yaml").write_text(yaml.safe_dump_all([secret, isvc]))
    status, printed, err = _render_main(capsys, "-f", str(tmp_path / "all.yaml"))
    assert status == 0
    assert printed == _rendered(isvc)
    assert err == (
        f"kubesgl render: {tmp_path / 'all.yaml'}: skipped v1 Secret hf-token: "
        "kubesgl render renders kubesgl.io InferenceServices only\n"
    )


def test_an_inference_service_of_another_group_is_skipped(tmp_path, capsys) -> None:
    """KServe's InferenceService beside ours in one folder: it was checked as ours."""
    kserve = {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {"name": "sklearn-iris"},
        "spec": {"predictor": {"model": {"modelFormat": {"name": "sklearn"}}}},
    }
    isvc = load_example("mixed.yaml")
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(kserve))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(isvc))
    status, printed, err = _render_main(capsys, "-f", str(tmp_path))
    assert (status, printed) == (0, _rendered(isvc))
    assert err == (
        f"kubesgl render: {tmp_path / 'a.yaml'}: skipped serving.kserve.io/v1beta1 "
        "InferenceService sklearn-iris: kubesgl render renders kubesgl.io InferenceServices only\n"
    )


def test_an_object_without_kind_is_checked_as_ours_whatever_its_group(tmp_path, capsys) -> None:
    """Skipped, it was named "None" in the note."""
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({"apiVersion": "example.com/v1"}))
    status, printed, err = _render_main(capsys, "-f", str(tmp_path / "a.yaml"))
    assert (status, printed) == (2, [])
    assert "kind" in err and "None" not in err


def test_json_indented_with_tabs_renders(tmp_path, capsys) -> None:
    """`jq --tab` writes such JSON; read as YAML (which takes no tab indent) it was an error."""
    isvc = load_example("mixed.yaml")
    (tmp_path / "isvc.json").write_text(json.dumps(isvc, indent="\t"))
    status, printed, err = _render_main(capsys, "-f", str(tmp_path / "isvc.json"))
    assert (status, err) == (0, "")
    assert printed == _rendered(isvc)


def test_a_json_key_given_twice_is_an_error(tmp_path, capsys) -> None:
    (tmp_path / "isvc.json").write_text('{"kind": "InferenceService", "kind": "Secret"}')
    status, printed, err = _render_main(capsys, "-f", str(tmp_path / "isvc.json"))
    assert (status, printed) == (2, [])
    assert err == (
        f"kubesgl render: cannot read {tmp_path / 'isvc.json'}: "
        "key 'kind' given twice in one object\n"
    )


def test_a_file_that_is_no_text_is_an_error_not_a_traceback(tmp_path, capsys) -> None:
    """A stray binary .json in a folder raised UnicodeDecodeError out of render."""
    (tmp_path / "blob.json").write_bytes(b"\xff\xfe\x00binary")
    status, printed, err = _render_main(capsys, "-f", str(tmp_path))
    assert (status, printed) == (2, [])
    assert err.startswith(f"kubesgl render: cannot read {tmp_path / 'blob.json'}: 'utf-8' codec")


def test_an_empty_file_in_a_folder_is_skipped_with_a_note(tmp_path, capsys) -> None:
    """As kubectl skips it; given alone with -f it stays an error (above)."""
    isvc = load_example("mixed.yaml")
    (tmp_path / "a.yaml").write_text("# nothing yet\n")
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(isvc))
    status, printed, err = _render_main(capsys, "-f", str(tmp_path))
    assert (status, printed) == (0, _rendered(isvc))
    assert err == f"kubesgl render: {tmp_path / 'a.yaml'}: skipped: no YAML document\n"


def test_no_inference_service_at_all_is_an_error(tmp_path, capsys) -> None:
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token"}}
    (tmp_path / "secret.yaml").write_text(yaml.safe_dump(secret))
    (tmp_path / "none.yaml").write_text(yaml.safe_dump({"kind": "List", "items": []}))
    status, printed, err = _render_main(
        capsys, "-f", str(tmp_path / "secret.yaml"), "-f", str(tmp_path / "none.yaml")
    )
    assert (status, printed) == (2, [])
    assert err.endswith("kubesgl render: no InferenceService in the input\n")


def test_one_inference_service_given_twice_is_refused_naming_it(tmp_path, capsys) -> None:
    """Its objects would have been printed twice, the second copy applied over the first."""
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(load_example("mixed.yaml")))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(load_example("mixed.yaml")))
    status, printed, err = _render_main(
        capsys, "-f", str(tmp_path / "a.yaml"), "-f", str(tmp_path / "b.yaml")
    )
    assert (status, printed) == (2, [])
    assert err == (
        f"kubesgl render: {tmp_path / 'b.yaml'}: InferenceService default/qwen3-mixed "
        f"given twice (first in {tmp_path / 'a.yaml'})\n"
    )


def test_every_bad_document_is_reported_and_nothing_is_printed(tmp_path, capsys) -> None:
    """Render stopped at the first bad document; a fix then showed the next one."""
    bad_replicas = with_changes(_example_named("one"), "spec.mixed.replicas", -1)
    bad_mode = with_changes(_example_named("two"), "spec.mode", "split")
    good = _example_named("three")
    (tmp_path / "a.yaml").write_text(yaml.safe_dump_all([bad_replicas, good, bad_mode, "text"]))
    (tmp_path / "b.yaml").write_text("key: [unclosed\n")
    status, printed, err = _render_main(
        capsys, "-f", str(tmp_path / "a.yaml"), "-f", str(tmp_path / "b.yaml")
    )
    assert (status, printed) == (2, [])
    assert f"{tmp_path / 'a.yaml'}: InferenceService one:\n  spec.mixed.replicas:" in err
    assert f"{tmp_path / 'a.yaml'}: InferenceService two:\n  spec.mode:" in err
    assert f"{tmp_path / 'a.yaml'}: a document is not a mapping" in err
    assert f"kubesgl render: cannot read {tmp_path / 'b.yaml'}:" in err
    assert "three" not in err


def test_standard_input_given_twice_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        render_cli.main(["-f", "-", "-f", "-"])
    assert exit_.value.code == 2
    assert "standard input" in capsys.readouterr().err
