"""Programmatic dependent launch (PDL) for the engine's short Triton kernels.

A decode step is a chain of kernels of a few µs each (norms, RoPE, the KV write,
silu-and-mul), and between two of them the GPU idles while the second one is scheduled.
Launched with PDL (compute capability 9.0 and later), a kernel is scheduled while its
predecessor in the stream is still finishing, and its programs then wait at
`tl.extra.cuda.gdc_wait` until the predecessor has completed and its writes are visible.
Only the launch overlaps, never the data: each kernel launched this way calls
`wait_for_predecessor` before its first load or store, so it reads what its predecessor
wrote, and the kernel after it (which may start early in turn) sees all of its writes.
The one exception is the batch-1 GEMV (layers/triton_kernels/gemv.py), which loads its
weights first: no kernel of a step writes them.

On the H200 this took 62 µs off a batch-1 decode step of 4.73 ms (FlashInfer attention,
one pair of runs). Launching the Triton decode attention's two kernels this way too made
that backend's step about 0.1 ms slower, so they launch plainly (benchmarks/README.md,
eighth session).

Kernels take `**pdl_launch(device)` at launch: `USE_PDL` (constexpr) and, where PDL is on,
`launch_pdl`. It is off on CPUs, on older GPUs and under Triton's interpreter.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def pdl_enabled(device: torch.device) -> bool:
    """PDL needs a real launch on an NVIDIA GPU of compute capability 9.0 or later (ROCm
    devices are "cuda" to torch too, with capabilities of their own)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def pdl_launch(device: torch.device) -> dict[str, bool]:
    """Launch options of a kernel that begins with `wait_for_predecessor(USE_PDL)`, decided
    once per device (kernels are launched on the hot path). Unpack it, never change it."""
    if pdl_enabled(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def wait_for_predecessor(USE_PDL: tl.constexpr):
    """With PDL: wait until the previous kernel's writes are visible, then let the next
    kernel be scheduled (its programs wait in turn, so starting it early is safe)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
