"""`kubesgl generate`: prints each prompt's continuation; options this machine or model cannot
run, and a missing model, end with a one-line error and status 2, not a traceback; options the
command cannot honour (tensor parallelism, a prefill or decode role) are refused, not ignored."""

from __future__ import annotations

import pytest

from kubesgl.engine.cli import build_parser, main


def test_generates_for_each_prompt(tiny_model, capsys):
    status = main(
        [
            "--model",
            tiny_model("llama"),
            "--device",
            "cpu",
            "--prompt",
            "hi",
            "--prompt",
            "the",
            "--max-tokens",
            "3",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert status == 0 and len(lines) == 2
    assert lines[0].startswith("'hi' -> ") and "[3 tokens, finish_reason=length]" in lines[0]


def test_a_backend_this_machine_cannot_run_is_a_clear_error(tiny_model, capsys):
    status = main(
        [
            "--model",
            tiny_model("llama", head_dim=64),
            "--device",
            "cpu",
            "--dtype",
            "bfloat16",
            "--attention-backend",
            "flashinfer",
            "--prompt",
            "hi",
        ]
    )
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("kubesgl generate: --attention-backend flashinfer")
    assert "Traceback" not in err


def test_a_missing_model_is_a_clear_error(tmp_path, capsys):
    status = main(["--model", str(tmp_path / "nowhere"), "--device", "cpu", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("kubesgl generate: ") and "nowhere" in err


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--tp-size", "64"], "--tp-size/--tp/--tensor-parallel-size"),
        (["--role", "prefill"], "--role"),
        (["--tp-size", "64", "--role", "prefill"], "--tp-size/--tp/--tensor-parallel-size"),
        (
            ["--tp", "2"],
            "--tp-size/--tp/--tensor-parallel-size",
        ),  # SGLang's spelling is the same flag
        (["--disaggregation-timeout", "5"], "--disaggregation-timeout"),
        (["--disaggregation-bootstrap-port", "9000"], "--disaggregation-bootstrap-port"),
        (["--default-max-tokens", "8"], "--default-max-tokens"),
        (["--max-queued-requests", "8"], "--max-queued-requests"),
    ],
)
def test_an_option_generate_cannot_honour_is_refused_not_ignored(args, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "m", "--prompt", "hi", *args])
    err = capsys.readouterr().err
    assert (
        exit_.value.code == 2 and f"argument {flag}: " in err and "cannot be honoured here" in err
    )
    assert "Traceback" not in err


def test_the_default_of_a_refused_option_is_accepted_and_they_are_not_in_help(tiny_model, capsys):
    status = main(
        [
            "--model",
            tiny_model("llama"),
            "--device",
            "cpu",
            "--prompt",
            "hi",
            "--max-tokens",
            "2",
            "--tp-size",
            "1",
            "--role",
            "mixed",
        ]
    )
    assert status == 0
    help_ = build_parser().format_help()
    assert all(
        flag not in help_
        for flag in (
            "--tp-size",
            "--role",
            "--disaggregation-",
            "--default-max-tokens",
            "--max-queued-requests",
        )
    )


def test_the_offline_llm_refuses_tensor_parallelism(tiny_model):
    from kubesgl.engine import LLM

    with pytest.raises(ValueError, match="tp_size 2: offline generation runs one engine process"):
        LLM(tiny_model("llama"), device="cpu", tp_size=2)


@pytest.mark.parametrize(
    ("option", "value", "reason"),
    [
        ("role", "prefill", "prefill and decode engines are served"),
        ("max_stop_string_length", 1, "a limit of the HTTP server's requests"),
        ("max_sequences_per_request", 1, "a limit of the HTTP server's requests"),
        ("max_request_body_bytes", 1024, "a limit of the HTTP server's requests"),
        ("disaggregation_timeout", 0.001, "which are served, transfer KV"),
        ("max_queued_requests", 1, "offline generation takes one request at a time"),
    ],
)
def test_the_offline_llm_refuses_an_option_only_a_server_honours(option, value, reason):
    from kubesgl.engine import LLM

    # refused before the model is looked for: the path need not exist
    with pytest.raises(ValueError, match=f"^{option} {value!r}: .*{reason}"):
        LLM("no-such-model", **{option: value})


def test_generate_refuses_what_the_offline_llm_refuses():
    from kubesgl.engine.cli import REFUSED
    from kubesgl.engine.config import OFFLINE_REFUSED

    assert OFFLINE_REFUSED.items() <= REFUSED.items()


def test_triton_attention_on_the_cpu_is_a_clear_error(tiny_model, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    status = main(
        [
            "--model",
            tiny_model("llama"),
            "--device",
            "cpu",
            "--attention-backend",
            "triton",
            "--prompt",
            "hi",
        ]
    )
    err = capsys.readouterr().err
    assert (
        status == 2
        and err
        == "kubesgl generate: --attention-backend triton runs on CUDA GPUs; on the CPU use torch (or auto)\n"
    )


# The engine options kubesgl generate honours; every other one must be in engine/cli.py's REFUSED.
HONOURED = {
    "model",
    "device",
    "dtype",
    "kv_cache_dtype",
    "load_format",
    "page_size",
    "max_running_requests",
    "chunked_prefill_size",
    "enable_mixed_chunk",
    "max_prefill_tokens",
    "max_total_tokens",
    "mem_fraction_static",
    "context_length",
    "attention_backend",
    "disable_radix_cache",
    "disable_overlap_schedule",
    "disable_cuda_graph",
    "cuda_graph_max_bs",
    "enable_piecewise_cuda_graph",
    "piecewise_cuda_graph_max_tokens",
    "schedule_policy",
    "schedule_max_wait",
}


def test_every_engine_option_is_honoured_or_refused_by_generate():
    """A new engine option must be placed: honoured by the offline engine, or refused with a reason."""
    from kubesgl.engine.cli import REFUSED
    from kubesgl.engine.cli_args import CLI_OPTIONS

    names = {opt.name for opt in CLI_OPTIONS}
    assert HONOURED.isdisjoint(REFUSED)
    assert names == HONOURED | set(REFUSED), (
        f"place {sorted(names - HONOURED - set(REFUSED))} in HONOURED or REFUSED"
    )


def test_a_request_limit_of_the_http_server_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "m", "--prompt", "hi", "--max-request-body-bytes", "2048"])
    err = capsys.readouterr().err
    assert (
        exit_.value.code == 2
        and "argument --max-request-body-bytes: 2048 cannot be honoured here: a limit of "
        "the HTTP server's requests"
        in err
    )


def test_a_checkpoint_that_does_not_load_is_one_line(tiny_model, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model("llama"), broken)
    (broken / "model.safetensors").write_bytes(b"\x01")  # a shard cut short
    status = main(["--model", str(broken), "--device", "cpu", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err and len(err.splitlines()) == 1
    assert err.startswith("kubesgl generate: the engine could not start: ")
