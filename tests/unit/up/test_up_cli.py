"""`kubesgl up` refuses, before starting anything, what cannot run: the operator's validation
errors (status 2, each field named), more GPUs than there are, a source only a cluster has, a
port in use; and what it does on a hang-up."""

from __future__ import annotations

import os
import pty
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from kubesgl import contract
from kubesgl.listen import CannotListen
from kubesgl.operator.validation import InvalidSpec, parse_inference_service
from kubesgl.up import cli, interrupt
from kubesgl.up.model import ModelStepFailed
from kubesgl.up.plan import LocalPlan, LocalProcess
from kubesgl.up.supervisor import Supervisor

QUICKSTART = Path(__file__).resolve().parents[3] / "examples" / "quickstart.yaml"


@pytest.fixture(autouse=True)
def keep_signal_handlers():
    """main sets its own for SIGINT and SIGTERM: this process's come back after each test."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def spec_file(tmp_path: Path, **changes) -> str:
    document = yaml.safe_load(QUICKSTART.read_text())
    document["spec"].update(changes)
    path = tmp_path / "isvc.yaml"
    path.write_text(yaml.safe_dump(document))
    return str(path)


def test_the_operators_validation_errors_name_each_field(tmp_path, capsys):
    path = spec_file(tmp_path, prefill={"replicas": -1}, router={"policy": "fastest"})
    assert cli.main(["-f", path]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"kubesgl up: {path}: InferenceService quickstart:"
    assert "  spec.prefill.replicas: Input should be greater than or equal to 0" in err
    assert any(line.startswith("  spec.router.policy: Input should be ") for line in err)

    path = spec_file(tmp_path, decode=None)
    assert cli.main(["-f", path]) == 2
    assert "  spec.decode: required when mode is disaggregated" in capsys.readouterr().err


def test_a_spec_without_an_image_runs_though_a_cluster_needs_one(tmp_path, capsys):
    """kubesgl up runs no image, yet refused a laptop's spec without one: `spec.image: Field
    required`. The operator and kubesgl render still require it: pods run it."""
    path = spec_file(tmp_path, decode=None)  # refused later, so that nothing starts
    document = yaml.safe_load(Path(path).read_text())
    del document["spec"]["image"]
    Path(path).write_text(yaml.safe_dump(document))
    assert cli.main(["-f", path]) == 2
    assert capsys.readouterr().err.splitlines()[1:] == [
        "  spec.decode: required when mode is disaggregated"
    ]
    with pytest.raises(InvalidSpec, match="spec.image: Field required"):
        parse_inference_service(document)


def test_more_gpus_than_this_machine_has(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "visible_gpus", lambda: ("0",))
    path = spec_file(tmp_path, engine={"device": "cuda"})
    assert cli.main(["-f", path]) == 2
    assert capsys.readouterr().err == (
        f"kubesgl up: {path}: the spec needs 2 GPUs (replicas x tensorParallelSize: "
        "prefill: 1 x 1, decode: 1 x 1); this machine has 1 (0)\n"
    )


def test_a_claim_needs_a_local_copy(tmp_path, capsys):
    path = spec_file(tmp_path, model={"pvc": {"claimName": "models"}})
    assert cli.main(["-f", path]) == 2
    assert (
        "  spec.model.pvc: a PersistentVolumeClaim exists only in a cluster: give kubesgl up --model DIR"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "no InferenceService in it (no YAML document)"),
        ("- a list\n", "expected an InferenceService, found no mapping"),  # was "1 documents"
        (
            "spec: {}\n---\nspec: {}\n",
            "expected one InferenceService, found 2: kubesgl up runs one at a time; give -f one "
            "file",
        ),
    ],
)
def test_one_inference_service_per_file(tmp_path, capsys, text, problem):
    path = tmp_path / "isvc.yaml"
    path.write_text(text)
    assert cli.main(["-f", str(path)]) == 2
    assert capsys.readouterr().err == f"kubesgl up: {path}: {problem}\n"


def test_other_kinds_beside_the_inference_service_are_skipped(tmp_path, capsys):
    """A file for kubectl apply (a Namespace, a Secret and the InferenceService, or a List of
    them) runs as `kubesgl render` reads it: the other kinds skipped with a note. Before, any
    file of more than one document was refused."""
    isvc = yaml.safe_load(QUICKSTART.read_text())
    isvc["spec"]["prefill"] = {"replicas": -1}  # refused, so that nothing starts
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token"}}
    kserve = {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService"}
    path = tmp_path / "all.yaml"
    path.write_text(yaml.safe_dump_all([secret, {"kind": "List", "items": [kserve, isvc]}]))
    assert cli.main(["-f", str(path)]) == 2
    assert capsys.readouterr().err.splitlines()[:4] == [
        f"kubesgl up: {path}: skipped v1 Secret hf-token: kubesgl up runs kubesgl.io InferenceServices only",
        f"kubesgl up: {path}: skipped serving.kserve.io/v1beta1 InferenceService without metadata.name: "
        "kubesgl up runs kubesgl.io InferenceServices only",
        f"kubesgl up: {path}: InferenceService quickstart:",
        "  spec.prefill.replicas: Input should be greater than or equal to 0",
    ]

    path.write_text(yaml.safe_dump_all([secret]))
    assert cli.main(["-f", str(path)]) == 2
    assert (
        capsys.readouterr().err.splitlines()[-1] == f"kubesgl up: {path}: no InferenceService in it"
    )


def test_a_port_in_use(tmp_path, capsys):
    """A port in use is a usage error, status 2 as every other refusal before anything starts
    (it was 1, so a script could not tell it from a failure of a started process)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["-f", str(QUICKSTART), "--port", str(port), "--logs", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"kubesgl up: --port {port}: port {port} on 127.0.0.1 is already in use (another "
        "server?); choose another port\n"
    )


@pytest.fixture
def starts_nothing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("kubesgl up started processes for arguments it should refuse")

    monkeypatch.setattr(cli, "Supervisor", refuse)
    monkeypatch.setattr(cli, "ensure_model", refuse)


def test_an_address_not_of_this_machine_is_not_a_port_in_use(tmp_path, capsys, starts_nothing):
    """A --host this machine cannot listen on is named as such, not as a port in use: another
    --port would not help."""
    args = ["-f", str(QUICKSTART), "--logs", str(tmp_path)]
    assert cli.main([*args, "--host", "192.0.2.1"]) == 2  # TEST-NET-1: no machine's address
    err = capsys.readouterr().err
    assert err == "kubesgl up: --host 192.0.2.1: not an address of this machine\n"

    assert cli.main([*args, "--host", "no-such-host.invalid"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kubesgl up: --host no-such-host.invalid: not an address of this machine")
    assert "in use" not in err


@pytest.mark.parametrize("port", ["0", "-1", "65536", "70000"])
def test_a_port_out_of_range_is_a_usage_error(tmp_path, capsys, port, starts_nothing):
    """70000 would listen on 70000 mod 65536 (4464) while the base URL printed says 70000, and
    0 on a port nobody is told."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["-f", str(QUICKSTART), "--port", port, "--logs", str(tmp_path)])
    assert exit_.value.code == 2
    assert "--port: a port from 1 to 65535" in capsys.readouterr().err


def test_logs_that_name_a_file_are_a_usage_error(tmp_path, capsys, starts_nothing):
    not_a_folder = tmp_path / "log.txt"
    not_a_folder.write_text("")
    assert cli.main(["-f", str(QUICKSTART), "--logs", str(not_a_folder)]) == 2
    assert capsys.readouterr().err == f"kubesgl up: --logs {not_a_folder}: Not a directory\n"
    inside = not_a_folder / "logs"
    assert cli.main(["-f", str(QUICKSTART), "--logs", str(inside)]) == 2
    assert capsys.readouterr().err == f"kubesgl up: --logs {inside}: Not a directory\n"


def test_a_model_folder_that_is_not_there_is_refused(tmp_path, capsys, starts_nothing):
    """--model or a hostPath naming no folder: each engine exited at start with the engine's
    own error and was restarted forever, the router never started."""
    missing = tmp_path / "no-such-model"
    assert cli.main(["-f", str(QUICKSTART), "--logs", str(tmp_path), "--model", str(missing)]) == 2
    assert capsys.readouterr().err == (
        f"kubesgl up: --model {missing}: not a folder on this machine\n"
    )
    path = spec_file(tmp_path, model={"servedName": "tiny", "hostPath": {"path": str(missing)}})
    assert cli.main(["-f", path, "--logs", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"kubesgl up: {path}: spec.model.hostPath.path {missing}: not a folder on this machine\n"
    )


REFUSING = """
import sys
print("loading", flush=True)
print("kubesgl serve: --context-length 100000 exceeds the model's 2048", file=sys.stderr)
sys.exit(2)
"""
SERVING = "import time; time.sleep(600)"  # never answers /health: starting until stopped
# the engines' command line as spec.engine.contextLength: 100000 renders it
CONTEXT_LENGTH = (("spec.engine", ("serve", "--context-length", "100000")),)


def test_a_process_that_exits_with_status_2_stops_everything_with_status_2(
    tmp_path, capsys, monkeypatch
):
    """Status 2 is a configuration error (`engine.contextLength` beyond the model's, say) that
    every restart repeated: `kubesgl up` restarted both engines forever, never ready."""

    def process(name: str, role: contract.PodRole, code: str) -> LocalProcess:
        port = free_port()
        argv = (sys.executable, "-c", code)
        return LocalProcess(name, role, argv, {}, port, 10, spec_args=CONTEXT_LENGTH)

    engines = (
        process("prefill-0", contract.PREFILL, REFUSING),
        process("decode-0", contract.DECODE, SERVING),
    )
    router = process("router", contract.ROUTER, SERVING)
    router = LocalProcess(**{**router.__dict__, "waits_for": (contract.PREFILL, contract.DECODE)})
    local = LocalPlan("quickstart", "disaggregated", str(tmp_path), None, engines, router, ())
    monkeypatch.setattr(cli, "plan", lambda isvc, settings: local)
    handlers = {
        signum: signal.getsignal(signum)
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    }
    # before the fix it never returned: a Ctrl-C after 30 s ends it, with status 0
    ctrl_c = threading.Timer(30, os.kill, (os.getpid(), signal.SIGINT))
    ctrl_c.start()
    try:
        status = cli.main(
            ["-f", str(QUICKSTART), "--port", str(free_port()), "--logs", str(tmp_path)]
        )
    finally:
        ctrl_c.cancel()
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    out, err = capsys.readouterr()
    assert status == 2
    assert err == (
        "kubesgl up: prefill-0 exited (exit code 2: kubesgl serve: --context-length 100000 "
        "exceeds the model's 2048): a configuration error in spec.engine.contextLength, which "
        "a restart would only repeat; everything is stopped\n"
    )
    assert (
        "prefill-0: exited with status 2" in out
        and "restart" not in (tmp_path / "prefill-0.log").read_text()
    )
    assert (
        "stopping, prefill-0 exited with status 2 (a configuration error): the engines, the "
        "router not having started (Ctrl-C kills them at once)" in out
    )
    (decode,) = re.findall(r"decode-0: started, pid (\d+)", out)
    assert not Path(f"/proc/{decode}").exists()  # stopped (and reaped), not left behind
    assert "decode-0: killed" not in out and "router: started" not in out


ENGINE_REFUSING = """
import sys
print("kubesgl serve: --context-length 100000 exceeds this model's context length, 2048", file=sys.stderr)
sys.exit(2)
"""


def test_replicas_refusing_the_spec_alike_say_it_once_naming_the_spec_field(
    tmp_path, capsys, monkeypatch
):
    """Each replica of a spec the engines refuse says the same, and it was printed once per
    replica as it exited and again per replica as everything stopped (four times for the
    quickstart's two engines), naming the engine's flag, not the field of the spec to change."""

    def process(name: str, role: contract.PodRole, code: str) -> LocalProcess:
        argv = (sys.executable, "-c", code)
        return LocalProcess(name, role, argv, {}, free_port(), 10, spec_args=CONTEXT_LENGTH)

    engines = (
        process("prefill-0", contract.PREFILL, ENGINE_REFUSING),
        process("decode-0", contract.DECODE, ENGINE_REFUSING),
    )
    router = process("router", contract.ROUTER, SERVING)
    router = LocalProcess(**{**router.__dict__, "waits_for": (contract.PREFILL, contract.DECODE)})
    local = LocalPlan("quickstart", "disaggregated", str(tmp_path), None, engines, router, ())
    monkeypatch.setattr(cli, "plan", lambda isvc, settings: local)
    status = run_up(["--logs", str(tmp_path)], ctrl_c_after_s=30)
    out, err = capsys.readouterr()
    assert status == 2
    message = "--context-length 100000 exceeds this model's context length, 2048"
    assert (out + err).count(message) == 1
    # decode-0 too, unless it was stopped before it exited on its own
    assert re.fullmatch(
        re.escape("kubesgl up: prefill-0")
        + "(, decode-0)?"
        + re.escape(
            f" exited (exit code 2: kubesgl serve: {message}): a configuration error in "
            "spec.engine.contextLength, which a restart would only repeat; everything is stopped\n"
        ),
        err,
    )


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"engine": {"contextLength": 100000}}, "spec.engine.contextLength"),
        ({"engine": {"extraArgs": ["--context-length=100000"]}}, "spec.engine.extraArgs"),
        ({"decode": {"extraArgs": ["--context-length", "100000"]}}, "spec.decode.extraArgs"),
        (  # extraArgs override the field
            {
                "engine": {"contextLength": 1024},
                "decode": {"extraArgs": ["--context-length", "100000"]},
            },
            "spec.decode.extraArgs",
        ),
    ],
)
def test_a_configuration_error_names_the_field_that_set_the_flag(tmp_path, changes, field):
    """It named spec.engine.contextLength for any error of --context-length, also one that
    spec.decode.extraArgs set."""
    document = yaml.safe_load(QUICKSTART.read_text())
    for block, values in changes.items():
        document["spec"].setdefault(block, {}).update(values)
    path = tmp_path / "isvc.yaml"
    path.write_text(yaml.safe_dump(document))
    args = cli.build_parser().parse_args(["-f", str(path), "--port", str(free_port())])
    local, listener = cli._plan(args)
    listener.close()
    (decode,) = [engine for engine in local.engines if engine.role == contract.DECODE]
    why = "exit code 2: kubesgl serve: --context-length 100000 exceeds this model's 2048"
    assert cli._in_spec(why, [decode]) == f" in {field}"


def test_replicas_whose_flag_comes_from_two_fields_name_both(tmp_path):
    document = yaml.safe_load(QUICKSTART.read_text())
    document["spec"]["engine"]["contextLength"] = 100000
    document["spec"]["decode"]["extraArgs"] = ["--context-length", "100000"]
    path = tmp_path / "isvc.yaml"
    path.write_text(yaml.safe_dump(document))
    args = cli.build_parser().parse_args(["-f", str(path), "--port", str(free_port())])
    local, listener = cli._plan(args)
    listener.close()
    why = "exit code 2: kubesgl serve: --context-length 100000 exceeds this model's 2048"
    assert cli._in_spec(why, list(local.engines)) == (
        " in spec.engine.contextLength and spec.decode.extraArgs"
    )
    assert cli._in_spec("exit code 2: kubesgl serve: --port 1 is in use", list(local.engines)) == ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HUNG_UP = r"""
import sys, time
from kubesgl.up.cli import detach_from_terminal
time.sleep(0.5)  # the test closes the terminal's master side meanwhile
try:
    print("x" * 100, flush=True)  # fails: the terminal hung up
except OSError:
    detach_from_terminal()
print("the drain goes on after a hangup", flush=True)  # to /dev/null now
"""


@pytest.mark.skipif(
    sys.platform != "linux",
    reason="reads the EIO a hung-up pty gives on Linux; other systems report a hang-up otherwise",
)
def test_after_a_hangup_output_goes_nowhere_instead_of_failing(tmp_path):
    """On a closed terminal every write fails with EIO; `kubesgl up` redraws its table while it
    drains, so on SIGHUP its output is pointed at /dev/null first."""
    master, slave = pty.openpty()
    child = subprocess.Popen([sys.executable, "-c", HUNG_UP], stdout=slave, stderr=slave)
    os.close(slave)
    os.close(master)
    assert child.wait(timeout=30) == 0


def test_after_a_hangup_output_to_a_file_goes_on_there(tmp_path):
    """`kubesgl up ... > up.log &` whose shell hangs up: the drain's lines went to /dev/null
    too, and the log ended at 'ready'."""
    log = tmp_path / "up.log"
    with log.open("w") as out:
        detach = "from kubesgl.up.cli import detach_from_terminal; detach_from_terminal()"
        subprocess.run(
            [sys.executable, "-c", f"{detach}; print('stopped')"], stdout=out, check=True
        )
    assert log.read_text() == "stopped\n"


def test_an_ipv6_address_is_free_to_listen_on_when_nothing_holds_it():
    with socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::1", 0))
        port = probe.getsockname()[1]
    cli.listen_socket("::1", port).close()
    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::1", port))
        taken.listen()
        with pytest.raises(CannotListen, match="already in use"):
            cli.listen_socket("::1", port)


def test_the_routers_port_is_held_from_the_start_and_handed_to_the_router(
    tmp_path, monkeypatch, capsys
):
    """The router bound --port only once the engines were ready, 15 to 30 s after the check at
    start: a second `kubesgl up` on the same port passed that check, its router failed to bind
    and was restarted forever, while its readiness probe reached the first one's router and
    announced it ready. Now `kubesgl up` listens on the port from its start, and its router
    serves that socket."""
    fake_plan(tmp_path, monkeypatch, **{"decode-0": SERVING})
    port = free_port()
    seen = {}

    class Probe(Supervisor):
        def tick(self) -> None:
            if not seen:
                seen["another server listens"] = _listens_on(port)  # while the engines load
                (router,) = [r for r in self.replicas if r.process.role == contract.ROUTER]
                seen["router"] = router.process
            super().tick()

    monkeypatch.setattr(cli, "Supervisor", Probe)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        assert cli.main(["-f", str(QUICKSTART), "--port", str(port), "--logs", str(tmp_path)]) == 0
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert not seen["another server listens"]
    (fd,) = seen["router"].pass_fds
    assert seen["router"].argv[-2:] == ("--fd", str(fd))
    assert _listens_on(port)  # free again once it ends


READY_THEN_DRAINING = r"""
import http.server, signal, sys, threading, time
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # its server's thread too

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
signal.sigwait({signal.SIGTERM})
print("draining", flush=True)
time.sleep(3)
"""


def test_the_routers_port_refuses_connections_once_the_router_stops(tmp_path, monkeypatch):
    """`kubesgl up` held the router's port until it ended: while the engines drained (87 s at
    most) a new connection was taken into the port's queue, where nothing accepted it, and
    reset when it ended. The router's own server refuses one once it stops; so does the port
    now, while the engines still drain."""
    engine_port, port = free_port(), free_port()
    engine = LocalProcess(
        "decode-0",
        contract.DECODE,
        (sys.executable, "-c", READY_THEN_DRAINING, str(engine_port)),
        {},
        engine_port,
        30,
    )
    router = LocalProcess(
        "router",
        contract.ROUTER,
        (sys.executable, "-c", SERVING),
        {},
        1,
        10,
        waits_for=(contract.DECODE,),
    )
    local = LocalPlan("quickstart", "disaggregated", str(tmp_path), None, (engine,), router, ())
    monkeypatch.setattr(cli, "plan", lambda isvc, settings: local)
    connected: list[bool] = []

    def client() -> None:
        deadline = time.monotonic() + 60
        while not (tmp_path / "router.log").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # the router starts once the engine is ready
        os.kill(os.getpid(), signal.SIGINT)
        while "draining" not in (tmp_path / "decode-0.log").read_text().splitlines():
            time.sleep(0.05)  # the router has stopped: the engines are stopped after it
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            connected.append(True)
        except ConnectionRefusedError:
            connected.append(False)

    threading.Thread(target=client, daemon=True).start()
    args = ["-f", str(QUICKSTART), "--port", str(port), "--logs", str(tmp_path)]
    assert cli.main(args) == 0
    assert (tmp_path / "router.log").exists()  # it ran, on the port's socket
    assert connected == [False]


def _listens_on(port: int) -> bool:
    """Whether another server could listen on the port now, as the router's own server does."""
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            other.bind(("127.0.0.1", port))
            other.listen()
        except OSError:
            return False
        return True


CRASHING = "import sys; sys.exit(1)"  # a crash, restarted with a backoff until stopped


@pytest.fixture
def temporary_root(tmp_path, monkeypatch) -> Path:
    """Where `kubesgl up` makes its temporary log folder in these tests."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def fake_plan(tmp_path: Path, monkeypatch, **codes: str) -> None:
    """`kubesgl up` runs these processes, by name and Python code, as its plan."""
    processes = [
        LocalProcess(name, contract.DECODE, (sys.executable, "-c", code), {}, free_port(), 10)
        for name, code in codes.items()
    ]
    router = LocalProcess("router", contract.ROUTER, (sys.executable, "-c", SERVING), {}, 1, 10)
    router = LocalProcess(**{**router.__dict__, "waits_for": (contract.DECODE,)})
    local = LocalPlan("quickstart", "disaggregated", str(tmp_path), None, (*processes,), router, ())
    monkeypatch.setattr(cli, "plan", lambda isvc, settings: local)


def run_up(args: list[str], ctrl_c_after_s: float) -> int:
    """`kubesgl up` with these arguments, stopped by a Ctrl-C after a while."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    ctrl_c = threading.Timer(ctrl_c_after_s, os.kill, (os.getpid(), signal.SIGINT))
    ctrl_c.start()
    try:
        return cli.main(["-f", str(QUICKSTART), "--port", str(free_port()), *args])
    finally:
        ctrl_c.cancel()
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def test_a_clean_end_removes_the_temporary_log_folder(
    tmp_path, monkeypatch, capsys, temporary_root
):
    """Every run without --logs left a /tmp/kubesgl-up-NAME-* folder behind. Its removal is
    said: the folder printed at the start is gone, and --logs keeps one."""
    fake_plan(tmp_path, monkeypatch, **{"decode-0": SERVING})
    assert run_up([], ctrl_c_after_s=1.5) == 0
    out, err = capsys.readouterr()
    assert f"logs: {temporary_root}/kubesgl-up-quickstart-" in out and "decode-0: stopped" in out
    assert list(temporary_root.iterdir()) == [] and "kept" not in err
    assert err.endswith("kubesgl up: logs removed (nothing failed); --logs DIR keeps them\n"), err


def test_a_folder_given_with_logs_stays_after_a_clean_end(tmp_path, monkeypatch, temporary_root):
    fake_plan(tmp_path, monkeypatch, **{"decode-0": SERVING})
    assert run_up(["--logs", str(tmp_path / "logs")], ctrl_c_after_s=1.5) == 0
    assert (tmp_path / "logs" / "decode-0.log").exists()


@pytest.mark.parametrize(
    ("code", "status"),
    [(REFUSING, 2), (CRASHING, 0)],
    ids=["a configuration error", "a crash, restarted"],
)
def test_trouble_keeps_the_temporary_log_folder_and_says_where(
    tmp_path, monkeypatch, capsys, temporary_root, code, status
):
    """Its logs tell what went wrong: an engine that exited with status 2 (which stops
    everything), or one that crashed and was restarted before the Ctrl-C."""
    fake_plan(tmp_path, monkeypatch, **{"decode-0": code})
    assert run_up([], ctrl_c_after_s=3) == status
    (kept,) = temporary_root.iterdir()
    assert (kept / "decode-0.log").exists()
    assert capsys.readouterr().err.endswith(f"kubesgl up: logs kept in {kept}\n")


def test_a_failed_model_step_keeps_the_temporary_log_folder(
    tmp_path, monkeypatch, capsys, temporary_root
):
    def fail(step, log_path: Path) -> None:
        log_path.write_text("401 Client Error\n")
        raise ModelStepFailed("hf download ... exited with code 1")

    monkeypatch.setattr(cli, "ensure_model", fail)
    spec = ["-f", str(QUICKSTART), "--port", str(free_port())]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no model made yet
    assert cli.main(spec) == 1
    (kept,) = temporary_root.iterdir()
    assert (kept / "model.log").read_text() == "401 Client Error\n"
    assert capsys.readouterr().err == (
        f"kubesgl up: hf download ... exited with code 1\nkubesgl up: logs kept in {kept}\n"
    )


DISAGGREGATED = QUICKSTART.parent / "disaggregated.yaml"


def test_a_download_to_run_on_the_cpu_is_named_so_after_a_note(
    tmp_path, monkeypatch, capsys, temporary_root
):
    """examples/disaggregated.yaml without a GPU: "making the model, once: hf download
    meta-llama/Llama-3.1-8B-Instruct ...", about 16 GB for three engines on the CPU, unsaid."""
    monkeypatch.setattr(cli, "visible_gpus", lambda: ())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def fail(step, log_path: Path) -> None:  # nothing is downloaded
        raise ModelStepFailed("stopped by the test")

    monkeypatch.setattr(cli, "ensure_model", fail)
    assert cli.main(["-f", str(DISAGGREGATED), "--port", str(free_port())]) == 1
    notes = [line.split(" ", 1)[1] for line in capsys.readouterr().out.splitlines()[4:]]
    assert notes[0] == "no GPU here: the engines run on the CPU"
    assert notes[1] == (
        "the model is not on this machine: it is downloaded first (up to 40Gi, the pod "
        "volume's sizeLimit), then each of the 3 engines holds a copy in memory and runs it on "
        "the CPU: slow for a model of billions of parameters, if it fits at all; "
        "examples/quickstart.yaml is the example for a laptop"
    )
    assert notes[2].startswith(
        "downloading the model, once: hf download meta-llama/Llama-3.1-8B-Instruct "
    )


DRAINING = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1), sys.exit(0)))
time.sleep(600)
"""
DEAF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def run_up_signalled(args: list[str], at_s: list[float]) -> int:
    """`kubesgl up` with these arguments, sent SIGINT at each of these times."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    timers = [threading.Timer(t, os.kill, (os.getpid(), signal.SIGINT)) for t in at_s]
    for timer in timers:
        timer.start()
    try:
        return cli.main(["-f", str(QUICKSTART), "--port", str(free_port()), *args])
    finally:
        for timer in timers:
            timer.cancel()
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def test_a_stop_signal_sent_twice_at_once_drains(tmp_path, monkeypatch, capsys):
    """`timeout -s INT 25 kubesgl up ...` signals `kubesgl up` and then its process group: two
    SIGINTs milliseconds apart were taken as Ctrl-C twice, and everything was killed."""
    fake_plan(tmp_path, monkeypatch, **{"decode-0": DRAINING})
    assert run_up_signalled(["--logs", str(tmp_path)], at_s=[2.0, 2.05]) == 0
    out = capsys.readouterr().out
    assert "decode-0: stopped" in out and "killed" not in out


def test_ctrl_c_twice_kills_at_once(tmp_path, monkeypatch, capsys):
    later = 2.0 + interrupt.DUPLICATE_SIGNAL_WINDOW_S + 0.3
    fake_plan(tmp_path, monkeypatch, **{"decode-0": DEAF})  # would be killed after 10 s
    assert run_up_signalled(["--logs", str(tmp_path)], at_s=[2.0, later]) == 0
    assert "decode-0: killed: at once, as asked" in capsys.readouterr().out


def test_a_folder_holding_one_inference_service_is_read_as_render_reads_it(tmp_path, capsys):
    """`kubesgl render -f DIR` reads a folder's manifests; `kubesgl up -f DIR` said only
    "[Errno 21] Is a directory"."""
    folder = tmp_path / "manifests"
    folder.mkdir()
    (folder / "isvc.yaml").write_text(QUICKSTART.read_text())
    (folder / "secret.yaml").write_text("apiVersion: v1\nkind: Secret\nmetadata: {name: key}\n")
    (folder / "README.md").write_text("not a manifest\n")
    missing = tmp_path / "no-such-model"
    assert cli.main(["-f", str(folder), "--logs", str(tmp_path), "--model", str(missing)]) == 2
    assert capsys.readouterr().err == (  # read and planned: stopped only by the model
        f"kubesgl up: {folder}/secret.yaml: skipped v1 Secret key: kubesgl up runs "
        "kubesgl.io InferenceServices only\n"
        f"kubesgl up: --model {missing}: not a folder on this machine\n"
    )
    invalid = Path(spec_file(tmp_path, prefill={"replicas": -1})).read_text()
    (folder / "isvc.yaml").write_text(invalid)
    assert cli.main(["-f", str(folder), "--logs", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[1] == f"kubesgl up: {folder}/isvc.yaml: InferenceService quickstart:"


def test_a_folder_of_several_inference_services_or_none_is_refused(tmp_path, capsys):
    examples = QUICKSTART.parent
    files = sorted(path.name for path in examples.glob("*.yaml"))
    assert cli.main(["-f", str(examples), "--logs", str(tmp_path)]) == 2
    assert capsys.readouterr().err.endswith(  # which files hold them, to pick one
        f"kubesgl up: {examples}: expected one InferenceService, found {len(files)} in "
        f"{', '.join(files)}: kubesgl up runs one at a time; give -f one file\n"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["-f", str(empty), "--logs", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"kubesgl up: cannot read {empty}: no .json, .yaml or .yml file in it\n"
    )


def test_the_stopping_line_names_only_what_runs(tmp_path, monkeypatch, capsys):
    """A Ctrl-C while the engines still loaded said "stopping: the router, then the engines",
    though the router, which waits for them, had not started."""
    fake_plan(tmp_path, monkeypatch, **{"decode-0": SERVING})  # never ready: no router
    assert run_up(["--logs", str(tmp_path)], ctrl_c_after_s=1.5) == 0
    out = capsys.readouterr().out
    assert (
        "stopping: the engines, the router not having started (Ctrl-C again kills them at once)"
        in out
    )
    assert "router: started" not in out and "the router, then" not in out


def test_the_engines_ports_come_from_the_port_range_given(tmp_path, capsys, starts_nothing):
    """On a shared or firewalled host the engines' and bootstrap servers' ports must come from a
    range of the user's; they came from 20000-32767 whatever the host allowed."""
    args = ["-f", str(QUICKSTART), "--port", str(free_port())]
    local, listener = cli._plan(
        cli.build_parser().parse_args([*args, "--port-range", "23100-23102"])
    )
    listener.close()
    ports = [p.port for p in local.engines] + [p.bootstrap_port for p in local.engines]
    assert sorted(port for port in ports if port is not None) == [23100, 23101, 23102]

    # one prefill engine (two ports) and one decode engine (one)
    assert cli.main([*args, "--port-range", "23100-23101", "--logs", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        "kubesgl up: --port-range 23100-23101: too few free ports in it; the engines need 3 "
        "(an engine needs one, a prefill engine two)\n"
    )


@pytest.mark.parametrize("text", ["23100", "0-10", "23100-70000", "a-b", "-"])
def test_a_port_range_that_is_none_is_a_usage_error(tmp_path, capsys, text, starts_nothing):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["-f", str(QUICKSTART), "--port-range", text, "--logs", str(tmp_path)])
    assert exit_.value.code == 2
    assert (
        f"--port-range: LOW-HIGH, two ports from 1 to 65535, not {text!r}"
        in capsys.readouterr().err
    )


def test_a_port_range_from_high_to_low_says_so(tmp_path, capsys, starts_nothing):
    """23001-23000 was refused as not "two ports from 1 to 65535", which both are."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["-f", str(QUICKSTART), "--port-range", "23001-23000", "--logs", str(tmp_path)])
    assert exit_.value.code == 2
    assert (
        "--port-range: LOW-HIGH, LOW no higher than HIGH, not '23001-23000'"
        in capsys.readouterr().err
    )
