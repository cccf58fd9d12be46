"""Same-node weight sync: receivers read the sender's staging buffers in place, through a CUDA IPC
handle (GPU weights) or a shared-memory file (CPU weights), instead of getting their bytes over
TCP; and the rule that decides when a sync may do so.

Over loopback TCP every receiver costs the node two more copies of the weights (into and out of
the kernel), so on one node the fan-out is memory-bound whatever the route; in place, a receiver
costs one read.

CUDA IPC between two GPUs needs peer access: a receiver maps the sender's buffer into its own GPU's
address space and its GPU reads it over NVLink or PCIe. Hosts without it (consumer GPUs, many
PCIe-only VMs, GPUs on different CPU sockets) fail there, so before a sender's first CUDA IPC sync
`cuda_ipc_route` asks NVML and sends through host shared memory instead where it is missing.
"""

from __future__ import annotations

import ctypes
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


def cuda_ipc_route(sender_gpu: str, peerless: list[str] | None, ipc: bool | None,
                   shm_room: bool) -> tuple[Literal["cuda", "shm", "bytes"], str]:
    """How a sync that choose_kind sends by CUDA IPC travels, given the GPUs of this node that have
    no peer access to the sender's (`peerless`, from `gpus_without_peer_access`; None: NVML could not
    tell) -> (kind, a warning line, "" for none).

    Where some GPU lacks it, the sync falls back, with one warning, rather than stopping the run:
    `trainer.weight_sync_in_place=true` is the default and means "in place where this node allows
    it" (the same rule already sends bytes to receivers on other nodes, and when /dev/shm is too
    small); host shared memory is still in place and correct, only slower than GPU to GPU; and the
    check is conservative (the sender sees this node's GPUs, not which of them each receiver uses),
    so a stop could refuse a run that works. The fallback is shared memory (with ipc=True always:
    the caller asked for in place; with ipc=None where /dev/shm has room, else bytes over TCP).
    Where NVML cannot tell, CUDA IPC stays (a receiver that then fails to open a buffer says why:
    `import_buffer`)."""
    if not peerless:
        return "cuda", ""
    kind = "shm" if ipc or shm_room else "bytes"
    more = f" and {len(peerless) - 1} more GPU(s)" if len(peerless) > 1 else ""
    route = "from host shared memory" if kind == "shm" else "over TCP (/dev/shm has no room for the staging buffers)"
    return kind, (
        f"weight sync: {peerless[0]}{more} of this node cannot reach the sender's GPU {sender_gpu} by peer access, "
        f"which CUDA IPC between two GPUs needs: receivers on this node read the weights {route} instead, slower than "
        "GPU to GPU (trainer.weight_sync_in_place=false sends them over TCP and skips this check)"
    )


def gpus_without_peer_access(gpu_uuid: str) -> list[str] | None:
    """The other GPUs of this node that cannot read the GPU `gpu_uuid`'s memory by peer access, named
    "GPU <nvidia-smi index> (<uuid>)"; None where NVML cannot tell (no driver library, an error).

    NVML, not `torch.cuda.can_device_access_peer`: that takes device ordinals of this process, and
    Ray gives each actor its own CUDA_VISIBLE_DEVICES, so the trainer cannot see the servers' GPUs;
    NVML sees every GPU of the node. Called through ctypes as torch does (`torch.cuda.
    _raw_device_uuid_nvml`): the driver ships libnvidia-ml.so.1, pynvml may not be installed."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        gpus = []  # (index, uuid, handle)
        for index in range(count.value):
            handle, uuid = ctypes.c_void_p(), ctypes.create_string_buffer(96)
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0 or nvml.nvmlDeviceGetUUID(handle, uuid, 96) != 0:
                return None
            gpus.append((index, uuid.value.decode(), handle))
        ours = [handle for _, uuid, handle in gpus if _same_gpu(uuid, gpu_uuid)]
        if not ours:
            return None
        peerless = []
        for index, uuid, handle in gpus:
            if _same_gpu(uuid, gpu_uuid):
                continue
            status = ctypes.c_int(-1)
            # The receiver's GPU reads the sender's: NVML_P2P_CAPS_INDEX_READ (0); NVML_P2P_STATUS_OK is 0.
            if nvml.nvmlDeviceGetP2PStatus(handle, ours[0], 0, ctypes.byref(status)) != 0:
                return None
            if status.value != 0:
                peerless.append(f"GPU {index} ({uuid})")
        return peerless
    finally:
        nvml.nvmlShutdown()


def _same_gpu(a: str, b: str) -> bool:
    """NVML writes a UUID as 'GPU-<hex>', torch's device properties without the prefix."""
    return a.removeprefix("GPU-") == b.removeprefix("GPU-")


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
    index = local_device_index(handle.device_uuid)
    try:
        return rebuild_cuda_tensor(
            torch.Tensor, (handle.nbytes,), (1,), 0, _STORAGE_CLASSES[handle.storage_cls], torch.uint8,
            index, handle.storage_handle, handle.storage_size_bytes,
            handle.storage_offset_bytes, False, handle.ref_counter_handle, handle.ref_counter_offset,
            handle.event_handle, handle.event_sync_required,
        )
    except RuntimeError as exc:  # the sender's NVML check could not tell (or the driver disagrees with it)
        here = device_uuid(torch.device("cuda", index))
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RuntimeError(
            f"weight sync: this receiver (GPU {here}) could not open the sender's CUDA IPC buffer on GPU "
            f"{handle.device_uuid} ({first}); between two GPUs CUDA IPC needs peer access (`nvidia-smi topo -p2p r` "
            "shows it): set trainer.weight_sync_in_place=false"
        ) from exc



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
