"""Start-up, drain on SIGTERM, a dying child, and tensor parallelism across processes."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_harness import process_tree_alive, wait_until_gone

from kubesgl.engine import LLM, SamplingParams


def test_sigterm_drains_in_flight_requests_then_exits_clean(server_factory, tiny_model):
    server = server_factory(tiny_model("llama"), "--shutdown-timeout", "30")
    children = process_tree_alive(server.process.pid)
    assert len(children) >= 2
    result = {}

    def long_request():
        body = {
            "prompt": "drain me",
            "max_tokens": 1800,
            "ignore_eos": True,
        }  # a couple of seconds here
        result["response"] = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)

    worker = threading.Thread(target=long_request)
    worker.start()
    deadline = time.monotonic() + 10
    while server.metric("kubesgl_num_running_requests") < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    assert httpx.get(server.base_url + "/health").status_code == 503
    # a probe of SGLang's route takes the engine out of rotation too
    assert httpx.get(server.base_url + "/health_generate").status_code == 503
    refused = httpx.post(
        server.base_url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}
    )
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    worker.join(timeout=60)
    response = result["response"]
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 1800
    assert server.process.wait(timeout=30) == 0
    assert wait_until_gone(children) == []


def test_shutdown_deadline_aborts_what_is_left(server_factory, tiny_model):
    server = server_factory(tiny_model("llama"), "--shutdown-timeout", "0.5")
    result = {}

    def long_request():
        body = {"prompt": "too long", "max_tokens": 1900, "ignore_eos": True}
        result["response"] = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)

    worker = threading.Thread(target=long_request)
    worker.start()
    while server.metric("kubesgl_num_running_requests") < 1:
        time.sleep(0.02)
    server.process.send_signal(signal.SIGTERM)
    worker.join(timeout=30)
    assert result["response"].json()["choices"][0]["finish_reason"] == "abort"
    assert server.process.wait(timeout=30) == 0


@pytest.mark.parametrize("engine", ["mixed", "prefill-tp2"])
def test_sigterm_while_loading_stops_every_process_within_seconds(tiny_model, tmp_path, engine):
    """An engine stopped while its schedulers still load (kubesgl up's Ctrl-C right after
    start) has nothing to drain: it took 11 s, waiting for children that read no Shutdown
    while loading before it killed them ("did not stop in time"). Every process (each
    tensor-parallel rank, the tokenizer, a prefill engine's bootstrap process) is gone within
    seconds, the server exits 0 with no traceback, and its socket folder is removed."""
    from serve_harness import free_port, start_process

    args: tuple[str, ...] = ()
    ranks, children_expected = 1, 2  # scheduler ranks; + the tokenizer (+ bootstrap process)
    if engine == "prefill-tp2":
        args = ("--tp-size", "2", "--role", "prefill")
        args += ("--disaggregation-bootstrap-port", str(free_port()))
        ranks, children_expected = 2, 4
    held = tmp_path / "held"
    held.mkdir()
    hold = os.path.join(os.path.dirname(__file__), "load_held")
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [hold, os.environ.get("PYTHONPATH")])),
        "HELD_DIR": str(held),
    }
    server = start_process(
        "serve",
        "--model",
        tiny_model("llama"),
        "--device",
        "cpu",
        *args,
        tmp_path=tmp_path,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(held.iterdir())) < ranks:  # every rank is loading its weights, forever
            assert server.process.poll() is None and time.monotonic() < deadline, server.log()
            time.sleep(0.05)
        children = process_tree_alive(server.process.pid)
        assert len(children) >= children_expected
        sent_at = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=30) == 0
        assert wait_until_gone(children, timeout=5) == []
        took = time.monotonic() - sent_at
    finally:
        if server.process.poll() is None:
            os.killpg(server.process.pid, signal.SIGKILL)
    log = server.log()
    assert took < 5, f"stopped after {took:.1f} s:\n{log}"
    assert "did not stop in time" not in log and "Traceback" not in log, log
    assert not list(Path(tempfile.gettempdir()).glob(f"kubesgl-ipc-{server.process.pid}-*"))


def test_a_dying_child_takes_the_server_down_with_a_clear_log(server_factory, tiny_model):
    server = server_factory(tiny_model("llama"))
    children = process_tree_alive(server.process.pid)
    schedulers = [
        pid
        for pid in children
        if "spawn_main" in open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    ]
    assert schedulers
    answers: dict[str, httpx.Response] = {}

    def ask(stream: bool) -> None:
        body = {"prompt": "x", "max_tokens": 1900, "ignore_eos": True, "stream": stream}
        url = server.base_url + "/v1/completions"
        answers["stream" if stream else "whole"] = httpx.post(url, json=body, timeout=60)

    askers = [threading.Thread(target=ask, args=(stream,)) for stream in (False, True)]
    for asker in askers:
        asker.start()
    while server.metric("kubesgl_num_running_requests") < 2:
        time.sleep(0.02)
    os.kill(schedulers[0], signal.SIGKILL)
    for asker in askers:
        asker.join(timeout=30)
    assert server.process.wait(timeout=30) != 0
    log = server.log()
    assert "exited with code -9; shutting the server down" in log
    assert wait_until_gone(children) == []  # the other children did not outlive the server
    # the requests in flight were answered, not cut off
    whole = answers["whole"]
    assert whole.status_code == 500 and "exited with code -9" in whole.json()["error"]["message"]
    events = [line for line in answers["stream"].text.splitlines() if line]
    assert events[-1] == "data: [DONE]"
    assert "exited with code -9" in events[-2] and '"error"' in events[-2]
    assert "CancelledError" not in log


def test_a_hung_scheduler_takes_the_server_down_after_the_watchdog_timeout(
    server_factory, tiny_model
):
    """A scheduler that stops answering (a step that never ends) leaves a server that would
    say "ok" to every probe while each request waits forever; past --watchdog-timeout the
    server answers what is in flight and exits, so that its pod restarts."""
    server = server_factory(tiny_model("llama"), "--watchdog-timeout", "3")
    time.sleep(4)  # idle past the timeout: the scheduler's heartbeat keeps it alive
    assert server.process.poll() is None
    assert httpx.get(server.base_url + "/health").status_code == 200
    children = process_tree_alive(server.process.pid)
    spawned = [
        pid
        for pid in children
        if "spawn_main" in open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    ]
    answer: dict[str, httpx.Response] = {}

    def ask() -> None:
        body = {"prompt": "x", "max_tokens": 1900, "ignore_eos": True}
        answer["whole"] = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)

    asker = threading.Thread(target=ask)
    asker.start()
    while server.metric("kubesgl_num_running_requests") < 1:
        time.sleep(0.02)
    stopped_at = time.monotonic()
    for pid in spawned:  # the scheduler and the tokenizer: nothing reaches the API server
        os.kill(pid, signal.SIGSTOP)
    asker.join(timeout=30)
    assert 3 <= time.monotonic() - stopped_at < 15
    whole = answer["whole"]
    assert whole.status_code == 500 and "a step hung" in whole.json()["error"]["message"]
    assert server.process.wait(timeout=30) == 1
    assert "the scheduler has sent nothing for 3 s (--watchdog-timeout 3)" in server.log()
    assert wait_until_gone(children) == []  # stopped children are killed, not left behind


def test_a_model_that_fails_to_load_exits_non_zero(server_factory, tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(AssertionError, match="unsupported architecture"):
        server_factory(str(tmp_path), timeout=60)


def test_a_problem_only_a_child_finds_is_one_line_and_the_servers_last(tiny_model, tmp_path):
    """Weights that cannot be read are found by the scheduler while it loads them: its line names
    the problem, no traceback, and the server repeats it as its last line (kubesgl up shows that
    line as the reason) and exits non-zero as soon as the child has ended."""
    import shutil
    import subprocess
    import sys

    from serve_harness import free_port

    path = tmp_path / "bad-weights"
    shutil.copytree(tiny_model("llama"), path)
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kubesgl",
            "serve",
            "--model",
            str(path),
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    log = run.stdout + run.stderr
    assert run.returncode == 1 and "Traceback" not in log, log
    assert run.stderr.splitlines()[-1].startswith(
        "kubesgl serve: scheduler rank 0 could not start: SafetensorError: "
    )


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "qwen3-moe"])
def test_tensor_parallel_2_gives_the_same_greedy_tokens_as_1(arch, server_factory, tiny_model):
    path = tiny_model(arch)
    server = server_factory(path, "--tp-size", "2")
    prompts = [[5, 6, 7], list(range(20, 70)), [300, 12, 99, 4]]
    # the very first request right after start-up reaches both ranks
    got = [
        httpx.post(
            server.base_url + "/generate",
            json={"input_ids": p, "sampling_params": {"max_new_tokens": 16, "temperature": 0}},
        ).json()["output_ids"]
        for p in prompts
    ]
    with LLM(path, device="cpu", dtype="float32", max_total_tokens=4096) as llm:
        expected = [
            o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
        ]
    assert got == expected
    # seeded sampling agrees across ranks too (a rank that drew differently would deadlock or diverge)
    sampled = httpx.post(
        server.base_url + "/generate",
        json={
            "input_ids": prompts[1],
            "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "seed": 3},
        },
    )
    assert sampled.status_code == 200 and len(sampled.json()["output_ids"]) == 16
    assert server.stop() == 0


def test_a_model_without_tokenizer_serves_token_ids(server_factory, tiny_model, tmp_path):
    import shutil

    path = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model("llama"), path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    server = server_factory(str(path))
    url = server.base_url + "/v1/completions"
    got = httpx.post(
        url, json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "logprobs": 1}
    )
    assert got.status_code == 200 and got.json()["usage"]["completion_tokens"] == 4
    assert got.json()["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")
    # Each token is news, though it brings no text (a benchmark times the chunks)
    streamed = httpx.post(
        url, json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "stream": True}
    )
    chunks = [
        json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")
    ]
    assert [c["choices"][0]["text"] for c in chunks] == ["", "", "", ""]
    refused = httpx.post(url, json={"prompt": "text", "max_tokens": 4})
    assert refused.status_code == 400 and "no tokenizer" in refused.json()["error"]["message"]
    assert httpx.post(url, json={"prompt": [5], "max_tokens": 2, "stop": ["x"]}).status_code == 400
    for path, body in (("/tokenize", {"prompt": "text"}), ("/detokenize", {"tokens": [5]})):
        refused = httpx.post(server.base_url + path, json=body)
        assert refused.status_code == 400 and "no tokenizer" in refused.json()["error"]["message"]
    assert server.stop() == 0


def test_a_queued_request_whose_client_left_is_aborted_before_it_runs(server_factory, tiny_model):
    """A client that gives up while its request waits for admission frees its place at once
    (an abandoned request must not take capacity ahead of live ones)."""
    server = server_factory(tiny_model("llama"), "--max-running-requests", "1")
    url = server.base_url + "/v1/completions"
    busy = threading.Thread(
        target=httpx.post,
        args=(url,),
        kwargs={"json": {"prompt": "x", "max_tokens": 1900, "ignore_eos": True}, "timeout": 60},
    )
    busy.start()
    while server.metric("kubesgl_num_running_requests") < 1:
        time.sleep(0.02)
    for stream in (False, True):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json={"prompt": "y", "max_tokens": 4, "stream": stream}, timeout=0.3)
    deadline = time.monotonic() + 5
    while server.metric("kubesgl_num_waiting_requests") > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.metric("kubesgl_num_waiting_requests") == 0
    assert busy.is_alive(), "the queued requests were only aborted once the long one ended"
    busy.join(timeout=60)
