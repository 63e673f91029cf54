"""Shared fixtures: tiny models made on the spot (tests never download anything)."""

from __future__ import annotations

import threading

import pytest
import zmq

_left_open: list[str] = []  # zmq contexts the garbage collector found open


def _destroy_without_waiting(context: zmq.Context) -> None:
    """A context the garbage collector finds with sockets open (a test that left it so, or
    the code under test) hangs pyzmq's own destroy: term() waits for sockets whose finalizers
    have not run yet, and a whole run stopped in an unrelated test. Here it is recorded (the
    run fails, naming it) and destroyed on a daemon thread, which the interpreter does not
    wait for."""
    if not context._shadow and not context.closed:
        _left_open.append(repr(context))
        threading.Thread(target=context.destroy, kwargs={"linger": 0}, daemon=True).start()


zmq.Context.__del__ = _destroy_without_waiting  # type: ignore[method-assign]


def pytest_sessionfinish(session, exitstatus):
    if _left_open:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _left_open:
        terminalreporter.section("zmq contexts left open", sep="=", red=True)
        for context in _left_open:
            terminalreporter.line(f"{context}: found by the garbage collector, not closed")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is available on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch, seed=0, head_dim=16) -> path of a tiny checkpoint, made once per session."""
    from kubesgl.engine.models.tiny import make_tiny_model

    made: dict[tuple[str, int, int], str] = {}

    def get(arch: str, seed: int = 0, head_dim: int = 16) -> str:
        key = (arch, seed, head_dim)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}-{seed}-{head_dim}")
            made[key] = str(make_tiny_model(folder, arch, seed, head_dim))
        return made[key]

    return get


@pytest.fixture
def attention_batch():
    """attention_batch(mode, seq_lens, extend_lens, rows, table) -> a ForwardBatch for calling an
    attention backend directly: request r adds the last extend_lens[r] of its seq_lens[r]
    positions, at the slots its row of the request table holds."""
    import torch

    from kubesgl.engine.forward_batch import ForwardBatch

    def make(mode, seq_lens, extend_lens, rows, table):
        long = lambda values: torch.tensor(values, dtype=torch.int64, device=table.device)  # noqa: E731
        slots = torch.cat([table[r, n - e : n] for r, n, e in zip(rows, seq_lens, extend_lens)])
        positions = torch.cat([torch.arange(n - e, n) for n, e in zip(seq_lens, extend_lens)]).to(
            table.device
        )
        empty = long([])
        return ForwardBatch(
            mode=mode,
            input_ids=torch.zeros_like(slots),
            positions=positions,
            out_cache_loc=slots,
            req_rows=long(rows),
            seq_lens=long(seq_lens),
            seq_lens_cpu=list(seq_lens),
            extend_lens_cpu=list(extend_lens),
            extend_lens=long(extend_lens),
            table_rows=empty,
            table_cols=empty,
            table_slots=empty,
            future_slots=empty,
            emits=empty,
            sampling=None,
        )

    return make


class RecordingPacer:
    """Stands in for a process's GcPacer (kubesgl/gc_pacing.py): records its start and what
    each tick was told."""

    def __init__(self):
        self.started = 0
        self.ticks: list[bool] = []

    def start(self) -> None:
        self.started += 1

    def tick(self, busy: bool) -> None:
        self.ticks.append(busy)


@pytest.fixture
def recording_pacer(monkeypatch) -> RecordingPacer:
    """A RecordingPacer, with asyncio processes ticking it every 10 ms instead of every second."""
    from kubesgl import gc_pacing

    monkeypatch.setattr(gc_pacing, "TICK_S", 0.01)
    return RecordingPacer()
