"""The host memory this process may use: the kernel's MemAvailable, capped by the memory
cgroup's limit where one is set. In a pod, /proc/meminfo shows the node's memory, and an
engine that sized its KV pool from it would be OOM-killed at the pod's limit."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# cgroup v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages) instead of v2's "max"
_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class HostMemory:
    available: int  # bytes this process can still allocate
    total: int  # bytes it may hold at most


@dataclass(frozen=True)
class _CgroupFiles:
    """The names of a memory cgroup's files in one version of the interface."""

    limit: str
    usage: str
    inactive_file: str  # the key in memory.stat: page cache the kernel reclaims before OOM


_V2 = _CgroupFiles("memory.max", "memory.current", "inactive_file")
_V1 = _CgroupFiles("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def host_memory(
    proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> HostMemory:
    meminfo = _meminfo(proc / "meminfo")
    available, total = meminfo["MemAvailable"], meminfo["MemTotal"]
    for limit, used in _cgroup_limits(proc / "self" / "cgroup", cgroup_root):
        total = min(total, limit)
        available = min(available, max(0, limit - used))
    return HostMemory(available, total)


def _meminfo(path: Path) -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in path.read_text().splitlines())
    return {key: int(value.split()[0]) * 1024 for key, value in fields.items()}  # kB


def _cgroup_limits(membership: Path, cgroup_root: Path) -> Iterator[tuple[int, int]]:
    """(limit, bytes in use) of every memory cgroup from this process's own up to the root of
    the mount: a limit on an ancestor binds too. In use is the working set (usage minus inactive
    page cache), as the kubelet counts it."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            mount, files = cgroup_root, _V2
        elif "memory" in controllers.split(","):
            mount, files = cgroup_root / "memory", _V1
        else:
            continue
        # The path is relative to the cgroup namespace's root; in a container the mount may be
        # that root already, so folders that do not exist here are skipped on the way up.
        folder = mount / path.lstrip("/")
        for directory in [folder, *folder.parents]:
            if directory == mount.parent:
                break
            limit = _read_limit(directory / files.limit)
            if limit is not None:
                yield limit, _read_usage(directory, files)


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or int(text) >= _UNLIMITED:
        return None
    return int(text)


def _read_usage(directory: Path, files: _CgroupFiles) -> int:
    usage = int((directory / files.usage).read_text())
    try:
        stat = dict(line.split() for line in (directory / "memory.stat").read_text().splitlines())
    except OSError:
        return usage
    return usage - int(stat.get(files.inactive_file, 0))
