"""The collective weight-sync path (`trainer.weight_sync_backend: collective`): each bucket's bytes
are broadcast in a process group of the sender (rank 0) and every receiver (each tensor-parallel
rank of each server: one receiver each), made for the sync: gloo on CPUs, NCCL on CUDA GPUs, HCCL
on Ascend NPUs. Headers, acks and verdicts stay on ZMQ, as in the other paths: a receiver learns
of a bucket (and of the group to join) from its header, and acks it once it has loaded it.

Every wait has a deadline, and nothing waits blind. The group is made by the sender's own store;
a receiver marks itself joined there first, so a join that runs out of time names the receivers
that never came. While the sender joins or broadcasts it watches each receiver's ZMQ connection
(raytool.weightsync.links): one that is down is named within seconds, and the group is aborted.
A broadcast completes at the sender once its bytes are on the wire; the receivers' acks say they
arrived, and one that does not ack in time is named (a stopped process). A group that failed is
never reused: the next sync makes a new generation (a new prefix in the same store), which a
restarted server joins like any other.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from raytool.config import RunConfig
from raytool.weightsync.protocol import GroupSpec, WeightSyncTimeout

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
DEVICES = {backend: device for device, backend in BACKENDS.items()}
_POLL_S = 0.05


def weights_device(cfg: RunConfig) -> str:
    """Where the trainer's weights are, so where a weight sync's buckets start: cuda, npu or cpu."""
    if not cfg.trainer.num_gpus:
        return "cpu"
    return "npu" if cfg.cluster.accelerator == "NPU" else "cuda"


def auto_backend(device: str, backend_available: bool) -> str:
    """What trainer.weight_sync_backend auto means for weights on `device` (`weights_device`):
    collective where they are on accelerators whose backend (NCCL, HCCL) the torch has, else zmq.
    Decided once, by raytool.resolve; `raytool plan` asks it for the cluster's image."""
    return "collective" if device != "cpu" and backend_available else "zmq"


def backend_for(device_type: str) -> str:
    if device_type not in BACKENDS:
        raise ValueError(f"weight sync: no collective backend for '{device_type}' weights (known: {', '.join(BACKENDS)})")
    return BACKENDS[device_type]


def missing_backend(device_type: str) -> str | None:
    """Why this torch build cannot make the collective group for `device_type` weights, or None."""
    backend = BACKENDS.get(device_type)
    if backend is None:
        return f"no collective backend for '{device_type}' weights (known: {', '.join(BACKENDS)})"
    if not dist.is_available():
        return "this torch build has no torch.distributed"
    if backend == "gloo" and not dist.is_gloo_available():
        return "this torch build has no gloo backend"
    if backend == "nccl" and not dist.is_nccl_available():
        return "this torch build has no NCCL backend (a CPU-only torch?)"
    if backend == "hccl":
        import importlib.util

        if importlib.util.find_spec("torch_npu") is None:  # it registers HCCL when the run imports it
            return "HCCL needs torch_npu, which is not installed"
    return None


