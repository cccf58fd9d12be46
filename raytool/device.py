"""Which accelerator a process has: torch device, distributed backend and Ray resource name."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cuda" | "npu" | "cpu"
    dist_backend: str  # "nccl" | "hccl" | "gloo"
    ray_resource: str | None  # "GPU" | "NPU" | None


def detect() -> DeviceInfo:
    import torch

    if torch.cuda.is_available():
        return DeviceInfo("cuda", "nccl", "GPU")
    if importlib_has("torch_npu"):
        import torch_npu  # noqa: F401  (registers torch.npu)

        if torch.npu.is_available():
            return DeviceInfo("npu", "hccl", "NPU")
    return DeviceInfo("cpu", "gloo", None)


def importlib_has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def set_torch_threads(threads: int) -> int:
    """Use `threads` intra-op threads (0: every core this process may run on); return the count."""
    import torch

    n = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    return n
