"""The CPU engine sizes its KV pool from the memory its cgroup lets it use, not from the node's
/proc/meminfo (a pod sized from the node is OOM-killed), with a modest default share."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubesgl.engine.host_memory import HostMemory, host_memory

GIB = 1 << 30


def fake_host(
    tmp_path: Path, cgroup: str, files: dict[str, str], meminfo_gib: tuple[int, int] = (48, 64)
) -> Path:
    """A /proc with meminfo (available, total in GiB) and self/cgroup, and cgroup files under
    tmp_path/cgroup (paths relative to it)."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    available, total = meminfo_gib
    (proc / "meminfo").write_text(
        f"MemTotal:       {total * GIB // 1024} kB\n"
        f"MemFree:        1024 kB\nMemAvailable:   {available * GIB // 1024} kB\n"
    )
    (proc / "self" / "cgroup").write_text(cgroup)
    for name, text in files.items():
        path = tmp_path / "cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return proc


def test_without_a_limit_the_kernels_figures(tmp_path):
    proc = fake_host(tmp_path, "0::/\n", {"memory.max": "max\n", "memory.current": str(3 * GIB)})
    assert host_memory(proc, tmp_path / "cgroup") == HostMemory(48 * GIB, 64 * GIB)


def test_a_cgroup_v2_limit_caps_both_and_counts_the_working_set(tmp_path):
    # the pod's own cgroup, as a cgroup namespace shows it: "/" is the container's root
    proc = fake_host(
        tmp_path,
        "0::/\n",
        {
            "memory.max": str(4 * GIB),
            "memory.current": str(3 * GIB),
            "memory.stat": f"anon {2 * GIB}\nfile {GIB}\ninactive_file {GIB}\n",  # reclaimable cache
        },
    )
    assert host_memory(proc, tmp_path / "cgroup") == HostMemory(2 * GIB, 4 * GIB)


def test_a_limit_on_an_ancestor_binds_and_v1_unlimited_is_no_limit(tmp_path):
    unlimited = "9223372036854771712"  # what cgroup v1 reports without a limit
    proc = fake_host(
        tmp_path,
        "9:pids:/\n4:memory:/kubepods/pod1/engine\n0::/\n",
        {
            "memory/kubepods/pod1/engine/memory.limit_in_bytes": unlimited,
            "memory/kubepods/pod1/engine/memory.usage_in_bytes": str(GIB),
            "memory/kubepods/pod1/memory.limit_in_bytes": str(8 * GIB),
            "memory/kubepods/pod1/memory.usage_in_bytes": str(5 * GIB),
            "memory/kubepods/pod1/memory.stat": f"total_inactive_file {GIB}\n",
            "memory/memory.limit_in_bytes": unlimited,
            "memory/memory.usage_in_bytes": str(20 * GIB),
        },
    )
    assert host_memory(proc, tmp_path / "cgroup") == HostMemory(4 * GIB, 8 * GIB)


def test_a_path_the_container_does_not_see_falls_back_to_the_mount(tmp_path):
    """Without a cgroup namespace /proc/self/cgroup names the host's path, while the container's
    mount shows its own cgroup at the root."""
    proc = fake_host(
        tmp_path,
        "0::/kubepods.slice/pod2.slice/cri-abc.scope\n",
        {"memory.max": str(2 * GIB), "memory.current": str(GIB // 2)},
    )
    assert host_memory(proc, tmp_path / "cgroup") == HostMemory(3 * GIB // 2, 2 * GIB)


def test_the_cpu_kv_pool_takes_a_modest_share_of_the_pods_memory(tmp_path, tiny_model, monkeypatch):
    import torch

    from kubesgl.engine.config import CPU_MEM_FRACTION, GPU_MEM_FRACTION, EngineConfig
    from kubesgl.engine.model_config import load_model_config
    from kubesgl.engine.scheduler import engine

    proc = fake_host(tmp_path, "0::/\n", {"memory.max": str(GIB), "memory.current": str(GIB // 2)})
    monkeypatch.setattr(engine, "host_memory", lambda: host_memory(proc, tmp_path / "cgroup"))
    model_config = load_model_config(tiny_model("llama"))
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head_dim x float32 bytes
    config = EngineConfig(model="", max_running_requests=10**6)  # no cap from the requests
    tokens = engine.kv_pool_tokens(
        config, model_config, torch.float32, torch.device("cpu"), 2, 2048
    )
    # a share of the 512 MiB the pod has left, not of the node's 48 GiB
    assert tokens == int(GIB // 2 * CPU_MEM_FRACTION // per_token)
    assert CPU_MEM_FRACTION <= 0.4 < GPU_MEM_FRACTION  # two engines side by side fit
    config.mem_fraction_static = 0.5
    assert (
        engine.kv_pool_tokens(config, model_config, torch.float32, torch.device("cpu"), 2, 2048)
        == GIB // 4 // per_token
    )
    proc = fake_host(
        tmp_path / "full", "0::/\n", {"memory.max": str(GIB), "memory.current": str(GIB)}
    )
    monkeypatch.setattr(
        engine, "host_memory", lambda: host_memory(proc, tmp_path / "full" / "cgroup")
    )
    with pytest.raises(RuntimeError, match="no memory left for the KV cache"):
        engine.kv_pool_tokens(config, model_config, torch.float32, torch.device("cpu"), 2, 2048)
