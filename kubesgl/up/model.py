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
from kubesgl.up.plan import LocalPlan, ModelStep

# Weights this large (about 2 billion parameters in bfloat16) answer slowly on a CPU, and each
# engine replica holds its own copy in this machine's memory.
LARGE_ON_CPU_BYTES = 4 * 10**9
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")
LAPTOP_EXAMPLE = "examples/quickstart.yaml is the example for a laptop"


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
    runs at once do not mix their files. A step that fails removes the cache folders it made
    (`hf/ORG/NAME/` of a download's `hf/ORG/NAME/REVISION`) too."""
    if step.path.exists():
        return
    made = _make_folder(step.path.parent)
    partial = Path(tempfile.mkdtemp(prefix=f"{step.path.name}.partial-", dir=step.path.parent))
    argv = step.argv(partial)
    succeeded = False
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
        succeeded = True
    finally:
        shutil.rmtree(partial, ignore_errors=True)
        if not succeeded:
            _remove_empty(made)


def _make_folder(folder: Path) -> list[Path]:
    """Makes the folder and the parents it lacks; those it made, the deepest first."""
    missing = [path for path in (folder, *folder.parents) if not path.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_empty(folders: list[Path]) -> None:
    """Removes the folders, the deepest first, up to one that is not empty: another run may
    have put a model of its own there meanwhile."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def weights_size(folder: Path) -> int | None:
    """The bytes of a model folder's weight files; None where the folder is not here."""
    if not folder.is_dir():
        return None
    return sum(path.stat().st_size for pattern in WEIGHT_FILES for path in folder.glob(pattern))


def cpu_size_note(local: LocalPlan) -> str | None:
    """What to know before the engines run the plan's model on the CPU where it is large, or
    still to download and so of a size unknown here: it may be slow, or not fit in memory.
    Not a refusal: a user may want it."""
    if any(engine.gpus for engine in local.engines):
        return None
    copies = (
        f"each of the {len(local.engines)} engines holds a copy in memory and runs it on the CPU"
    )
    size = weights_size(Path(local.model_path))
    step = local.model_step
    if size is None and step is not None and step.downloads:
        limit = (
            f"up to {step.size_limit}, the pod volume's sizeLimit"
            if step.size_limit
            else ("its size unknown until then")
        )
        return (
            f"the model is not on this machine: it is downloaded first ({limit}), then {copies}: "
            f"slow for a model of billions of parameters, if it fits at all; {LAPTOP_EXAMPLE}"
        )
    if size is None or size < LARGE_ON_CPU_BYTES:
        return None
    return (
        f"the model's weights take {size / 1e9:.1f} GB, and {copies}: slow, if it fits at all; "
        f"{LAPTOP_EXAMPLE}"
    )
