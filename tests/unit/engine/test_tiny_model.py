"""`kubesgl make-tiny-model`: the architectures the operator may render (kubesgl.contract), and
files every user can read whatever the umask (the engine in a pod runs as uid 1000, maybe not
the init container's user)."""

from __future__ import annotations

import stat
import subprocess
import sys

import pytest

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


def test_a_folder_holding_another_checkpoint_is_refused_and_left_as_it_was(tmp_path, capsys):
    """Written over another checkpoint, the tiny model would leave that one's shards and index
    beside its own files: a folder that loads neither."""
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x")
    status = tiny.main([str(tmp_path), "--arch", "llama"])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith(f"kubesgl make-tiny-model: {tmp_path} holds files")
    assert "model-00001-of-00002.safetensors" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
    ]


def test_a_tiny_model_may_be_written_again_in_place(tmp_path):
    tiny.make_tiny_model(tmp_path, "llama")
    tiny.make_tiny_model(tmp_path, "qwen3")  # what an init container does when it restarts
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(tiny.TINY_MODEL_FILES)


def test_a_path_that_cannot_be_written_is_one_line_and_a_non_zero_exit(tmp_path, capsys):
    """A file where the folder goes, or a folder that cannot be written, showed Python's
    `[Errno 17] File exists: ...` or safetensors' traceback."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir" / "model.safetensors").mkdir(parents=True)  # a file the model writes
    cases = {
        tmp_path / "file": f"{tmp_path / 'file'} is a file: give a new or empty directory",
        tmp_path / "file" / "sub": f"cannot write {tmp_path / 'file' / 'sub'}: Not a directory",
        tmp_path / "dir": f"cannot write {tmp_path / 'dir' / 'model.safetensors'}: Is a directory",
    }
    for path, why in cases.items():
        assert tiny.main([str(path), "--arch", "llama"]) == 2
        assert capsys.readouterr().err == f"kubesgl make-tiny-model: {why}\n"


@pytest.mark.parametrize("width", ["0", "7", "-16", "x"])
def test_a_head_width_no_model_can_have_is_a_usage_error(tmp_path, capsys, width):
    """--head-dim 7 wrote a model whose loading failed in transformers' RoPE check (the
    engine's too), --head-dim 0 one that transformers reads as 0 wide."""
    with pytest.raises(SystemExit) as exit_:
        tiny.main([str(tmp_path / "m"), "--arch", "llama", "--head-dim", width])
    assert exit_.value.code == 2
    assert f"--head-dim: a positive even number, not '{width}'" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
