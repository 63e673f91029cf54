"""`kubesgl up -f FILE`: run an InferenceService on this machine until Ctrl-C, SIGTERM or SIGHUP,
or until a process exits with a configuration error (status 2), which `kubesgl up` exits with."""

from __future__ import annotations

import argparse
import errno
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubesgl import contract
from kubesgl.cli_help import CommandParser, port_number
from kubesgl.listen import CannotListen, listen_socket
from kubesgl.operator.render_cli import (
    NO_DOCUMENT,
    READ_ERRORS,
    input_files,
    list_items,
    print_problems,
    read_documents,
    skipped_as_other_kind,
)
from kubesgl.operator.spec import KIND
from kubesgl.operator.validation import InvalidSpec, parse_inference_service
from kubesgl.up.gpus import visible_gpus
from kubesgl.up.interrupt import INTERRUPTED, repeats, stop_on_signals
from kubesgl.up.model import ModelStepFailed, cpu_size_note, ensure_model
from kubesgl.up.plan import (
    PORT_RANGE,
    LocalPlan,
    LocalProcess,
    LocalSettings,
    NoFreePort,
    NotEnoughGpus,
    PortPicker,
    plan,
    serving_on,
    spec_fields,
)
from kubesgl.up.status import StatusView
from kubesgl.up.supervisor import Replica, Supervisor, by_reason

PROG = "kubesgl up"
NO_IMAGE = "none: kubesgl up runs no image"  # spec.image of a spec that gives none
TICK_S = 0.5


def build_parser() -> CommandParser:
    parser = CommandParser(
        prog=PROG,
        description="Run an InferenceService on this machine: every replica of its engine roles and "
        "the router, as local processes started from the command lines the operator puts in pods. Runs until "
        "Ctrl-C, SIGTERM or SIGHUP (its terminal closed), which drain and stop everything.",
    )
    parser.add_argument(
        "-f",
        "--filename",
        required=True,
        help="a YAML or JSON file holding one InferenceService (other kinds beside it are skipped), "
        "a folder of such files holding one in all (its .json, .yaml and .yml files), "
        "or - for standard input",
    )
    parser.add_argument(
        "--port",
        type=port_number,
        default=contract.ROUTER_PORT,
        help=f"port of the router, the OpenAI endpoint (default: {contract.ROUTER_PORT})",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address the router listens on (default: 127.0.0.1)"
    )
    parser.add_argument(
        "--port-range",
        metavar="LOW-HIGH",
        type=port_range,
        default=None,
        help="the ports of the engines and their bootstrap servers, e.g. 23000-23099 (default: "
        f"free ones from {PORT_RANGE.start}-{PORT_RANGE.stop - 1} outside the kernel's range for "
        "outgoing connections)",
    )
    parser.add_argument(
        "--logs",
        metavar="DIR",
        default=None,
        help="folder for each process's log (default: a new temporary folder, removed when up stops cleanly)",
    )
    parser.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="serve this local model folder instead of spec.model (needed for a pvc source)",
    )
    return parser


def port_range(text: str) -> range:
    """LOW-HIGH, two ports, the first no higher than the second."""
    low, dash, high = text.partition("-")
    try:
        ports = range(port_number(low), port_number(high) + 1)
    except argparse.ArgumentTypeError:
        ports = None
    if not dash or ports is None:
        raise argparse.ArgumentTypeError(f"LOW-HIGH, two ports from 1 to 65535, not {text!r}")
    if not ports:
        raise argparse.ArgumentTypeError(f"LOW-HIGH, LOW no higher than HIGH, not {text!r}")
    return ports


class _Refused(Exception):
    """`kubesgl up` stops before running anything: `message` (None: already reported, or
    nothing to say) goes to standard error after the program's name, and it exits with
    `code`."""

    def __init__(self, message: str | None, code: int = 2):
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass(frozen=True)
class _LogFolder:
    path: Path
    temporary: bool  # made for this run (no --logs): removed when it ends cleanly


