"""The model of a plan, made or downloaded once into the cache by the command a pod's init
container runs; later runs find it there."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from kubesgl.up.log_tail import clip, last_lines
from kubesgl.up.plan import ModelStep


class ModelStepFailed(Exception):
    pass


def _error_line(log_path: Path, start: int) -> str:
    """The line of a failed step's log (after offset `start`) that says why: its last one that
    says error (`hf` ends with hints after it), else its last one."""
    lines = last_lines(log_path, start, size=65536)
    errors = [line for line in lines if "error" in line.lower()]
    return clip((errors or lines or [""])[-1])


def ensure_model(step: ModelStep, log_path: Path) -> None:
    """Runs the step unless its folder exists. The step writes into a fresh folder that is renamed
    into place once it succeeds: an interrupted run leaves no half-made model behind, and two
    runs at once do not mix their files."""
    if step.path.exists():
        return
    step.path.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f"{step.path.name}.partial-", dir=step.path.parent))
    argv = step.argv(partial)
    try:
        with log_path.open("ab") as log:
            start = log.tell()  # the log may hold earlier runs' lines
            try:
                result = subprocess.run(
                    argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **step.env}
                )
            except FileNotFoundError:
                raise ModelStepFailed(
                    f"{argv[0]} is not installed; the model needs {shlex.join(argv)}"
                ) from None
        if result.returncode != 0:
            why = _error_line(log_path, start)
            raise ModelStepFailed(
                f"{shlex.join(argv)} exited with code {result.returncode}"
                f"{': ' + why if why else ''} (log: {log_path})"
            )
        try:
            partial.rename(step.path)
        except OSError:
            if not step.path.exists():
                raise
            # another run finished first: keep its copy
        with log_path.open("a") as log:  # the step's own lines name the folder it wrote into
            log.write(f"model ready at {step.path}\n")
    finally:
        shutil.rmtree(partial, ignore_errors=True)
