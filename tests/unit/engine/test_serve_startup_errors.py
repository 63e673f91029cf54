"""`kubesgl serve` checks what it can before it starts a child process: a missing model, a
--tp-size the model's heads do not divide, an attention backend the device cannot run and a
port already taken each end with one line naming the problem and status 2, and nothing is
started. (A problem only a child can find is tests/integration/engine/test_server_lifecycle.py's.)"""

from __future__ import annotations

import dataclasses
import socket

import pytest

from kubesgl.engine.config import EngineConfig
from kubesgl.engine.preflight import StartupError, check_bootstrap_port, check_engine
from kubesgl.engine.server import cli as serve_cli
from kubesgl.engine.server.launcher import Server
from kubesgl.listen import CannotListen, listen_socket


@pytest.fixture
def serve(monkeypatch, capsys):
    """serve(*args) -> (status, stderr lines) of `kubesgl serve`, which must not start a server."""

    def no_server(self):
        raise AssertionError("the server was started")

    monkeypatch.setattr(Server, "run", no_server)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def run(*args: str) -> tuple[int, list[str]]:
        status = serve_cli.main([*args, "--host", "127.0.0.1"])
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return status, err.splitlines()

    return run


def test_a_missing_model_directory(serve, tmp_path):
    status, err = serve("--model", str(tmp_path / "nowhere"), "--device", "cpu")
    assert status == 2 and err == [
        f"kubesgl serve: --model {tmp_path / 'nowhere'}: no such directory "
        "(give a checkpoint directory or a Hugging Face id such as Qwen/Qwen3-0.6B)"
    ]


def test_a_directory_without_a_checkpoint(serve, tmp_path):
    status, err = serve("--model", str(tmp_path), "--device", "cpu")
    assert status == 2 and len(err) == 1 and "has no config.json" in err[0]


def test_a_checkpoint_without_weights(serve, tiny_model, tmp_path):
    import shutil

    path = tmp_path / "no-weights"
    shutil.copytree(tiny_model("llama"), path)
    (path / "model.safetensors").unlink()
    status, err = serve("--model", str(path), "--device", "cpu")
    assert status == 2 and len(err) == 1 and "has no *.safetensors files" in err[0]
    assert "--load-format dummy" in err[0]


def test_a_tp_size_that_does_not_divide_the_heads(serve, tiny_model):
    status, err = serve("--model", tiny_model("llama"), "--device", "cpu", "--tp-size", "3")
    assert status == 2 and err == [
        "kubesgl serve: --tp-size 3 does not fit this model: its 4 attention heads "
        "do not divide over 3 ranks (sizes that fit: 1, 2, 4)"
    ]


def test_a_context_length_beyond_the_models(serve, tiny_model):
    """The engine served the model's own context length instead, and said nothing: prompts
    within the length the option asked for got 400s (SGLang and vLLM refuse it at start too).
    Up to the model's, it is taken."""
    status, err = serve(
        "--model", tiny_model("llama"), "--device", "cpu", "--context-length", "100000"
    )
    assert status == 2 and err == [
        "kubesgl serve: --context-length 100000 exceeds this model's context length, 2048 "
        "(max_position_embeddings in its config.json); give at most 2048, or leave it unset"
    ]
    check_engine(EngineConfig(model=tiny_model("llama"), device="cpu", context_length=2048))


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_a_gpu_attention_backend_on_the_cpu(serve, tiny_model, backend):
    status, err = serve(
        "--model", tiny_model("llama"), "--device", "cpu", "--attention-backend", backend
    )
    assert status == 2 and err == [
        f"kubesgl serve: --attention-backend {backend} runs on CUDA GPUs; "
        "on the CPU use torch (or auto)"
    ]