def main(argv: list[str]) -> int:
    stop_on_signals()  # already, where `kubesgl` ran it; a test may call main itself
    try:
        args = build_parser().parse_args(argv)
        local, listener = _plan(args)
    except _Refused as refused:
        return _report(refused)
    except KeyboardInterrupt:
        return INTERRUPTED
    # the router's port is this run's, the router's restarts included, until the router stops
    with listener:
        return _run(local, args.logs, listener)


def _run(local: LocalPlan, logs_given: str | None, listener: socket.socket) -> int:
    """Makes the model if it must, runs the plan's processes until they stop, and leaves the
    log folder; the exit status. `listener`, the router's port, is closed as the router
    stops."""
    try:
        logs = _log_folder(local.name, logs_given)
    except _Refused as refused:
        return _report(refused)
    except KeyboardInterrupt:
        return INTERRUPTED
    try:
        view = _prepare(local, logs.path)
    except _Refused as refused:
        status, troubled = _report(refused), True
    except KeyboardInterrupt:
        status, troubled = INTERRUPTED, False
    else:
        status, troubled = _supervise(local, logs.path, view, listener)
    _leave(logs, keep=troubled)
    return status


def _report(refused: _Refused) -> int:
    """Says why `kubesgl up` stops before running anything; its exit status."""
    if refused.message is not None:
        print(f"{PROG}: {refused.message}", file=sys.stderr)
    return refused.code


def _plan(args: argparse.Namespace) -> tuple[LocalPlan, socket.socket]:
    """The processes to run for the file's InferenceService on this machine, and the socket
    listening on the router's port that its router serves on; raises _Refused if it cannot be
    read or run here."""
    documents, found = _read(args.filename)
    problem = _not_one_inference_service(documents, found)
    if problem is not None:
        raise _Refused(f"{args.filename}: {problem}")
    filename, document = found[0]  # a folder's file that holds it, for messages
    try:
        isvc = parse_inference_service(_image_optional(document))
        gpus = visible_gpus() if isvc.spec.engine.device == "cuda" else ()
        settings = LocalSettings(
            host=args.host,
            port=args.port,
            gpus=gpus,
            model=args.model,
            environ=os.environ,
            free_port=PortPicker(args.port_range),
        )
        local = plan(isvc, settings)
    except InvalidSpec as error:
        print_problems(PROG, filename, document, error)  # one line per problem
        raise _Refused(None) from error
    except NotEnoughGpus as error:
        raise _Refused(f"{filename}: {error}") from error
    except NoFreePort as error:
        low, high = args.port_range.start, args.port_range.stop - 1
        raise _Refused(
            f"--port-range {low}-{high}: too few free ports in it; the engines need "
            f"{error.needed} (an engine needs one, a prefill engine two)"
        ) from error
    missing = _missing_model(local, args.model, filename)
    if missing is not None:
        raise _Refused(missing)
    try:
        listener = listen_socket(args.host, args.port)
    except CannotListen as error:
        raise _Refused(str(error)) from error
    return serving_on(local, listener.fileno()), listener


def _read(given: str) -> tuple[list[Any], list[tuple[str, Any]]]:
    """The YAML documents of the file -f names, or of a folder's manifests as `kubesgl render -f
    DIR` reads them, and the objects to run in them, each with its file; raises _Refused where
    one cannot be read."""
    try:
        files = input_files(given)
    except OSError as error:  # a folder without any manifest
        raise _Refused(f"cannot read {given}: {error}") from error
    documents: list[Any] = []
    found: list[tuple[str, Any]] = []
    for filename in files:
        try:
            read = read_documents(filename)
        except READ_ERRORS as error:
            raise _Refused(f"cannot read {filename}: {error}") from error
        documents += read
        found += [(filename, obj) for obj in _inference_services(filename, read)]
    return documents, found


def _image_optional(document: dict[str, Any]) -> dict[str, Any]:
    """The document with a stand-in for a `spec.image` it leaves out. The schema (the CRD's)
    requires the image, which every pod runs; kubesgl up runs processes, not the image."""
    spec = document.get("spec")
    if not isinstance(spec, dict) or "image" in spec:
        return document
    return {**document, "spec": {**spec, "image": NO_IMAGE}}


