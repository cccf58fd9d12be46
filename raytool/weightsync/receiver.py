"""The rollout-server side of a weight sync: `WeightReceiver` takes buckets, verifies each, forwards
it down the chain, and yields its complete tensors.

A bucket is forwarded before it is yielded, so the next receiver has it while this one loads: the
buckets flow down the chain pipelined. Forwarding reuses the received payload frame (ZMQ shares it,
no copy); only the small header is re-encoded with the next hop.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import msgspec
import torch
import zmq

from raytool.weightsync import collective, same_node
from raytool.weightsync.protocol import (
    DTYPES, Ack, AttestationError, BucketHeader, ChecksumError, Piece, WeightSyncError, WeightSyncTimeout, align, combine, decode_cuda, decode_header,
    decode_shm, digest, encode,
)


class WeightReceiver:
    def __init__(self, host: str = "127.0.0.1"):
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._peers: dict[str, zmq.Socket] = {}  # PUSH sockets to successors and ack addresses
        self._segments: dict[str, torch.Tensor] = {}  # senders' shared-memory staging files, mapped
        # Where split tensors are joined, kept from sync to sync: a fresh 100 MB buffer per sync
        # costs its page faults again (measured: 50 ms of a 250 ms sync of SmolLM2-135M).
        self._joins: dict[tuple[str, str], torch.Tensor] = {}
        # The collective path's process groups: one per sender's store, its newest generation.
        self._groups: dict[tuple[str, int], collective.ReceiverGroup] = {}
        # The last complete sync: each piece with the digest of what arrived (the sender's, verified
        # bucket by bucket), and their combination, which the server reports as its attestation.
        self.manifest: list[tuple[Piece, int]] = []
        self.attestation = 0
        self.on_host = True  # the last sync's digests were taken on the host (not a device fingerprint)

    def receive(self, version: int, timeout_s: float = 120.0, attempt: int = 0) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yield the tensors of one sync, a bucket at a time, until the bucket marked last.

        A yielded bucket holds complete tensors only (the pieces of a split tensor are joined
        first). Its tensors are read-only views of the received frames, or, from a sender on this
        node, of its staging buffer (GPU or shared memory), valid until the next bucket is asked
        for: copy what you keep.
        Buckets of an earlier sync (an earlier version, or an earlier attempt at this one: left over
        from a sync that failed half-way) are dropped. `timeout_s` bounds the wait for each bucket
        and each forward to the next receiver."""
        expected = 0
        upstream = "upstream (no bucket of this sync has come yet: the sender or a receiver before this one is late or failed)"
        partial: dict[str, torch.Tensor] = {}  # split tensors being joined, as bytes
        seen: set[str] = set()  # shared-memory files this sync used
        manifest: list[tuple[Piece, int]] = []
        self.manifest, self.attestation = [], 0
        while True:
            if not self._sock.poll(int(timeout_s * 1000)):
                raise WeightSyncTimeout(
                    f"weight sync v{version}: bucket {expected} did not reach {self.address} within "
                    f"{timeout_s:g}s; it was to come from {upstream}", version=version, bucket=expected, addresses=(self.address,), kind="starved",
                )
            header_frame, *payload = self._sock.recv_multipart(copy=False)
            header = decode_header(header_frame.bytes)
            if (header.version, header.attempt) < (version, attempt):
                continue  # left over from a sync that failed half-way: drop it
            if (header.version, header.attempt) != (version, attempt) or header.index != expected:
                raise WeightSyncError(
                    f"weight sync: expected v{version} (attempt {attempt}) bucket {expected}, got v{header.version} "
                    f"(attempt {header.attempt}) bucket {header.index} "
                    f"from {header.upstream()}", version=version, bucket=expected, addresses=(self.address,), kind="out_of_order",
                )
            upstream = header.upstream()
            shared = self._shared_buffer(header, payload, seen, timeout_s)  # None for kind "bytes"
            if shared is None:
                chunks = [_frame_bytes(frame) for frame in payload]
            else:
                chunks = [shared[p.offset : p.offset + p.nbytes] for p in header.pieces]
            digests = [digest(chunk) for chunk in chunks]
            handle = payload[0].bytes if header.kind in ("cuda", "shm") else b""
            if combine(digests, handle) != header.checksum:
                raise ChecksumError(
                    f"weight sync v{version}: bucket {header.index} failed its checksum on the hop {upstream} -> "
                    f"{self.address}{_first_difference(header, digests)}: its bytes changed on the way; sync again, and check "
                    "that link if it repeats", version=version, bucket=header.index, addresses=(self.address,), kind="checksum",
                )
            manifest.extend(zip(header.pieces, digests))
            self.on_host = not chunks or chunks[0].device.type == "cpu"
            self._forward(header, payload, timeout_s)
            yield _complete_tensors(header.pieces, chunks, partial, self._joins)
            if shared is not None:
                del shared, chunks  # done with the sender's buffer: it may refill it
                self._ack(header, timeout_s)
            if header.last:
                if partial:
                    raise WeightSyncError(f"weight sync v{version}: the last bucket came before the rest of {', '.join(partial)}",
                                          version=version, bucket=header.index, addresses=(self.address,), kind="out_of_order")
                self._segments = {path: buf for path, buf in self._segments.items() if path in seen}  # a new sender's files replace an old one's
                self.manifest, self.attestation = manifest, combine([d for _, d in manifest])
                return
            expected += 1

    def _shared_buffer(self, header: BucketHeader, payload: list[zmq.Frame], seen: set[str], timeout_s: float) -> torch.Tensor | None:
        """The part of the sender's staging buffer an in-place bucket fills (shared-memory files
        are mapped once and kept; `seen` collects them), or the bytes a collective bucket's
        broadcast brought; None for bytes in the frames."""
        if header.kind == "collective":
            return self._broadcast(header, timeout_s)
        if header.kind == "cuda":
            return same_node.import_buffer(decode_cuda(payload[0].bytes))
        if header.kind == "shm":
            shm = decode_shm(payload[0].bytes)
            if shm.path not in self._segments:
                self._segments[shm.path] = same_node.open_segment(shm.path)
            seen.add(shm.path)
            return self._segments[shm.path][: shm.nbytes]
        return None

    def _broadcast(self, header: BucketHeader, timeout_s: float) -> torch.Tensor:
        """Join the header's group (once per generation) and take the bucket's broadcast."""
        spec = header.group
        nbytes = align(max((p.offset + p.nbytes for p in header.pieces), default=0))
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8)
        store = (spec.host, spec.port)
        try:
            group = self._groups.get(store)
            if group is None or not group.matches(spec):
                if group is not None:
                    self._groups.pop(store).close()
                group = self._groups[store] = collective.ReceiverGroup(spec, collective.receiver_device(spec.backend))
            return group.receive(nbytes, timeout_s)
        except (RuntimeError, ValueError) as exc:  # gloo/NCCL and the store's words: the group is dropped, the next sync makes another
            if store in self._groups:
                self._groups.pop(store).close()
            raise WeightSyncTimeout(
                f"weight sync v{header.version}: bucket {header.index} did not reach {self.address} by the {spec.backend} group "
                f"(generation {spec.generation}) within {timeout_s:g}s: {str(exc).splitlines()[0][:300]}",
                version=header.version, bucket=header.index, addresses=(self.address,), kind="starved",
            ) from None

    def _forward(self, header: BucketHeader, payload: list[zmq.Frame], timeout_s: float) -> None:
        """Pass the bucket to the next receiver of the chain, if there is one."""
        if header.hop + 1 >= len(header.route):
            return
        successor = header.route[header.hop + 1]
        sock = self._peer(successor, timeout_s)
        try:
            sock.send_multipart([encode(msgspec.structs.replace(header, hop=header.hop + 1)), *payload], copy=False)
        except zmq.Again:
            raise WeightSyncTimeout(
                f"weight sync v{header.version}: could not deliver bucket {header.index} to {successor} within "
                f"{timeout_s:g}s (forwarding from {self.address}): that receiver is down, not listening, or not "
                "reading; check its server", version=header.version, bucket=header.index, addresses=(successor,), kind="undelivered",
            ) from None

    def _ack(self, header: BucketHeader, timeout_s: float) -> None:
        try:
            self._peer(header.ack_to, timeout_s).send(encode(Ack(header.version, header.index, self.address, header.attempt)))
        except zmq.Again:
            raise WeightSyncTimeout(
                f"weight sync v{header.version}: the sender's ack socket {header.ack_to} did not take the ack "
                f"of bucket {header.index} within {timeout_s:g}s (the sender is gone?)",
                version=header.version, bucket=header.index, kind="sender_gone",
            ) from None

    def _peer(self, address: str, timeout_s: float) -> zmq.Socket:
        """A cached PUSH socket to a successor or an ack address."""
        sock = self._peers.get(address)
        if sock is None:
            sock = self._peers[address] = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only on a live connection, so a dead peer times out
            sock.connect(address)
        sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        return sock

    def close(self) -> None:
        self._sock.close(linger=0)
        for sock in self._peers.values():
            sock.close(linger=0)
        self._peers.clear()
        self._segments.clear()
        for group in self._groups.values():
            group.close()
        self._groups.clear()


