"""The GPUs `kubesgl up` may hand out to engine replicas."""

from __future__ import annotations

import os


def visible_gpus() -> tuple[str, ...]:
    """The GPUs this process sees, named as CUDA_VISIBLE_DEVICES names them (indexes, or UUIDs
    where it lists those), so that each replica's CUDA_VISIBLE_DEVICES picks among them."""
    import torch  # only for specs that ask for GPUs: `up` on the CPU starts without it

    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = (
        [name.strip() for name in listed.split(",")]
        if listed is not None
        else [str(i) for i in range(count)]
    )
    return tuple(names[:count])
