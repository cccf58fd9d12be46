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

from raytool.weightsync import same_node
from raytool.weightsync.protocol import (
    DTYPES, Ack, BucketHeader, ChecksumError, Piece, WeightSyncError, WeightSyncTimeout, checksum, decode_cuda, decode_header, decode_shm, encode,
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
            shared = self._shared_buffer(header, payload, seen)  # None for kind "bytes"
            read = [frame.buffer for frame in payload]  # the weights' bytes, or the handle to them (read in place)
            if checksum(read) != header.checksum:
                raise ChecksumError(
                    f"weight sync v{version}: bucket {header.index} failed its checksum on the hop {upstream} -> "
                    f"{self.address}: its bytes changed on the way; sync again, and check that link if it repeats",
                    version=version, bucket=header.index, addresses=(self.address,), kind="checksum",
                )
            self._forward(header, payload, timeout_s)
            if shared is None:
                chunks = [_frame_bytes(frame) for frame in payload]
            else:
                chunks = [shared[p.offset : p.offset + p.nbytes] for p in header.pieces]
            del read
            yield _complete_tensors(header.pieces, chunks, partial, self._joins)
            if shared is not None:
                del shared, chunks  # done with the sender's buffer: it may refill it
                self._ack(header, timeout_s)
            if header.last:
                if partial:
                    raise WeightSyncError(f"weight sync v{version}: the last bucket came before the rest of {', '.join(partial)}",
                                          version=version, bucket=header.index, addresses=(self.address,), kind="out_of_order")
                self._segments = {path: buf for path, buf in self._segments.items() if path in seen}  # a new sender's files replace an old one's
                return
            expected += 1

    def _shared_buffer(self, header: BucketHeader, payload: list[zmq.Frame], seen: set[str]) -> torch.Tensor | None:
        """The part of the sender's staging buffer an in-place bucket fills (shared-memory files
        are mapped once and kept; `seen` collects them)."""
        if header.kind == "cuda":
            return same_node.import_buffer(decode_cuda(payload[0].bytes))
        if header.kind == "shm":
            shm = decode_shm(payload[0].bytes)
            if shm.path not in self._segments:
                self._segments[shm.path] = same_node.open_segment(shm.path)
            seen.add(shm.path)
            return self._segments[shm.path][: shm.nbytes]
        return None

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
