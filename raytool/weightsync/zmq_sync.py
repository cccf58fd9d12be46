"""ZMQ weight streaming: the trainer's rank 0 packs tensors into fixed-size byte buckets and pushes
each bucket to every rollout server's receiver (fan-out; one PUSH socket per receiver, so no
round-robin). A bucket is two frames: a msgpack header (names, dtypes, shapes, offsets) and the raw
bytes. The last bucket of a sync carries `last=True`; every bucket carries the sync's version.
"""

from __future__ import annotations

import time
import warnings
from typing import Iterable, Iterator

import msgspec
import torch
import zmq

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool)}


class TensorMeta(msgspec.Struct, array_like=True):
    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


class BucketHeader(msgspec.Struct, array_like=True):
    version: int
    index: int
    last: bool
    tensors: list[TensorMeta]


_ALIGN = 64  # every tensor starts at a multiple of this in its bucket, so any dtype can view it
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(BucketHeader).decode


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()


class WeightSender:
    def __init__(self, addresses: list[str], bucket_bytes: int = 64 << 20, send_timeout_s: float = 120.0):
        self.bucket_bytes = bucket_bytes
        self._ctx = zmq.Context.instance()
        self._sockets = []
        for address in addresses:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self._sockets.append(sock)

    def _flush(self, version: int, index: int, last: bool, metas: list[TensorMeta], chunks: list[torch.Tensor]) -> int:
        payload = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
        header = _encode(BucketHeader(version, index, last, metas))
        frame = memoryview(payload.numpy())
        for sock in self._sockets:
            try:
                sock.send_multipart([header, frame], copy=False)
            except zmq.Again:
                raise TimeoutError(f"weight sync v{version}: a receiver did not take bucket {index} in time") from None
        return payload.numel()  # bytes on the wire, alignment padding included

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict:
        """Stream every tensor to every receiver; returns bytes, buckets and seconds."""
        start = time.perf_counter()
        metas: list[TensorMeta] = []
        chunks: list[torch.Tensor] = []
        used = total = index = 0
        for name, tensor in named_tensors:
            data = _as_bytes(tensor)
            if chunks and used + data.numel() > self.bucket_bytes:
                total += self._flush(version, index, False, metas, chunks)
                index += 1
                metas, chunks, used = [], [], 0
            if used % _ALIGN:
                pad = _ALIGN - used % _ALIGN
                chunks.append(torch.zeros(pad, dtype=torch.uint8))
                used += pad
            metas.append(TensorMeta(name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), used, data.numel()))
            chunks.append(data)
            used += data.numel()
        total += self._flush(version, index, True, metas, chunks)
        return {"bytes": total, "buckets": index + 1, "seconds": time.perf_counter() - start}

    def close(self) -> None:
        for sock in self._sockets:
            sock.close(linger=0)


class WeightReceiver:
    def __init__(self, host: str = "127.0.0.1"):
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"

    def receive(self, version: int, timeout_s: float = 120.0) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yield the tensors of one sync, a bucket at a time, until the bucket marked last."""
        expected = 0
        while True:
            if not self._sock.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"weight sync v{version}: no bucket {expected} within {timeout_s:.0f}s")
            header_frame, payload = self._sock.recv_multipart(copy=False)
            header = _decode(header_frame.bytes)
            if header.version < version:
                continue  # left over from a sync that failed half-way: drop it
            if header.version != version or header.index != expected:
                raise RuntimeError(
                    f"weight sync: expected v{version} bucket {expected}, got v{header.version} bucket {header.index}"
                )
            with warnings.catch_warnings():  # the frame is read-only; tensors are copied out right away
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.frombuffer(payload.buffer, dtype=torch.uint8) if len(payload.buffer) else torch.empty(0, dtype=torch.uint8)
            yield [
                (m.name, raw[m.offset : m.offset + m.nbytes].view(_DTYPES[m.dtype]).reshape(m.shape))
                for m in header.tensors
            ]
            if header.last:
                return
            expected += 1

    def close(self) -> None:
        self._sock.close(linger=0)
