"""Socket folders of a server killed with kill -9 do not pile up: the next server removes
the folders whose process is gone, and only those."""

from __future__ import annotations

import os
import subprocess
import sys

from kubesgl.engine.ipc import FOLDER_PREFIX, remove_stale_folders


def test_folders_of_dead_servers_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{FOLDER_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{FOLDER_PREFIX}{os.getpid()}-def"
    other = tmp_path / "kubesgl-ipc-notapid"
    for folder in (stale, live, other):
        folder.mkdir()
        (folder / "api").write_text("")
    remove_stale_folders(str(tmp_path))
    assert not stale.exists() and live.exists() and other.exists()
