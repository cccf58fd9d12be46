"""The weight-sync wire format: a bucket is one ZMQ message, a msgpack `BucketHeader` frame and
payload frames.

Buckets are of a fixed size: tensors are laid out at 64-byte aligned offsets of a bucket, and a
tensor larger than what is left of a bucket travels as consecutive pieces in consecutive buckets.
With `kind="bytes"` each piece is one payload frame (sent without a copy from the tensor, or from
the staging buffer a GPU tensor was copied to). On one node the bytes need not travel: with
`kind="cuda"` the one payload frame is a msgpack `CudaBuffer` (an IPC handle to the sender's GPU
staging buffer), with `kind="shm"` a `ShmBuffer` (the sender's shared-memory staging file), and
each piece sits at its offset in that buffer; receivers ack such a bucket when they are done with
it. With `kind="collective"` (trainer.weight_sync_backend=collective) there is no payload frame:
the bucket's bytes come by a broadcast in a process group of the sender and every receiver
(raytool.weightsync.collective), which the header's `group` names, and receivers ack it too.

Every piece has a digest (`digest`: xxh3_64 of its bytes on the host, `fingerprint` on an
accelerator), computed by the sender where the bytes already are, and listed in the header. The
header's checksum is the digest of those digests (and of the handle, read in place): every hop
computes the pieces' digests of what it got, so a changed byte is named by its tensor, before the
bucket is forwarded or loaded. The digests of a whole sync, combined, are its attestation: each
server reports the one it verified, the control plane compares it with the one the trainer sent.

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
import numpy as np
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


class GroupSpec(msgspec.Struct, array_like=True):
    """Where a collective sync's process group meets: the sender's store, the group's generation
    (a new one after a failed sync), its size (the sender and its receivers) and the receiver's rank."""

    host: str
    port: int
    generation: int
    size: int
    rank: int
    backend: Literal["gloo", "nccl", "hccl"]
    timeout_s: float


class BucketHeader(msgspec.Struct, array_like=True):
    version: int
    index: int
    last: bool
    kind: Literal["bytes", "cuda", "shm", "collective"]
    checksum: int  # `combine` of the pieces' digests (after the handle's digest, read in place)
    pieces: list[Piece]
    route: list[str]  # receivers in chain order
    hop: int  # this frame is addressed to route[hop]
    origin: str  # the sender ("host pid N"), named in errors about the first hop
    ack_to: str = ""  # kinds "cuda", "shm": where receivers ack a bucket, so the sender may reuse its buffer
    attempt: int = 0  # which try at this version: a version sent again (a broken chain) gets a higher one
    digests: list[int] = []  # each piece's digest, in the order of `pieces`
    group: GroupSpec | None = None  # kind "collective": the process group the bytes are broadcast in

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


def digest(chunk: torch.Tensor) -> int:
    """A piece's digest, computed where its bytes are: xxh3_64 on the host, `fingerprint` on an
    accelerator (no copy to the host). `chunk`: a 1-D uint8 tensor. xxh3_64 runs at about 29 GiB/s
    on this project's 2-core dev box, against 5.9 for zlib.crc32 and 3.6 for zlib.adler32 (64 MiB
    buffers), so every hop can afford it."""
    if chunk.device.type != "cpu":
        return fingerprint(chunk)
    if not chunk.numel():
        return xxhash.xxh3_64_intdigest(b"")
    return xxhash.xxh3_64_intdigest(memoryview(chunk.numpy()))


_MASK = (1 << 64) - 1


def fingerprint(chunk: torch.Tensor) -> int:
    """A 64-bit digest of a uint8 tensor computed by the device that holds it: the sum of its 32-bit
    words times distinct odd weights, in int64 (which wraps, so the sum is the same in any order),
    then the trailing bytes. Every changed byte changes it, and so do two swapped words; it is a
    checksum, not a cryptographic hash. Chunks start 4-byte aligned (pieces sit at ALIGN offsets)."""
    n = chunk.numel()
    whole = n - n % 4
    total = len(chunk) * 0x9E3779B97F4A7C15
    if whole:
        words = chunk[:whole].view(torch.int32).to(torch.int64)
        weights = torch.arange(1, 2 * len(words), 2, dtype=torch.int64, device=chunk.device)
        total += int((words * weights).sum())
    for i in range(whole, n):
        total = total * 1099511628211 + int(chunk[i]) + 1
    return total & _MASK


def combine(digests: list[int], handle: bytes = b"") -> int:
    """One digest of a list of digests (after a handle's bytes): a bucket's checksum, a sync's attestation."""
    h = xxhash.xxh3_64(handle)
    h.update(np.asarray(digests, dtype=np.uint64).tobytes())
    return h.intdigest()


def align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


class WeightSyncError(RuntimeError):
    """A weight sync that failed at one bucket, as a value a driver can act on: the version, the
    bucket, the receiver addresses the failure points at, and what happened (`kind`):
    undelivered (a bucket could not be handed to `addresses`), no_ack (`addresses` did not confirm
    an in-place bucket), starved (the bucket never reached `addresses`: someone upstream failed),
    sender_gone, out_of_order, checksum, attestation (what a server loaded is not what was sent),
    no_group (a receiver did not join a collective sync's process group)."""

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
        error_type = {"checksum": ChecksumError, "attestation": AttestationError}.get(fields["kind"], WeightSyncTimeout if fields["kind"] in TIMEOUT_KINDS else WeightSyncError)
        return error_type(fields["message"], version=fields["version"], bucket=fields["bucket"], addresses=tuple(fields["addresses"]), kind=fields["kind"])


TIMEOUT_KINDS = ("undelivered", "no_ack", "starved", "sender_gone", "no_group")


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A weight sync that ran out of time waiting on `addresses`."""


def _rebuild(cls, message, version, bucket, addresses, kind):
    return cls(message, version=version, bucket=bucket, addresses=addresses, kind=kind)


class ChecksumError(WeightSyncError):
    """A bucket's payload does not match its header's checksum: corrupted on the named hop."""


class AttestationError(WeightSyncError):
    """What a server loaded is not what the trainer sent: the first differing tensor is named."""


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