def _log_folder(name: str, logs: str | None) -> _LogFolder:
    """The folder of --logs, made if it is not there, else a new temporary one."""
    if logs is None:
        return _LogFolder(Path(tempfile.mkdtemp(prefix=f"kubesgl-up-{name}-")), temporary=True)
    try:
        Path(logs).mkdir(parents=True, exist_ok=True)
    except FileExistsError as error:  # a file of that name: "File exists" said too little
        raise _Refused(f"--logs {logs}: {os.strerror(errno.ENOTDIR)}") from error
    except OSError as error:
        raise _Refused(f"--logs {logs}: {error.strerror or error}") from error
    return _LogFolder(Path(logs), temporary=False)


def _leave(logs: _LogFolder, keep: bool) -> None:
    """A temporary log folder goes once `kubesgl up` ends cleanly; after trouble it stays, for
    its logs to be read. Standard error says which (the header naming it has scrolled away).
    A folder of --logs always stays."""
    if not logs.temporary:
        return
    if keep:
        print(f"{PROG}: logs kept in {logs.path}", file=sys.stderr)
    else:
        shutil.rmtree(logs.path, ignore_errors=True)
        print(f"{PROG}: logs removed (nothing failed); --logs DIR keeps them", file=sys.stderr)


def _prepare(local: LocalPlan, log_dir: Path) -> StatusView:
    """The status view, with the plan's notes shown and the model made if it must be; raises
    _Refused if the model step fails."""
    view = StatusView(local, log_dir, sys.stdout, live=sys.stdout.isatty())
    for note in local.notes:
        view.note(note)
    size_note = cpu_size_note(local)
    if size_note is not None:
        view.note(size_note)
    step = local.model_step
    if step is not None and not step.path.exists():
        view.note(f"{step.action} the model, once: {shlex.join(step.argv(step.path))}")
        try:
            ensure_model(step, log_dir / "model.log")
        except ModelStepFailed as error:
            raise _Refused(str(error), code=1) from error
    return view


def _supervise(
    local: LocalPlan, log_dir: Path, view: StatusView, listener: socket.socket
) -> tuple[int, bool]:
    """Run the plan's processes until Ctrl-C, SIGTERM or SIGHUP (status 0), or until one exits
    with a configuration error (status 2, naming it); then drain and stop them all. Also
    whether a process had trouble: it exited on its own, or was killed as it stopped. The
    router's port (`listener`) is closed as the router gets its SIGTERM: a connection is then
    refused, once the router's server has closed its copy, instead of waiting in the port's
    queue while the engines drain, to be reset when `kubesgl up` ends."""
    stop, force = threading.Event(), threading.Event()
    stopped_at: list[float] = []  # when a signal stopped it, if one did

    def stop_now() -> None:
        if not stop.is_set():
            stopped_at.append(time.monotonic())
            stop.set()

    def on_signal(signum: int, frame: object) -> None:
        # the first Ctrl-C drains; a second one kills what is still running, unless it is the
        # first one again (a signal to the process group: `repeats`)
        if not stop.is_set():
            stop_now()
        elif not repeats(stopped_at[0] if stopped_at else None):
            force.set()

    def on_hangup(signum: int, frame: object) -> None:
        # The terminal was closed: drain as on Ctrl-C, with nowhere to write to. A hangup
        # never escalates (the kernel and the shell may both send one).
        detach_from_terminal()
        stop_now()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)
    # stops as above now; its probes end with the block
    with Supervisor(local.processes, log_dir, on_event=view.event) as supervisor:
        try:
            while not stop.is_set():
                supervisor.tick()
                view.refresh(supervisor.replicas)
                if supervisor.failed:
                    break
                stop.wait(TICK_S)
            if supervisor.failed:
                stop.set()  # as after a Ctrl-C: a Ctrl-C during the drain kills at once
                names = ", ".join(replica.process.name for replica in supervisor.failed)
                what = _what_stops(supervisor.replicas, "(Ctrl-C kills {} at once)")
                view.note(f"stopping, {names} exited with status 2 (a configuration error): {what}")
            else:
                what = _what_stops(supervisor.replicas, "(Ctrl-C again kills {} at once)")
                view.note(f"stopping: {what}")
        finally:
            supervisor.stop(
                force,
                on_tick=lambda: view.refresh(supervisor.replicas),
                routers_stopping=listener.close,
            )
            view.close()
    for why, names in by_reason(supervisor.failed).items():  # every replica says the same
        processes = [r.process for r in supervisor.failed if r.last_exit == why]
        print(
            f"{PROG}: {names} exited ({why}): a configuration error{_in_spec(why, processes)}, "
            "which a restart would only repeat; everything is stopped",
            file=sys.stderr,
        )
    return (2 if supervisor.failed else 0), bool(supervisor.troubled)