def test_an_attention_backend_that_cannot_run_the_models_head_size(serve, tiny_model, monkeypatch):
    """The refusal is the registry's reason, the one `auto` passes triton over for."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton on the CPU, in its interpreter
    model = tiny_model("llama", head_dim=24)
    status, err = serve("--model", model, "--device", "cpu", "--attention-backend", "triton")
    assert status == 2 and err == [
        "kubesgl serve: --attention-backend triton needs a power-of-two head size of at least "
        "16, and this model's is 24; use torch (or auto)"
    ]


def test_a_port_already_taken(serve, tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, err = serve("--model", tiny_model("llama"), "--device", "cpu", "--port", str(port))
    assert status == 2 and err == [
        f"kubesgl serve: --port {port}: port {port} on 127.0.0.1 is already in use "
        "(another server?); choose another port"
    ]


def test_a_prefill_engines_bootstrap_port_already_taken(serve, tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, err = serve(
            "--model",
            tiny_model("llama"),
            "--device",
            "cpu",
            "--port",
            "0",
            "--role",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(port),
        )
    assert (
        status == 2
        and len(err) == 1
        and err[0].startswith(f"kubesgl serve: --disaggregation-bootstrap-port {port}: ")
    )


def test_a_bootstrap_port_is_checked_on_the_address_the_engine_listens_on():
    """As the engine's own port (listen_socket's family, an empty host every IPv4 address): an
    empty --host skipped the check, and the port in use failed only after the model loaded."""
    config = EngineConfig(model="m", role="prefill", disaggregation_bootstrap_port=0)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = dataclasses.replace(config, disaggregation_bootstrap_port=port)
        for host in ("", "0.0.0.0"):
            with pytest.raises(StartupError, match="--disaggregation-bootstrap-port"):
                check_bootstrap_port(config, host)


def test_the_listening_socket_is_bound_before_anything_starts():
    sock = listen_socket("127.0.0.1", 0)
    try:
        with pytest.raises(CannotListen, match="already in use"):
            listen_socket("127.0.0.1", sock.getsockname()[1]).close()
    finally:
        sock.close()


def test_the_listening_socket_takes_uvicorns_family(monkeypatch):
    """IPv6 only where the host has a ':', as uvicorn's own socket (uvicorn.Config.bind_socket):
    the first address of getaddrinfo was taken, so a localhost resolving to ::1 first listened
    on ::1 alone, where uvicorn had listened on 127.0.0.1."""
    resolved = socket.getaddrinfo

    def ipv6_first(host, *args, **kwargs):
        found = resolved(host, *args, **kwargs)
        if host != "localhost":
            return found
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 0, 0, 0)), *found]

    monkeypatch.setattr(socket, "getaddrinfo", ipv6_first)
    for host, family in (("localhost", socket.AF_INET), ("::1", socket.AF_INET6)):
        with listen_socket(host, 0) as sock:
            assert sock.family == family


def test_an_empty_host_listens_on_every_ipv4_address():
    """As uvicorn takes it, and 0.0.0.0; it was refused as `--host : not an address of this
    machine`."""
    with listen_socket("", 0) as sock:
        assert sock.getsockname()[0] == "0.0.0.0"


@pytest.mark.parametrize(
    ("arch", "tp_size", "fits"),
    [
        ("llama", 2, True),
        ("llama", 4, True),  # 4 heads, 2 KV heads: replicated over 4 ranks
        ("llama", 8, False),
        ("qwen3-moe", 2, True),
        ("qwen3-moe", 3, False),
    ],
)
def test_tensor_parallel_fit(tiny_model, arch, tp_size, fits):
    config = EngineConfig(model=tiny_model(arch), device="cpu", tp_size=tp_size)
    if fits:
        check_engine(config)
    else:
        with pytest.raises(StartupError, match=f"--tp-size {tp_size} does not fit this model"):
            check_engine(config)


def test_a_watchdog_timeout_shorter_than_three_heartbeats(serve, tiny_model, capsys):
    with pytest.raises(SystemExit) as refused:
        serve("--model", tiny_model("llama"), "--device", "cpu", "--watchdog-timeout", "2")
    assert refused.value.code == 2
    assert "--watchdog-timeout must be at least 3 s" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, refusal",
    [
        (["--served-model-name", ""], "--served-model-name is empty"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout must be 0 or more seconds, not -1"),
    ],
)
def test_an_empty_served_name_or_a_negative_drain_is_refused(
    serve, tiny_model, capsys, flags, refusal
):
    """An empty name (`--served-model-name "$NAME"` with NAME unset) served the model under its
    path instead, and every request naming the model a 404; a negative drain was taken."""
    with pytest.raises(SystemExit) as refused:
        serve("--model", tiny_model("llama"), "--device", "cpu", *flags)
    assert refused.value.code == 2
    assert refusal in capsys.readouterr().err