def _first_difference(header: BucketHeader, digests: list[int]) -> str:
    """' (first at tensor NAME)' where a piece's digest differs from the sender's, '' if none does."""
    for piece, ours, theirs in zip(header.pieces, digests, header.digests):
        if ours != theirs:
            return f" (first at tensor {piece.name}, bytes {piece.start}-{piece.start + piece.nbytes})"
    return ""


def verify_loaded(manifest: list[tuple[Piece, int]], loaded: dict[str, torch.Tensor], version: int, on_host: bool = True) -> None:
    """Raise AttestationError naming the first tensor whose bytes in the engine (`loaded`: name ->
    the engine's tensor of that name, cast to the dtype it was sent in) differ from what the trainer
    sent (`manifest`: a receiver's last sync). `on_host`: the sync's digests were taken on the host
    (every path but CUDA IPC and NCCL/HCCL, whose digests are the device's `fingerprint`). The
    rollout server adds its own name to the error (actors.rollout_server)."""
    for piece, sent in manifest:
        tensor = loaded.get(piece.name)
        if tensor is None:
            raise AttestationError(f"weight sync v{version}: the engine holds no tensor '{piece.name}', which the trainer sent",
                                   version=version, bucket=-1, kind="attestation")
        data = tensor.detach().to(DTYPES[piece.dtype]).contiguous().reshape(-1).view(torch.uint8)
        if on_host:
            data = data.cpu()
        if digest(data[piece.start : piece.start + piece.nbytes]) != sent:
            raise AttestationError(
                f"weight sync v{version}: the engine loaded '{piece.name}' (bytes {piece.start}-{piece.start + piece.nbytes}) "
                "differently from what the trainer sent: its digest differs; the server serves nothing of this version",
                version=version, bucket=-1, kind="attestation",
            )


