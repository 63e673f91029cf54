"""The device kernels of a piece of work, from torch.profiler: each kernel name's launches and
device time, the time kernels kept the device busy, and the time none did between the first
kernel's start and the last one's end (the gaps: launches the host had not yet made, or
the gaps between nodes of a graph)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True)
class KernelProfile:
    kernels: list[dict]  # per name: launches and device µs, longest first
    busy_us: float  # the union of the kernels' intervals
    idle_us: float  # from the first kernel's start to the last one's end, less busy_us

    def per(self, units: int) -> KernelProfile:
        """The figures per unit (replay, step) of the `units` that ran."""
        return KernelProfile(
            kernels=[
                {"kernel": k["kernel"], "launches": k["launches"] / units, "us": k["us"] / units}
                for k in self.kernels
            ],
            busy_us=self.busy_us / units,
            idle_us=self.idle_us / units,
        )


def kernel_profile(run: Callable[[], object]) -> KernelProfile:
    """The kernels that one call of `run` launched."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        raise RuntimeError("the profiler recorded no kernels (is CUPTI available?)")
    launches: Counter[str] = Counter()
    device_us: Counter[str] = Counter()
    for e in kernels:
        launches[e.name] += 1
        device_us[e.name] += e.device_time
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, reach = 0.0, spans[0][0]
    for start, end in spans:
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    rows = [{"kernel": name, "launches": n, "us": device_us[name]} for name, n in launches.items()]
    return KernelProfile(
        kernels=sorted(rows, key=lambda r: -r["us"]),
        busy_us=busy,
        idle_us=reach - spans[0][0] - busy,
    )
