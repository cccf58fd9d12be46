"""The weight-sync wire format: a bucket is one ZMQ message, a msgpack `BucketHeader` frame and
payload frames.

Buckets are of a fixed size: tensors are laid out at 64-byte aligned offsets of a bucket, and a
tensor larger than what is left of a bucket travels as consecutive pieces in consecutive buckets.
With `kind="bytes"` each piece is one payload frame (sent without a copy from the tensor, or from
the staging buffer a GPU tensor was copied to). On one node the bytes need not travel: with
`kind="cuda"` the one payload frame is a msgpack `CudaBuffer` (an IPC handle to the sender's GPU
staging buffer), with `kind="shm"` a `ShmBuffer` (the sender's shared-memory staging file), and
each piece sits at its offset in that buffer; receivers ack such a bucket when they are done with
it. The header's checksum covers what travels: the payload frames (the weights' bytes, or the
handle to them). Every hop verifies it before it forwards or loads the bucket.

A header names its sync by (version, attempt): a version sent again after a failed pass (a relay
chain a dead receiver broke) gets a higher attempt, so a receiver tells the buckets the first pass
left in its queue from the second pass's and drops them.

Over TCP a sync to several receivers is a chain: `route` lists every receiver in order, the sender
sends to `route[0]`, and the receiver at `route[hop]` forwards the same payload frames, with
`hop + 1` in the header, to `route[hop + 1]`. Direct fan-out (and every in-place sync: its
buckets are small headers) sends each receiver a header whose route is itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Literal

import msgspec
import torch
import xxhash

ALIGN = 64  # every piece starts at a multiple of this in its bucket, so any dtype can view it

DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}


class Piece(msgspec.Struct, array_like=True):
    """One tensor in a bucket, or a slice of the bytes of one too large for a bucket."""

    name: str
    dtype: str
    shape: list[int]
    offset: int  # where the piece starts in the bucket, a multiple of ALIGN (kind "cuda": in the shared buffer)
    nbytes: int  # bytes of this piece
    start: int  # where the piece starts in the tensor's bytes: 0 unless the tensor is split
    total: int  # bytes of the whole tensor


class CudaBuffer(msgspec.Struct, array_like=True):
    """A CUDA IPC handle to the sender's uint8 staging buffer: the arguments torch's
    `rebuild_cuda_tensor` needs, carried as plain fields (no pickle crosses the socket)."""

    device_uuid: str  # the sender's GPU; receivers map it to their own device index
    nbytes: int
    storage_cls: Literal["TypedStorage", "UntypedStorage"]
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


class ShmBuffer(msgspec.Struct, array_like=True):
    """The sender's shared-memory staging file and how many of its bytes this bucket fills."""

    path: str
    nbytes: int


class BucketHeader(msgspec.Struct, array_like=True):
    version: int
    index: int
    last: bool
    kind: Literal["bytes", "cuda", "shm"]
    checksum: int  # xxh3_64 of the payload frames in order
    pieces: list[Piece]
    route: list[str]  # receivers in chain order
    hop: int  # this frame is addressed to route[hop]
    origin: str  # the sender ("host pid N"), named in errors about the first hop
    ack_to: str = ""  # kinds "cuda", "shm": where receivers ack a bucket, so the sender may reuse its buffer
    attempt: int = 0  # which try at this version: a version sent again (a broken chain) gets a higher one

    def upstream(self) -> str:
        """Who sent this frame to route[hop]."""
        return self.route[self.hop - 1] if self.hop else f"the sender ({self.origin})"


class Ack(msgspec.Struct, array_like=True):
    """A receiver is done with an in-place bucket: the sender may overwrite that staging buffer."""

    version: int
    index: int
    address: str
    attempt: int = 0


encode = msgspec.msgpack.Encoder().encode
decode_header = msgspec.msgpack.Decoder(BucketHeader).decode
decode_cuda = msgspec.msgpack.Decoder(CudaBuffer).decode
decode_shm = msgspec.msgpack.Decoder(ShmBuffer).decode
decode_ack = msgspec.msgpack.Decoder(Ack).decode


def checksum(frames) -> int:
    """xxh3_64 of a sequence of buffers: about 29 GiB/s on this project's 2-core dev box, against
    5.9 for zlib.crc32 and 3.6 for zlib.adler32 (64 MiB buffers), so every hop can afford it."""
    h = xxhash.xxh3_64()
    for frame in frames:
        h.update(frame)
    return h.intdigest()


def align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


class WeightSyncError(RuntimeError):
    """A weight sync that failed at one bucket, as a value a driver can act on: the version, the
    bucket, the receiver addresses the failure points at, and what happened (`kind`):
    undelivered (a bucket could not be handed to `addresses`), no_ack (`addresses` did not confirm
    an in-place bucket), starved (the bucket never reached `addresses`: someone upstream failed),
    sender_gone, out_of_order, checksum."""

    def __init__(self, message: str, *, version: int, bucket: int, addresses: tuple[str, ...] = (), kind: str):
        super().__init__(message)
        self.version, self.bucket, self.addresses, self.kind = version, bucket, tuple(addresses), kind

    def __reduce__(self):  # survives pickling (Ray) with its fields
        return _rebuild, (type(self), str(self), self.version, self.bucket, self.addresses, self.kind)

    def fields(self) -> dict:
        """What another process needs to raise it again (across vLLM's worker RPC, which keeps only text)."""
        return {"message": str(self), "version": self.version, "bucket": self.bucket, "addresses": list(self.addresses), "kind": self.kind}

    @classmethod
    def from_fields(cls, fields: dict) -> "WeightSyncError":
        error_type = {"checksum": ChecksumError}.get(fields["kind"], WeightSyncTimeout if fields["kind"] in TIMEOUT_KINDS else WeightSyncError)
        return error_type(fields["message"], version=fields["version"], bucket=fields["bucket"], addresses=tuple(fields["addresses"]), kind=fields["kind"])


TIMEOUT_KINDS = ("undelivered", "no_ack", "starved", "sender_gone")


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A weight sync that ran out of time waiting on `addresses`."""


def _rebuild(cls, message, version, bucket, addresses, kind):
    return cls(message, version=version, bucket=bucket, addresses=addresses, kind=kind)


class ChecksumError(WeightSyncError):
    """A bucket's payload does not match its header's checksum: corrupted on the named hop."""


@dataclass(frozen=True)
class ServerSyncFailure:
    """One server's failed weight sync, as the driver saw it: why (one line), whether its actor
    died (or hung: the control plane restarts it), and the WeightSyncError it raised, if any."""

    reason: str
    actor_died: bool
    error: WeightSyncError | None = None
    hung: bool = False  # alive but never acked: the control plane restarts it (raytool.controlplane.ControlPlane.synced)


def chain_culprits(targets: dict[str, list[str]], failures: dict[str, ServerSyncFailure]) -> tuple[set[str], dict[str, list[str]]]:
    """Which failed servers broke the relay chain, and which only starved behind them.

    `targets`: server -> its receiver addresses in the chain; `failures`: the servers that failed.
    Culprits: a server whose actor died, or one at an address a forwarder could not deliver to
    (an `undelivered` error names it). The others failed because a culprit upstream starved them:
    returned as server -> addresses, to be synced again in a chain without the culprits."""
    culprits = {name for name, f in failures.items() if f.actor_died}
    undelivered = {a for f in failures.values() if f.error is not None and f.error.kind == "undelivered" for a in f.error.addresses}
    culprits |= {name for name in failures if undelivered & set(targets[name])}
    return culprits, {name: targets[name] for name in failures if name not in culprits}