def _frame_bytes(frame: zmq.Frame) -> torch.Tensor:
    if not len(frame.buffer):
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # the frame is read-only; callers copy what they keep
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(frame.buffer, dtype=torch.uint8)


def _complete_tensors(pieces: list[Piece], chunks: list[torch.Tensor], partial: dict[str, torch.Tensor],
                      joins: dict[tuple[str, str], torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The bucket's whole tensors, as views of their chunks; pieces of split ones are copied into
    `partial` (buffers taken from `joins`, reused by the next sync) and come out with the bucket
    that completes them."""
    out = []
    for p, chunk in zip(pieces, chunks, strict=True):
        if p.nbytes == p.total:
            whole = chunk
        else:
            joined = partial.get(p.name)
            if joined is None:
                key = (p.name, str(chunk.device))
                joined = joins.get(key)
                if joined is None or joined.numel() != p.total:
                    joined = joins[key] = torch.empty(p.total, dtype=torch.uint8, device=chunk.device)
                partial[p.name] = joined
            joined[p.start : p.start + p.nbytes].copy_(chunk)
            if p.start + p.nbytes < p.total:
                continue
            whole = partial.pop(p.name)
        out.append((p.name, whole.view(DTYPES[p.dtype]).reshape(p.shape)))
    return out
