"""The trainer side of a weight sync: `WeightSender` lays (name, tensor) pairs out in fixed-size
buckets and streams them to the rollout servers' receivers.

Two threads share the work so that they overlap: the caller's thread iterates the tensors (the
trainer's all-gather happens there) and packs a bucket, while a sender thread checksums and sends
the one before. Over TCP, GPU tensors are copied into one of two page-locked staging buffers and
CPU tensors are sent from their own memory, with no copy (on a 2-core box a staging copy costs a
third of the throughput: loopback TCP is memory-bound). To receivers on this node the tensors are
copied into one of two staging buffers the receivers read in place (GPU memory shared by CUDA IPC,
or a shared-memory file). Copies from an accelerator (CUDA, Ascend NPU) are only queued on its
stream; the sender thread waits for them (`copy_fence`) before it reads a bucket. At most two
buckets are in flight: a bucket's buffer (or the tensors it points into) is released only once ZMQ
has handed its bytes to the kernel, or, read in place, once every receiver acked it, so a slow
receiver slows the packing down instead of growing memory.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
import zmq

from raytool.weightsync import collective, same_node
from raytool.weightsync.links import DOWN_AFTER_S, WatchedPeers
from raytool.weightsync.protocol import DTYPES, Ack, BucketHeader, Piece, ShmBuffer, WeightSyncTimeout, align, combine, decode_ack, digest, encode

log = logging.getLogger(__name__)

_STAGING = 2  # buffers: one being filled while the other is on the wire
_POLL_S = 0.1  # how often a blocked thread looks whether the other one failed


@dataclass
class _Bucket:
    """A packed bucket on its way to the sender thread."""

    index: int
    last: bool
    buffer: torch.Tensor | None  # the staging buffer, None where the frames are the tensors' own memory
    used: int  # bytes of the bucket's layout, the last piece's end
    pieces: list[Piece]
    frames: list[torch.Tensor]  # kind "bytes": one uint8 tensor per piece
    copied: object | None = None  # copy_fence's event: the device's copies into `buffer` are done when it fires
    waits: list = field(default_factory=list)  # (address, ZMQ tracker) to wait on before reuse


class WeightSender:
    """Streams one sync per `send()` to `addresses`.

    fanout="chain" (default) sends each bucket once, to the first receiver, which forwards it down
    the chain before loading it: the trainer's bandwidth is spent once however many servers there
    are. fanout="direct" sends every bucket to every receiver.
    ipc: True lets receivers read the weights in place (every receiver on this node): a CUDA IPC
    handle for GPU weights (a shared-memory file where some GPU of this node has no peer access
    to the sender's: same_node.cuda_ipc_route), a shared-memory file for others (CPU, NPU); None
    does so when every receiver host is this node (loopback, `node_ip`, or what this host name
    resolves to: pass Ray's node IP) and, for a shared-memory file, /dev/shm has room; False always
    sends bytes over TCP. Read in place, send() returns once every receiver has taken every
    bucket (it waits for their acks).
    backend="collective" broadcasts each bucket's bytes in a process group of the sender and the
    receivers instead (raytool.weightsync.collective: gloo, NCCL or HCCL by where the weights are),
    with headers and acks on ZMQ; `ipc` and `fanout` do not apply. The group is kept from sync to
    sync and made again after a sync that failed.
    Every send returns the sync's attestation: the combined digest of every piece it sent.
    """

    def __init__(
        self,
        addresses: list[str],
        bucket_bytes: int = 64 << 20,
        send_timeout_s: float = 120.0,
        *,
        fanout: Literal["chain", "direct"] = "chain",
        ipc: bool | None = None,
        node_ip: str | None = None,
        down_after_s: float = DOWN_AFTER_S,
        backend: Literal["zmq", "collective"] = "zmq",
    ):
        if not addresses:
            raise ValueError("WeightSender needs at least one receiver address")
        if fanout not in ("chain", "direct"):
            raise ValueError(f"fanout must be 'chain' or 'direct', not '{fanout}'")
        if backend not in ("zmq", "collective"):
            raise ValueError(f"backend must be 'zmq' or 'collective', not '{backend}'")
        if bucket_bytes < 1 << 10:
            raise ValueError(f"bucket_bytes={bucket_bytes}: use at least 1 KiB (64 MiB is the default)")
        self.addresses = list(addresses)
        self.bucket_bytes = align(bucket_bytes)
        self.send_timeout_s = send_timeout_s
        self.fanout = fanout
        self.ipc = ipc
        self.node_ip = node_ip
        self.backend = backend
        self.host = node_ip or "127.0.0.1"  # where receivers reach this sender (acks, a collective group's store)
        self.origin = f"{socket.gethostname()} pid {os.getpid()}"
        self._ctx = zmq.Context.instance()
        # A receiver whose connection stays down for down_after_s is gone: named then, not at the timeout.
        self._peers = WatchedPeers(self._ctx, send_timeout_s, down_after_s)
        self._staging: dict[tuple[str, str], list[torch.Tensor]] = {}
        self._shm_paths: dict[int, str] = {}  # data_ptr of a shared-memory staging buffer -> its file
        self._cuda_routes: dict[str, str] = {}  # GPU -> how its syncs go where CUDA IPC would (same_node.cuda_ipc_route)
        self._acks: zmq.Socket | None = None
        self._ack_address = ""
        self._attempt = 0  # of the send in progress
        self._digests: list[int] = []  # of the send in progress: each piece's, in order
        self._group: collective.SenderGroup | None = None
        self._acked: dict[int, set[str]] = {}  # of the send in progress: bucket index -> receivers that acked it
        self._generations = itertools.count()

    # --- the caller's thread: packing -------------------------------------------------------

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, attempt: int = 0) -> dict:
        """Stream every tensor to every receiver; returns bytes, buckets and seconds. Raises
        WeightSyncTimeout naming the receiver that did not take a bucket in time. `attempt` tells a
        second try at a version from the first (the receivers were told the same)."""
        start = time.perf_counter()
        self._attempt, self._digests = attempt, []
        tensors = iter(named_tensors)
        first = next(tensors, None)
        tensors = itertools.chain([first], tensors) if first is not None else iter(())
        device = first[1].device if first is not None else torch.device("cpu")
        if self.backend == "collective":
            kind = "collective"
            if self._group is None:
                self._group = collective.SenderGroup(self.host, self.addresses, collective.backend_for(device.type),
                                                     self.send_timeout_s, next(self._generations), self._peers.down_after_s)
        else:
            kind = same_node.choose_kind(first[1] if first else None, self.addresses, self.node_ip, self.ipc, _STAGING * self.bucket_bytes)
        if kind == "cuda":
            kind = self._cuda_ipc_route(device)
        free = self._staging_buffers(device, kind)
        pending: queue.Queue[_Bucket | None] = queue.Queue(maxsize=_STAGING)
        failure: list[BaseException] = []
        thread = threading.Thread(
            target=self._sender_loop, args=(version, kind, pending, free, failure), name="weight-sender", daemon=True
        )
        thread.start()
        try:
            try:
                buckets, sent = self._pack(tensors, device, free, pending, failure)
            except BaseException:
                sender_failed = bool(failure)  # then the packer only saw its effect
                _put(pending, None, failure, thread)
                thread.join()
                if sender_failed:
                    raise failure[0] from None
                raise
            _put(pending, None, failure, thread)
            thread.join()
            if failure:
                raise failure[0]
        except BaseException:
            self._drop_group()  # a group a sync failed in is never reused
            raise
        seconds = time.perf_counter() - start
        log.debug("weights v%d: %d buckets, %.1f MB in %.2fs (%s, %s)", version, buckets, sent / 1e6, seconds, self.fanout, kind)
        return {"bytes": sent, "buckets": buckets, "seconds": seconds, "fanout": self.fanout, "kind": kind,
                "attestation": combine(self._digests)}

    def _drop_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def _cuda_ipc_route(self, device: torch.device) -> str:
        """CUDA IPC, or host shared memory (bytes where /dev/shm is small) where a GPU of this node
        has no peer access to `device`: asked of NVML once per device, before its first in-place sync."""
        key = str(device)
        if key not in self._cuda_routes:
            uuid = same_node.device_uuid(device)
            kind, warning = same_node.cuda_ipc_route(
                f"{device} (GPU-{uuid.removeprefix('GPU-')})", same_node.gpus_without_peer_access(uuid), self.ipc,
                same_node.shm_has_room(_STAGING * self.bucket_bytes),
            )
            if warning:
                log.warning("%s", warning)
            self._cuda_routes[key] = kind
        return self._cuda_routes[key]

    def _pack(self, tensors: Iterator, device: torch.device, free: queue.Queue, pending: queue.Queue, failure: list) -> tuple[int, int]:
        """Lay tensors out in buckets, splitting those larger than what a bucket has left, and
        hand each bucket to the sender thread. Returns (buckets, payload bytes)."""
        size = self.bucket_bytes
        index = sent = used = 0
        pieces: list[Piece] = []
        frames: list[torch.Tensor] = []
        buffer = _get(free, failure)

        def flush(last: bool) -> None:
            nonlocal index, used, pieces, frames, buffer
            copied = copy_fence(device) if buffer is not None else None
            _put(pending, _Bucket(index, last, buffer, used, pieces, frames, copied), failure)
            index, used, pieces, frames = index + 1, 0, [], []
            if not last:
                buffer = _get(free, failure)

        for name, tensor in tensors:
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in DTYPES:
                raise TypeError(f"weight '{name}' has dtype {tensor.dtype}, which weight sync does not carry ({', '.join(DTYPES)})")
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            if buffer is None and flat.device.type != "cpu":
                flat = flat.cpu()  # an accelerator's tensor in a sync that began with CPU ones (waits for the copy)
            total, done = flat.numel(), 0
            if pieces and total <= size and align(used) + total > size:
                flush(False)  # it fits a bucket of its own: do not split it
            while True:
                used = min(align(used), size)
                if used == size:
                    flush(False)
                take = min(total - done, size - used)
                chunk = flat[done : done + take]
                if buffer is not None:
                    buffer[used : used + take].copy_(chunk, non_blocking=True)
                    chunk = buffer[used : used + take]
                pieces.append(Piece(name, dtype, list(tensor.shape), used, take, done, total))
                frames.append(chunk)
                used, done, sent = used + take, done + take, sent + take
                if done == total:
                    break
        flush(True)
        return index, sent

    def _staging_buffers(self, device: torch.device, kind: str) -> queue.Queue:
        """What the packer fills, one per bucket in flight. Staging buffers are allocated on first
        use and kept: GPU memory (kind "cuda") or a shared-memory file ("shm") that receivers
        read in place, page-locked host memory for an accelerator's weights (GPU, NPU) sent as
        bytes. CPU weights sent as bytes need none (None: the frames are the tensors themselves)."""
        if kind == "bytes" and device.type == "cpu":
            buffers = [None] * _STAGING
        else:
            key = (str(device), kind)
            if key not in self._staging:
                self._staging[key] = [self._new_staging(device, kind) for _ in range(_STAGING)]
            buffers = self._staging[key]
        free: queue.Queue[torch.Tensor | None] = queue.Queue()
        for buffer in buffers:
            free.put(buffer)
        return free

    def _new_staging(self, device: torch.device, kind: str) -> torch.Tensor:
        if kind == "cuda" or kind == "collective":  # a collective's bytes go from where the weights are
            return torch.empty(self.bucket_bytes, dtype=torch.uint8, device=device)
        if kind == "shm":
            path, buffer = same_node.create_segment(self.bucket_bytes)
            self._shm_paths[buffer.data_ptr()] = path
            return buffer
        return torch.empty(self.bucket_bytes, dtype=torch.uint8, pin_memory=True)

    # --- the sender thread ------------------------------------------------------------------

    def _sender_loop(self, version: int, kind: str, pending: queue.Queue, free: queue.Queue, failure: list) -> None:
        """Send buckets as they come; return a buffer to `free` once it may be refilled. The
        newest bucket stays in flight while the next one is checksummed and queued, so the
        wire never waits on this thread."""
        in_flight: list[_Bucket] = []
        acked = self._acked = {}
        try:
            while (bucket := pending.get()) is not None:
                self._deliver(version, bucket, kind)
                in_flight.append(bucket)
                while len(in_flight) > 1:
                    self._release(version, in_flight.pop(0), kind, free, acked)
            for bucket in in_flight:
                self._release(version, bucket, kind, free, acked)
        except BaseException as exc:  # surfaced by send() in the caller's thread
            failure.append(exc)

    def _deliver(self, version: int, bucket: _Bucket, kind: str) -> None:
        if bucket.copied is not None:
            bucket.copied.synchronize()  # the bytes are in the buffer before anyone reads it (digests, wire, handle)
        if kind == "bytes":
            chunks = bucket.frames
            payload = [memoryview(frame.numpy()) for frame in bucket.frames]
            handle = b""
        elif kind == "collective":  # the bytes go by the group's broadcast, after the headers
            chunks, payload, handle = [bucket.buffer[p.offset : p.offset + p.nbytes] for p in bucket.pieces], [], b""
        else:
            # Read in place, no weight bytes travel, only the handle (the receivers read the buffer
            # only between our send and their ack, so nothing overwrites it under them).
            shared = ShmBuffer(self._shm_paths[bucket.buffer.data_ptr()], bucket.used) if kind == "shm" else same_node.export_buffer(bucket.buffer)
            handle = encode(shared)
            chunks, payload = [bucket.buffer[p.offset : p.offset + p.nbytes] for p in bucket.pieces], [handle]
        digests = [digest(chunk) for chunk in chunks]  # where the bytes are: the host, or the device's fingerprint
        self._digests.extend(digests)
        # Read in place or broadcast, a bucket is a small header: every receiver gets its own (a
        # chain would only let one dead receiver starve the ones after it).
        routes = [self.addresses] if self.fanout == "chain" and kind == "bytes" else [[a] for a in self.addresses]
        header = BucketHeader(
            version, bucket.index, bucket.last, kind, combine(digests, handle), bucket.pieces, [], 0, self.origin,
            self._ack_socket() if kind != "bytes" else "", self._attempt, digests,
        )
        for route in routes:
            header.route = route
            if kind == "collective":
                header.group = self._group.spec(route[0])
            sock = self._peers.socket(route[0])
            deadline = time.monotonic() + self.send_timeout_s
            while not sock.poll(int(_POLL_S * 1000), zmq.POLLOUT):  # no live connection to queue on yet
                self._check_alive(version, bucket.index, [route[0]])
                if time.monotonic() > deadline:
                    raise self._undelivered(version, bucket.index, route[0])
            try:
                tracker = sock.send_multipart([encode(header), *payload], copy=False, track=True)
            except zmq.Again:
                raise self._undelivered(version, bucket.index, route[0]) from None
            bucket.waits.append((route[0], tracker))
        nbytes = align(bucket.used)
        if kind == "collective" and nbytes:
            def check() -> None:
                self._check_alive(version, bucket.index, self.addresses)

            self._group.join(version, bucket.index, check)
            try:
                self._group.broadcast(bucket.buffer[:nbytes], version, bucket.index, check)
            except WeightSyncTimeout as exc:
                if exc.kind != "no_ack":
                    raise
                # Stuck in the broadcast: the receivers that took the bucket ack it once loaded; name the others.
                missing = sorted(self._missing_acks(version, bucket.index, self._acked, time.monotonic() + self._peers.down_after_s + 1.0))
                raise WeightSyncTimeout(
                    f"weight sync v{version}: no ack for bucket {bucket.index} from {', '.join(missing or self.addresses)} within "
                    f"{self.send_timeout_s:g}s: the {self._group.backend} broadcast of it did not complete (that receiver is stuck)",
                    version=version, bucket=bucket.index, addresses=tuple(missing or self.addresses), kind="no_ack",
                ) from None

    def _release(self, version: int, bucket: _Bucket, kind: str, free: queue.Queue, acked: dict[int, set[str]]) -> None:
        """Wait until the bucket's buffer may be refilled, then hand it back to the packer."""
        for address, tracker in bucket.waits:
            deadline = time.monotonic() + self.send_timeout_s
            while True:
                try:
                    tracker.wait(_POLL_S)
                    break
                except zmq.NotDone:
                    self._check_alive(version, bucket.index, [address])
                    if time.monotonic() > deadline:
                        raise self._undelivered(version, bucket.index, address) from None
        if kind != "bytes":
            self._wait_acks(version, bucket.index, acked)
        bucket.frames.clear()  # the tensors may go now
        free.put(bucket.buffer)

    def _wait_acks(self, version: int, index: int, acked: dict[int, set[str]]) -> None:
        """Every receiver reads an in-place bucket from our buffer (or a collective one from its
        own): wait for all of them."""
        if waiting := self._missing_acks(version, index, acked, time.monotonic() + self.send_timeout_s):
            raise WeightSyncTimeout(
                f"weight sync v{version}: no ack for bucket {index} from {', '.join(sorted(waiting))} "
                f"within {self.send_timeout_s:g}s (that receiver failed to load it or is stuck)",
                version=version, bucket=index, addresses=tuple(sorted(waiting)), kind="no_ack",
            )
        acked.pop(index)

    def _missing_acks(self, version: int, index: int, acked: dict[int, set[str]], deadline: float) -> set[str]:
        """The receivers that have not acked bucket `index` by `deadline`. Acks of later buckets
        that come meanwhile are kept in `acked` (bucket index -> receivers)."""
        while (waiting := set(self.addresses) - acked.get(index, set())):
            left = deadline - time.monotonic()
            if left <= 0:
                return waiting
            if not self._acks.poll(int(min(left, _POLL_S) * 1000)):
                self._check_alive(version, index, waiting)
                continue
            ack: Ack = decode_ack(self._acks.recv())
            if (ack.version, ack.attempt) == (version, self._attempt):  # an older one is left over from a sync that failed
                acked.setdefault(ack.index, set()).add(ack.address)
        return set()

    def _undelivered(self, version: int, index: int, address: str) -> WeightSyncTimeout:
        return WeightSyncTimeout(
            f"weight sync v{version}: could not deliver bucket {index} to {address} within "
            f"{self.send_timeout_s:g}s (from the sender {self.origin}): that receiver is down, not "
            "listening, or not reading; check its server", version=version, bucket=index, addresses=(address,), kind="undelivered",
        )

    def _check_alive(self, version: int, index: int, addresses) -> None:
        """Raise for the first of `addresses` whose connection has been down for a while: that
        receiver is gone (see raytool.weightsync.links), waiting longer would not help."""
        for address in self._peers.dead(sorted(addresses)):
            raise WeightSyncTimeout(
                f"weight sync v{version}: could not deliver bucket {index} to {address}: its connection has been down for "
                f"{self._peers.down_for(address):.0f}s (from the sender {self.origin}): that receiver is gone; check its server",
                version=version, bucket=index, addresses=(address,), kind="undelivered",
            )

    def _ack_socket(self) -> str:
        """The address receivers ack in-place and collective buckets to (bound once)."""
        if self._acks is None:
            self._acks = self._ctx.socket(zmq.PULL)
            self._acks.setsockopt(zmq.LINGER, 0)
            port = self._acks.bind_to_random_port(f"tcp://{self.host}")
            self._ack_address = f"tcp://{self.host}:{port}"
        return self._ack_address

    def close(self) -> None:
        self._drop_group()
        self._peers.close()
        if self._acks is not None:
            self._acks.close(linger=0)
            self._acks = None
        self._staging.clear()
        for path in self._shm_paths.values():
            same_node.remove_segment(path)
        self._shm_paths.clear()


def copy_fence(device: torch.device):
    """An event recorded on `device`'s current stream after the copies queued there, whose
    `synchronize()` returns once they are done; None for a CPU device (a copy from CPU memory is
    done when `copy_` returns). `copy_(..., non_blocking=True)` from an accelerator only queues the
    copy, on the current stream of the accelerator's device, so the bytes may land after the
    sender thread has checksummed and sent the bucket without this.

    The event comes from the device type's torch module: `torch.cuda`, and `torch.npu`, which
    torch_npu registers with the same `Event` / `current_stream` API (any accelerator whose module
    has both works). Not torch >= 2.4's device-generic `torch.Event`: its `synchronize()` goes
    through the backend's device guard, whose default refuses ("Backend doesn't support
    synchronizing events") and which torch_npu's NPUGuardImpl does not override."""
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type, None)
    if module is None or not hasattr(module, "Event") or not hasattr(module, "current_stream"):
        raise RuntimeError(
            f"weight sync: the weights are on a '{device.type}' device, but torch.{device.type} has no Event and "
            f"current_stream to wait for their copies with (for an Ascend NPU, import torch_npu first)"
        )
    event = module.Event()
    event.record(module.current_stream(device))
    return event


def _put(q: queue.Queue, item, failure: list, thread: threading.Thread | None = None) -> None:
    """Put into a bounded queue unless the sender thread failed (then it reads no more)."""
    while True:
        if failure or (thread is not None and not thread.is_alive()):
            if failure and item is not None:
                raise failure[0]
            return
        try:
            q.put(item, timeout=_POLL_S)
            return
        except queue.Full:
            continue


def _get(free: queue.Queue, failure: list) -> torch.Tensor:
    """A staging buffer to fill, unless the sender thread failed."""
    while True:
        if failure:
            raise failure[0]
        try:
            return free.get(timeout=_POLL_S)
        except queue.Empty:
            continue
