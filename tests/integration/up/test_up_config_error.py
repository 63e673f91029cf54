"""`kubesgl up` on a spec the engines refuse at start (status 2, a configuration error): it
stops everything and exits with status 2 naming the replica and the engine's error, where it
restarted both engines forever and never turned ready."""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml
from up_harness import RunningUp

QUICKSTART = Path(__file__).resolve().parents[3] / "examples" / "quickstart.yaml"


def test_a_context_length_beyond_the_models_stops_everything_with_status_2(tmp_path, tiny_model):
    document = yaml.safe_load(QUICKSTART.read_text())
    document["spec"]["model"] = {"servedName": "tiny", "hostPath": {"path": tiny_model("llama")}}
    document["spec"]["engine"]["contextLength"] = 100000
    spec = tmp_path / "quickstart.yaml"
    spec.write_text(yaml.safe_dump(document))
    up = RunningUp(spec, tmp_path)
    try:
        status = up.process.wait(timeout=180)
        output = up.output()
        assert status == 2, output
        groups = {int(pid) for pid in re.findall(r": started, pid (\d+)$", output, re.M)}
        assert groups and not [pid for pid in os.listdir("/proc") if in_groups(pid, groups)]
        error = (
            "exited (exit code 2: kubesgl serve: --context-length 100000 exceeds this model's "
            "context length, 2048 (max_position_embeddings in its config.json); give at most "
            "2048, or leave it unset): a configuration error in spec.engine.contextLength, "
            "which a restart would only repeat; everything is stopped"
        )
        # said once, for each engine that exited so before everything stopped
        assert output.count("--context-length 100000 exceeds") == 1
        assert re.search(
            rf"^kubesgl up: (prefill-0|decode-0|prefill-0, decode-0) {re.escape(error)}$",
            output,
            re.M,
        )
        assert "; restarting" not in output  # neither engine was started again
        assert "router: started" not in output
    finally:
        up.kill()


def in_groups(pid: str, groups: set[int]) -> bool:
    """Whether /proc's entry `pid` is a live process of one of the process groups."""
    try:
        state, _, group = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:3]
    except (OSError, ValueError, IndexError):
        return False
    return int(group) in groups and state != "Z"
