"""Same-node weight sync: receivers read the sender's staging buffers in place, through a CUDA IPC
handle (GPU weights) or a shared-memory file (CPU weights), instead of getting their bytes over
TCP; and the rule that decides when a sync may do so.

Over loopback TCP every receiver costs the node two more copies of the weights (into and out of
the kernel), so on one node the fan-out is memory-bound whatever the route; in place, a receiver
costs one read.
"""

from __future__ import annotations

import itertools
import mmap
import os
import socket
import warnings
import weakref
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import torch

from raytool.weightsync.protocol import CudaBuffer

SHM_DIR = "/dev/shm"
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_segment_ids = itertools.count()
_swept = False  # whether this process removed the files of killed senders yet
_STORAGE_CLASSES = {"TypedStorage": torch.TypedStorage, "UntypedStorage": torch.UntypedStorage}


def address_host(address: str) -> str:
    """'tcp://10.0.0.5:5555' -> '10.0.0.5'."""
    host = urlsplit(address).hostname
    if host is None:
        raise ValueError(f"weight receiver address '{address}' is not of the form tcp://HOST:PORT")
    return host


def local_hosts(node_ip: str | None) -> set[str]:
    """Hosts that name this node: loopback, the given node IP (Ray's, which the caller knows
    best) and what this host name resolves to."""
    hosts = set(_LOOPBACK)
    if node_ip:
        hosts.add(node_ip)
    try:
        hosts.update(info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None))
    except OSError:
        pass  # an unresolvable host name: loopback and node_ip still count
    return hosts


def choose_kind(first: torch.Tensor | None, addresses: list[str], node_ip: str | None, ipc: bool | None,
                staging_bytes: int = 0) -> Literal["bytes", "cuda", "shm"]:
    """How a sync travels. ipc=True: in place, "cuda" for GPU weights, "shm" for CPU ones.
    ipc=None: in place when every receiver is on this node (a receiver elsewhere cannot open a
    handle or a file): "cuda" for GPU weights; "shm" for CPU ones when /dev/shm has room for the
    staging buffers (`staging_bytes`; containers often get 64 MB), else bytes. On the 2-core dev
    box shared memory took 0.10 s for SmolLM2-135M against 0.22 s over loopback TCP.
    ipc=False: bytes."""
    on_gpu = first is not None and first.device.type == "cuda"
    if ipc is None:
        here = local_hosts(node_ip)
        if not all(address_host(a) in here for a in addresses):
            return "bytes"
        return "cuda" if on_gpu else ("shm" if shm_has_room(staging_bytes) else "bytes")
    if not ipc:
        return "bytes"
    return "cuda" if on_gpu else "shm"


def shm_has_room(nbytes: int) -> bool:
    """Whether SHM_DIR can hold nbytes more, with a quarter to spare (Ray's object store may share it)."""
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize >= nbytes * 1.25


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def export_buffer(buffer: torch.Tensor) -> CudaBuffer:
    """An IPC handle to a flat uint8 CUDA tensor (the whole of its storage)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    rebuild, args = reduce_tensor(buffer)
    if rebuild is not rebuild_cuda_tensor:
        raise RuntimeError(f"weight sync: torch shares this buffer with {rebuild.__name__}, not a CUDA IPC handle")
    (_, _, _, _, storage_cls, _, _, handle, size, offset, _, ref_handle, ref_offset, event_handle, event_sync) = args
    return CudaBuffer(
        device_uuid=device_uuid(buffer.device), nbytes=buffer.numel(), storage_cls=storage_cls.__name__,
        storage_handle=handle, storage_size_bytes=size, storage_offset_bytes=offset,
        ref_counter_handle=ref_handle, ref_counter_offset=ref_offset, event_handle=event_handle,
        event_sync_required=event_sync,
    )


def local_device_index(uuid: str) -> int:
    """This process's index of the GPU with that UUID; where it is not visible here (another
    CUDA_VISIBLE_DEVICES), the current device, which opens the handle through peer access."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", index)) == uuid:
            return index
    return torch.cuda.current_device()


def import_buffer(handle: CudaBuffer) -> torch.Tensor:
    """The sender's staging buffer as a uint8 tensor in this process: valid until this receiver
    acks the bucket (the sender then refills it)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise RuntimeError(
            "weight sync: the sender chose CUDA IPC (same node, GPU weights) but this receiver "
            "has no CUDA device; construct the WeightSender with ipc=False"
        )
    return rebuild_cuda_tensor(
        torch.Tensor, (handle.nbytes,), (1,), 0, _STORAGE_CLASSES[handle.storage_cls], torch.uint8,
        local_device_index(handle.device_uuid), handle.storage_handle, handle.storage_size_bytes,
        handle.storage_offset_bytes, False, handle.ref_counter_handle, handle.ref_counter_offset,
        handle.event_handle, handle.event_sync_required,
    )



def create_segment(nbytes: int) -> tuple[str, torch.Tensor]:
    """A shared-memory file of nbytes, mapped here as a writable uint8 tensor. Remove the file with
    `remove_segment` when done (receivers that mapped it keep their mapping); it is removed when the
    tensor is collected too, so a sender that is never closed leaves nothing behind. A sender
    killed (SIGKILL: a trainer rank Ray kills) leaves its files: the first segment a process makes
    removes those of processes that are gone (`unlink_dead_senders_files`)."""
    global _swept
    if not _swept:
        _swept = True
        unlink_dead_senders_files()
    path = f"{SHM_DIR}/raytool-weights-{os.getpid()}-{next(_segment_ids)}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # no room: an error now, not a SIGBUS on a later write
        mapped = mmap.mmap(fd, nbytes)
    except OSError:
        os.close(fd)
        _unlink(path)
        raise
    else:
        os.close(fd)
    buffer = torch.frombuffer(mapped, dtype=torch.uint8)
    weakref.finalize(buffer, _unlink, path)
    return path, buffer


def remove_segment(path: str) -> None:
    _unlink(path)


def unlink_dead_senders_files(shm: str = SHM_DIR) -> list[str]:
    """Remove the staging files (`raytool-weights-PID-N`) whose sender process is gone: no process
    PID, or a process PID started a minute or more after the file's last write (the PID reused; the
    margin covers a VM's drift between process start times and file times) -> the paths removed.
    A receiver that still maps one keeps its mapping. (vLLM's own segments, which carry no PID, are
    `raytool.engines.vllm_engine.unlink_orphaned_segments`'.)"""
    import psutil

    removed = []
    for path in Path(shm).glob("raytool-weights-*-*"):
        try:
            pid = int(path.name.split("-")[2])
            made = path.stat().st_mtime
        except (ValueError, IndexError, FileNotFoundError):
            continue
        try:
            alive = psutil.Process(pid).create_time() < made + 60.0  # its maker wrote it after it started
        except psutil.NoSuchProcess:
            alive = False
        except psutil.Error:  # not ours to ask: left alone
            alive = True
        if not alive:
            _unlink(str(path))
            removed.append(str(path))
    return removed


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def open_segment(path: str) -> torch.Tensor:
    """A sender's shared-memory staging buffer, mapped read-only."""
    if not path.startswith(f"{SHM_DIR}/raytool-weights-"):
        raise ValueError(f"weight sync: '{path}' is not a raytool shared-memory staging file")
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"weight sync: the sender's shared-memory file {path} is not visible here: this receiver "
            "does not share /dev/shm with the sender (another container?); construct the WeightSender with ipc=False"
        ) from None
    try:
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # read-only mapping; callers copy what they keep
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapped, dtype=torch.uint8)
