"""`kubesgl generate`: prints each prompt's continuation; options this machine or model cannot
run, and a missing model, end with a one-line error and status 2, not a traceback."""

from __future__ import annotations

from kubesgl.engine.cli import main


def test_generates_for_each_prompt(tiny_model, capsys):
    status = main(["--model", tiny_model("llama"), "--device", "cpu", "--prompt", "hi", "--prompt", "the",
                   "--max-tokens", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert status == 0 and len(lines) == 2
    assert lines[0].startswith("'hi' -> ") and "[3 tokens, finish_reason=length]" in lines[0]


def test_a_backend_this_machine_cannot_run_is_a_clear_error(tiny_model, capsys):
    status = main(["--model", tiny_model("llama", head_dim=64), "--device", "cpu", "--dtype", "bfloat16",
                   "--attention-backend", "flashinfer", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("kubesgl generate: --attention-backend flashinfer")
    assert "Traceback" not in err


def test_a_missing_model_is_a_clear_error(tmp_path, capsys):
    status = main(["--model", str(tmp_path / "nowhere"), "--device", "cpu", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("kubesgl generate: ") and "nowhere" in err