def make_group(backend: str, store: dist.Store, rank: int, size: int, timeout_s: float):
    """A process group of its own (no default group needed: the trainer's FSDP group stays apart)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL

    options = ProcessGroupHCCL.Options()
    options._timeout = timeout
    return ProcessGroupHCCL(store, rank, size, options)


def _prefix(generation: int) -> str:
    return f"raytool-weight-sync/{generation}"


class SenderGroup:
    """The sender's side: the store the group meets at, and the group (rank 0) of one generation."""

    def __init__(self, host: str, addresses: list[str], backend: str, timeout_s: float, generation: int, settle_s: float):
        self.addresses, self.backend, self.timeout_s, self.generation = list(addresses), backend, timeout_s, generation
        self.settle_s = settle_s  # how long a peer's dropped connection takes to be seen down (raytool.weightsync.links)
        self.host = host
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))
        self._prefixed = dist.PrefixStore(_prefix(generation), self.store)
        self.pg = None

    def spec(self, address: str) -> GroupSpec:
        return GroupSpec(self.host, self.store.port, self.generation, len(self.addresses) + 1,
                         self.addresses.index(address) + 1, self.backend, self.timeout_s)

    def join(self, version: int, index: int, check: Callable[[], None]) -> None:
        """Make the group (the receivers join as they read the header just sent); `check` raises
        for a receiver seen gone meanwhile."""
        if self.pg is not None:
            return
        made: list = []

        def make() -> None:
            try:
                made.append(make_group(self.backend, self._prefixed, 0, len(self.addresses) + 1, self.timeout_s))
            except Exception as exc:  # noqa: BLE001 - reported below, by rank
                made.append(exc)

        threading.Thread(target=make, name="weight-sync-join", daemon=True).start()
        deadline = time.monotonic() + self.timeout_s
        while not made:
            check()
            if time.monotonic() > deadline:
                break
            time.sleep(_POLL_S)
        if not made or isinstance(made[0], Exception):
            absent = [a for rank, a in enumerate(self.addresses, 1) if not self._prefixed.check([f"joined/{rank}"])]
            cause = f"; {made[0]}" if made else ""
            raise WeightSyncTimeout(
                f"weight sync v{version}: {', '.join(absent) or 'a receiver'} did not join the {self.backend} group of bucket "
                f"{index} within {self.timeout_s:g}s{cause}", version=version, bucket=index, addresses=tuple(absent), kind="no_group",
            )
        self.pg = made[0]

    def broadcast(self, buffer: torch.Tensor, version: int, index: int, check: Callable[[], None]) -> None:
        """Send `buffer` to every receiver; returns once it is on the wire (their acks say it arrived)."""
        work = self.pg.broadcast(buffer, 0)
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            check()
            if time.monotonic() > deadline:
                raise WeightSyncTimeout(
                    f"weight sync v{version}: the {self.backend} broadcast of bucket {index} did not complete within "
                    f"{self.timeout_s:g}s (a receiver is stuck: see which did not ack)", version=version, bucket=index,
                    addresses=tuple(self.addresses), kind="no_ack",
                )
            time.sleep(_POLL_S / 10)
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - the backend's own words, under our verdict
            # A peer's connection broke (gloo says so at once, naming only an address of the group):
            # which receiver it was, its ZMQ connection tells once it has been down a while.
            settle = time.monotonic() + self.settle_s + 1.0
            while time.monotonic() < settle:
                check()
                time.sleep(_POLL_S)
            raise WeightSyncTimeout(
                f"weight sync v{version}: the {self.backend} broadcast of bucket {index} failed ({str(exc).splitlines()[0][:200]}) and "
                "no receiver's connection is down: see which did not ack", version=version, bucket=index,
                addresses=tuple(self.addresses), kind="no_ack",
            ) from None

    def close(self) -> None:
        """Abort the group (a peer blocked in it is released) and drop the store."""
        if self.pg is not None:
            _abort(self.pg)
            self.pg = None
        self.store = None


class ReceiverGroup:
    """A receiver's membership of one generation's group, and the buffer its broadcasts land in."""

    def __init__(self, spec: GroupSpec, device: torch.device):
        self.spec, self.device = spec, device
        store = dist.TCPStore(spec.host, spec.port, is_master=False, timeout=datetime.timedelta(seconds=spec.timeout_s))
        prefixed = dist.PrefixStore(_prefix(spec.generation), store)
        prefixed.set(f"joined/{spec.rank}", "1")
        self.pg = make_group(spec.backend, prefixed, spec.rank, spec.size, spec.timeout_s)
        self._buffer = torch.empty(0, dtype=torch.uint8, device=device)

    def matches(self, spec: GroupSpec) -> bool:
        return (spec.host, spec.port, spec.generation, spec.rank) == (self.spec.host, self.spec.port, self.spec.generation, self.spec.rank)

    def receive(self, nbytes: int, timeout_s: float) -> torch.Tensor:
        """The next broadcast's `nbytes` bytes (a view of a buffer kept from bucket to bucket)."""
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        view = self._buffer[:nbytes]
        self.pg.broadcast(view, 0, datetime.timedelta(seconds=timeout_s)).wait()
        return view

    def close(self) -> None:
        _abort(self.pg)


def _abort(pg) -> None:
    try:
        pg.abort()
    except Exception:  # noqa: BLE001 - a group that failed may refuse: it is dropped either way
        pass


def receiver_device(backend: str) -> torch.device:
    """Where a receiver's broadcasts land: host memory for gloo, this process's accelerator otherwise."""
    device = DEVICES[backend]
    return torch.device(device) if device == "cpu" else torch.device(device, getattr(torch, device).current_device())
