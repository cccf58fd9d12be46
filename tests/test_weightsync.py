import threading

import pytest
import torch

from raytool.weightsync import WeightReceiver, WeightSender


def _receive_all(receiver, version, out):
    for bucket in receiver.receive(version, timeout_s=30):
        for name, tensor in bucket:
            out[name] = tensor.clone()


def test_round_trip_to_two_receivers_is_exact():
    torch.manual_seed(0)
    weights = {
        "embed.weight": torch.randn(300, 64),
        "layer.0.bf16": torch.randn(128, 128).to(torch.bfloat16),
        "big": torch.randn(1024, 1024),  # 4 MiB: bigger than a bucket, travels alone
        "scalar": torch.tensor(3.5),
        "ints": torch.arange(10),
    }
    receivers = [WeightReceiver(), WeightReceiver()]
    got = [{}, {}]
    threads = [threading.Thread(target=_receive_all, args=(r, 5, g)) for r, g in zip(receivers, got)]
    for t in threads:
        t.start()
    sender = WeightSender([r.address for r in receivers], bucket_bytes=1 << 20)
    stats = sender.send(weights.items(), version=5)
    for t in threads:
        t.join(30)
    assert stats["buckets"] >= 3 and stats["bytes"] >= sum(w.numel() * w.element_size() for w in weights.values())
    for g in got:
        assert g.keys() == weights.keys()
        for name, w in weights.items():
            assert g[name].dtype == w.dtype and g[name].shape == w.shape and torch.equal(g[name], w)
    sender.close()
    for r in receivers:
        r.close()


def test_stale_buckets_are_dropped_and_a_newer_version_refused():
    receiver = WeightReceiver()
    sender = WeightSender([receiver.address])
    sender.send([("w", torch.ones(2))], version=2)  # e.g. left over from a failed sync
    sender.send([("w", torch.full((2,), 3.0))], version=3)
    (bucket,) = list(receiver.receive(version=3, timeout_s=10))
    assert torch.equal(bucket[0][1], torch.full((2,), 3.0))
    sender.send([("w", torch.ones(2))], version=5)
    with pytest.raises(RuntimeError, match="expected v4 bucket 0, got v5 bucket 0"):
        next(receiver.receive(version=4, timeout_s=10))
    with pytest.raises(TimeoutError, match="no bucket 0"):
        next(receiver.receive(version=6, timeout_s=0.2))
    sender.close()
    receiver.close()