def _in_spec(why: str, processes: list[LocalProcess]) -> str:
    """' in spec.engine.contextLength' where an engine's error names the flag of a spec field,
    or ' in spec.decode.extraArgs' where those set it; the field of each process that exited."""
    flag = re.search(r"kubesgl serve: (--[a-z0-9-]+)", why)
    fields = spec_fields(processes, flag[1]) if flag else []
    return f" in {' and '.join(fields)}" if fields else ""


def _what_stops(replicas: list[Replica], kill_hint: str) -> str:
    """What the drain stops, in its order: what runs, the router only once it has started (it
    waits for the engines to be ready), with kill_hint naming them."""
    running = [replica for replica in replicas if replica.popen is not None]
    router = any(replica.process.role == contract.ROUTER for replica in running)
    engines = any(replica.process.role != contract.ROUTER for replica in running)
    if router and engines:
        return f"the router, then the engines {kill_hint.format('them')}"
    if engines:
        return f"the engines, the router not having started {kill_hint.format('them')}"
    if router:
        return f"the router {kill_hint.format('it')}"
    return "nothing runs"


def _inference_services(filename: str, documents: list[Any]) -> list[Any]:
    """The objects of a file's documents (a List's items too) to run, as `kubesgl render` takes
    them: other kinds are skipped with a note (a file for kubectl apply often holds a Secret or
    a Namespace beside the InferenceService)."""
    return [
        obj
        for document in documents
        for obj in list_items(document)
        if not skipped_as_other_kind(PROG, "runs", filename, obj)
    ]


def _not_one_inference_service(documents: list[Any], found: list[tuple[str, Any]]) -> str | None:
    """Why a file's YAML documents (`found`: each InferenceService with its file) do not hold
    the one InferenceService `kubesgl up` runs."""
    if not documents:
        return NO_DOCUMENT
    if not found:
        return f"no {KIND} in it"
    if len(found) > 1:
        files = sorted({Path(filename).name for filename, _ in found})  # of the folder given
        where = f" in {', '.join(files)}" if len(files) > 1 else ""
        return (
            f"expected one {KIND}, found {len(found)}{where}: {PROG} runs one at a time; "
            "give -f one file"
        )
    if not isinstance(found[0][1], dict):
        return f"expected an {KIND}, found no mapping"
    return None


def detach_from_terminal() -> None:
    """Point standard output and error at /dev/null unless they are a file: after a hangup
    every write to the terminal fails (EIO), as one to a pipe whose reader the hangup ended
    (`| tee`) does (EPIPE), and the drain would stop at the first table redraw. A file
    (`kubesgl up ... > up.log &`) keeps the drain's lines."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.dup2(devnull, fd)
    os.close(devnull)


def _missing_model(local: LocalPlan, model: str | None, filename: str) -> str | None:
    """Why the model folder to serve as it is (--model, a hostPath) cannot be served: every
    engine would exit at start and be restarted forever."""
    if local.model_step is not None or Path(local.model_path).is_dir():
        return None
    source = "--model" if model is not None else f"{filename}: spec.model.hostPath.path"
    return f"{source} {local.model_path}: not a folder on this machine"
