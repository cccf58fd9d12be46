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

Over TCP a sync to several receivers is a chain: `route` lists every receiver in order, the sender
sends to `route[0]`, and the receiver at `route[hop]` forwards the same payload frames, with
`hop + 1` in the header, to `route[hop + 1]`. Direct fan-out (and every in-place sync: its
buckets are small headers) sends each receiver a header whose route is itself.
"""

from __future__ import annotations

import re
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

    def upstream(self) -> str:
        """Who sent this frame to route[hop]."""
        return self.route[self.hop - 1] if self.hop else f"the sender ({self.origin})"


class Ack(msgspec.Struct, array_like=True):
    """A receiver is done with an in-place bucket: the sender may overwrite that staging buffer."""

    version: int
    index: int
    address: str


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


class ChecksumError(RuntimeError):
    """A bucket's payload does not match its header's checksum: corrupted on the named hop."""


def undelivered_address(message: str) -> str | None:
    """The receiver address a weight-sync TimeoutError could not deliver to (None for another
    error): lets a driver map a chain's failure to the server that holds that address."""
    found = re.search(r"could not deliver bucket \d+ to (\S+) ", message)
    return found.group(1) if found else None
