"""The model step of `kubesgl up`: run once into the cache, into a fresh folder renamed into place
only when the step succeeds, so that a failed or interrupted step leaves nothing half-made."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from kubesgl.operator.validation import parse_inference_service
from kubesgl.up.model import ModelStepFailed, cpu_size_note, ensure_model
from kubesgl.up.plan import LocalPlan, LocalSettings, ModelStep, plan

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"

WRITE = "import pathlib, sys; pathlib.Path(sys.argv[1], 'config.json').write_text('{}')"


def step(tmp_path: Path, code: str) -> ModelStep:
    return ModelStep(
        (sys.executable, "-c", code),
        ("/models/tiny",),
        "/models/tiny",
        {},
        tmp_path / "cache" / "models" / "tiny-llama",
    )


def test_runs_once_into_the_cache(tmp_path):
    made = step(tmp_path, WRITE)
    ensure_model(made, tmp_path / "model.log")
    assert (made.path / "config.json").read_text() == "{}"
    assert [p.name for p in made.path.parent.iterdir()] == ["tiny-llama"]  # no partial folder left
    assert (tmp_path / "model.log").read_text().endswith(f"model ready at {made.path}\n")
    ensure_model(
        step(tmp_path, "raise SystemExit(9)"), tmp_path / "model.log"
    )  # there already: not run


def test_a_failed_step_leaves_nothing_and_says_where_its_log_is(tmp_path):
    failing = step(tmp_path, "import sys; print('no space left'); sys.exit(3)")
    with pytest.raises(
        ModelStepFailed, match=r"exited with code 3: no space left \(log: .*model.log\)"
    ):
        ensure_model(failing, tmp_path / "model.log")
    assert not (tmp_path / "cache").exists()  # the folders it made for the model
    assert "no space left" in (tmp_path / "model.log").read_text()
    missing = ModelStep(("no-such-command-here",), (), "/models/hf", {}, tmp_path / "hf")
    with pytest.raises(ModelStepFailed, match="no-such-command-here is not installed"):
        ensure_model(missing, tmp_path / "model.log")


def test_a_failed_download_removes_the_folders_it_made_and_only_those(tmp_path):
    """`kubesgl up -f examples/disaggregated.yaml` with no network failed cleanly but left
    ~/.cache/kubesgl/models/hf/meta-llama/Llama-3.1-8B-Instruct/ behind, empty."""
    models = tmp_path / "cache" / "models"
    (models / "tiny-llama").mkdir(parents=True)  # another model's, before this step
    failing = ModelStep(
        (sys.executable, "-c", "raise SystemExit(1)"),
        ("/models/hf",),
        "/models/hf",
        {},
        models / "hf" / "meta-llama" / "Llama-3.1-8B-Instruct" / "main",
    )
    with pytest.raises(ModelStepFailed):
        ensure_model(failing, tmp_path / "model.log")
    assert [p.name for p in models.iterdir()] == ["tiny-llama"]
    (models / "hf" / "meta-llama" / "Llama-3.2-1B").mkdir(parents=True)  # this org's other model
    with pytest.raises(ModelStepFailed):
        ensure_model(failing, tmp_path / "model.log")
    assert [p.name for p in (models / "hf" / "meta-llama").iterdir()] == ["Llama-3.2-1B"]


def test_a_failed_step_says_why_in_its_error_line(tmp_path):
    """`hf download` ends with colored hints after its error ("Error: ... Name or service not
    known", then "Hint: set HF_DEBUG=1 ..."): the failure only named the log. It now quotes the
    step's last line that says error, without the terminal's color codes, else its last line."""
    log = tmp_path / "model.log"
    log.write_text("Error: an earlier run's failure\n")
    failing = step(
        tmp_path,
        "print('fetching'); print('\\x1b[1m\\x1b[31mError: 401 Client Error: access to model "
        "meta-llama/Llama-3.1-8B-Instruct is restricted\\x1b[0m'); "
        "print('\\x1b[90mHint: set HF_DEBUG=1 as environment variable for full traceback.\\x1b[0m');"
        " raise SystemExit(1)",
    )
    with pytest.raises(ModelStepFailed) as failed:
        ensure_model(failing, log)
    assert str(failed.value).endswith(
        "exited with code 1: Error: 401 Client Error: access to model "
        f"meta-llama/Llama-3.1-8B-Instruct is restricted (log: {log})"
    )
    quiet = step(tmp_path, "print('no space left'); raise SystemExit(3)")
    with pytest.raises(ModelStepFailed, match=r"exited with code 3: no space left \(log: "):
        ensure_model(quiet, log)


def quickstart_plan(tmp_path: Path, gpus: tuple[str, ...] = (), **settings) -> LocalPlan:
    document = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    document["spec"]["engine"]["device"] = "cuda"
    return plan(
        parse_inference_service(document),
        LocalSettings(gpus=gpus, cache_dir=tmp_path / "cache", **settings),
    )


def model_folder(tmp_path: Path, weights_bytes: int) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with (folder / "model.safetensors").open("wb") as weights:
        weights.truncate(weights_bytes)  # sparse: no disk taken
    return folder


def test_a_large_local_model_on_the_cpu_gets_a_note(tmp_path):
    folder = model_folder(tmp_path, 16 * 10**9)
    assert cpu_size_note(quickstart_plan(tmp_path, model=str(folder))) == (
        "the model's weights take 16.0 GB, and each of the 2 engines holds a copy in memory "
        "and runs it on the CPU: slow, if it fits at all; examples/quickstart.yaml is the "
        "example for a laptop"
    )
    assert cpu_size_note(quickstart_plan(tmp_path, gpus=("0", "1"), model=str(folder))) is None


def test_a_small_model_or_one_made_here_gets_none(tmp_path):
    assert (
        cpu_size_note(quickstart_plan(tmp_path, model=str(model_folder(tmp_path, 10**6)))) is None
    )
    tiny = quickstart_plan(tmp_path)
    assert tiny.model_step is not None and tiny.model_step.action == "making"
    assert cpu_size_note(tiny) is None  # the tiny model, made on the spot
