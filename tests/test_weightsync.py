import io
import os
import pickle
import re
import threading
import time
import types

import pytest
import torch
import zmq

from raytool.weightsync import ChecksumError, WeightReceiver, WeightSender, WeightSyncError
from raytool.weightsync import same_node, sender as sender_module
from raytool.weightsync.protocol import BucketHeader, Piece, combine, digest, encode


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(300, 64, generator=g),
        "layer.0.bf16": torch.randn(128, 128, generator=g).to(torch.bfloat16),
        "big": torch.randn(700, 1024, generator=g),  # 2.8 MB: split over three 1 MiB buckets
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
        "ints": torch.arange(10),
        "mask": torch.tensor([True, False, True]),
        "half": torch.randn(33, generator=g).half(),
    }


def _receive_all(receiver, version, got, timeout_s=30):
    """Collect a sync into got['tensors'] (bucket by bucket names in got['buckets']) or its error."""
    got.update(tensors={}, buckets=[])
    try:
        for bucket in receiver.receive(version, timeout_s=timeout_s):
            got["buckets"].append([name for name, _ in bucket])
            for name, tensor in bucket:
                got["tensors"][name] = tensor.clone()
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        got["error"] = exc


def _start(receivers, version, timeout_s=30):
    got = [{} for _ in receivers]
    threads = [threading.Thread(target=_receive_all, args=(r, version, g, timeout_s)) for r, g in zip(receivers, got)]
    for t in threads:
        t.start()
    return got, threads


def _assert_exact(got, weights):
    assert "error" not in got, got.get("error")
    assert got["tensors"].keys() == weights.keys()
    for name, w in weights.items():
        t = got["tensors"][name]
        assert t.dtype == w.dtype and t.shape == w.shape and torch.equal(t, w), name


@pytest.mark.parametrize("kind", ["bytes", "shm"])
@pytest.mark.parametrize("n_receivers", [1, 3])
def test_chain_round_trip_is_exact_and_joins_split_tensors(n_receivers, kind):
    weights = _weights()
    receivers = [WeightReceiver() for _ in range(n_receivers)]
    got, threads = _start(receivers, 5)
    sender = WeightSender([r.address for r in receivers], bucket_bytes=1 << 20, ipc=kind == "shm")
    stats = sender.send(weights.items(), version=5)
    for t in threads:
        t.join(30)
    payload = sum(w.numel() * w.element_size() for w in weights.values())
    assert stats["fanout"] == "chain" and stats["kind"] == kind
    assert stats["buckets"] == 3 and stats["bytes"] == payload  # 2.98 MB: 3 full MiB buckets
    # Bytes go down the chain; read in place, every receiver gets its own small headers.
    assert list(sender._peers.sockets) == ([receivers[0].address] if kind == "bytes" else [r.address for r in receivers])
    for g in got:
        _assert_exact(g, weights)
        # 'big' fills the rest of bucket 0, all of bucket 1, and comes whole with bucket 2
        assert g["buckets"] == [["embed.weight", "layer.0.bf16"], [], ["big", "scalar", "empty", "ints", "mask", "half"]]
    sender.close()
    for r in receivers:
        r.close()


def test_direct_fanout_is_exact_and_a_second_sync_reuses_the_sender():
    weights = _weights()
    receivers = [WeightReceiver(), WeightReceiver()]
    sender = WeightSender([r.address for r in receivers], bucket_bytes=1 << 20, fanout="direct", ipc=False)
    for version in (1, 2):
        weights["scalar"] = torch.tensor(float(version))
        got, threads = _start(receivers, version)
        assert sender.send(weights.items(), version)["fanout"] == "direct"
        for t in threads:
            t.join(30)
        for g in got:
            _assert_exact(g, weights)
    assert set(sender._peers.sockets) == {r.address for r in receivers}
    sender.close()
    for r in receivers:
        r.close()


def test_an_empty_sync_is_one_empty_last_bucket():
    receiver = WeightReceiver()
    sender = WeightSender([receiver.address], ipc=False)
    assert sender.send([], 1)["buckets"] == 1
    assert list(receiver.receive(1, timeout_s=10)) == [[]]
    sender.close()
    receiver.close()


def _hand_made_bucket(route, hop, corrupt: bool, last: bool = True):
    payload = bytearray(torch.arange(16, dtype=torch.float32).numpy().tobytes())
    sent = digest(torch.frombuffer(bytes(payload), dtype=torch.uint8))
    header = BucketHeader(3, 0, last, "bytes", combine([sent]), [Piece("w", "float32", [16], 0, 64, 0, 64)], route, hop, "test", digests=[sent])
    if corrupt:
        payload[10] ^= 0xFF
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(route[hop])
    push.send_multipart([encode(header), bytes(payload)])
    return push


def test_a_corrupted_bucket_fails_its_checksum_naming_bucket_and_hop():
    first, second = WeightReceiver(), WeightReceiver()
    push = _hand_made_bucket([second.address], 0, corrupt=False)
    (bucket,) = list(second.receive(3, timeout_s=10))
    assert torch.equal(bucket[0][1], torch.arange(16, dtype=torch.float32))
    push.close()
    push = _hand_made_bucket([first.address, second.address], 1, corrupt=True)  # as if forwarded by `first`
    with pytest.raises(ChecksumError, match=f"v3: bucket 0 failed its checksum on the hop {first.address} -> {second.address} "
                                            r"\(first at tensor w, bytes 0-64\)"):
        next(second.receive(3, timeout_s=10))
    push.close()
    for r in (first, second):
        r.close()


def test_a_sender_corrupting_in_transit_is_caught_by_the_first_receiver(monkeypatch):
    receiver = WeightReceiver()
    real = sender_module.combine
    monkeypatch.setattr(sender_module, "combine", lambda digests, handle=b"": real(digests, handle) ^ 1)  # header and bytes disagree
    sender = WeightSender([receiver.address], bucket_bytes=1 << 20, ipc=False)
    sender.send(_weights().items(), 4)
    with pytest.raises(ChecksumError, match=r"v4: bucket 0 failed its checksum on the hop the sender \("):
        next(receiver.receive(4, timeout_s=10))
    sender.close()
    receiver.close()


def _dead_address() -> str:
    r = WeightReceiver()
    r.close()  # nothing listens there any more
    return r.address


def test_a_dead_receiver_mid_chain_is_named_by_the_one_forwarding_to_it():
    a, c, dead = WeightReceiver(), WeightReceiver(), _dead_address()
    got, threads = _start([a, c], 6, timeout_s=0.5)
    sender = WeightSender([a.address, dead, c.address], bucket_bytes=1 << 20, send_timeout_s=2, ipc=False)
    start = time.monotonic()
    sender.send(_weights().items(), 6)  # the first hop is fine
    for t in threads:
        t.join(10)
    assert time.monotonic() - start < 3
    error = got[0]["error"]
    assert isinstance(error, TimeoutError) and f"could not deliver bucket 0 to {dead} within 0.5s" in str(error)
    assert isinstance(error, WeightSyncError) and error.kind == "undelivered" and error.addresses == (dead,) and error.bucket == 0
    assert pickle.loads(pickle.dumps(error)).addresses == (dead,)  # the fields cross a process (Ray) with it
    assert isinstance(got[1]["error"], TimeoutError)
    assert f"v6: bucket 0 did not reach {c.address} within 0.5s" in str(got[1]["error"])
    sender.close()
    for r in (a, c):
        r.close()


def test_a_dead_first_receiver_times_out_the_sender_naming_it():
    dead = _dead_address()
    sender = WeightSender([dead], bucket_bytes=1 << 20, send_timeout_s=0.3, ipc=False)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=f"could not deliver bucket 0 to {dead} within 0.3s"):
        sender.send(_weights().items(), 1)
    assert time.monotonic() - start < 5  # the 0.5 s timeout, not a hang
    assert not [t for t in threading.enumerate() if t.name == "weight-sender"]
    sender.close()


@pytest.mark.parametrize("ipc", [True, False])
def test_a_receiver_that_died_is_named_in_seconds_not_at_the_timeout(ipc):
    """A rollout server killed after the driver asked for its receiver's address: the sender's
    connection to it stays down, and the sender names it once it has been down for down_after_s,
    not after its minutes-long timeout. Read in place, the sender also waits on each receiver's
    ack: one that dies meanwhile is named the same way."""
    weights = _weights()
    a, b = WeightReceiver(), WeightReceiver()
    sender = WeightSender([a.address, b.address], bucket_bytes=1 << 20, send_timeout_s=60, ipc=ipc, fanout="direct", down_after_s=0.5)
    got, threads = _start([a, b], 1)
    sender.send(weights.items(), 1)
    for t in threads:
        t.join(10)
    _assert_exact(got[1], weights)
    b.close()  # killed between two syncs
    got, threads = _start([a], 2, timeout_s=1)
    start = time.monotonic()
    # which bucket it names depends on when the sender sees the connection down: ZMQ may queue the
    # first buckets for a peer it has not yet noticed is gone (bucket 2 once, on a loaded host)
    with pytest.raises(TimeoutError, match=rf"could not deliver bucket \d+ to {re.escape(b.address)}: its connection has been down for") as err:
        sender.send(weights.items(), 2)
    assert time.monotonic() - start < 10 and err.value.kind == "undelivered" and err.value.addresses == (b.address,)
    threads[0].join(10)
    sender.close()
    if ipc:
        c = WeightReceiver()
        sender = WeightSender([a.address, c.address], bucket_bytes=1 << 20, send_timeout_s=60, ipc=True, down_after_s=0.5)
        got, threads = _start([a], 3, timeout_s=1)  # c reads nothing: the sender waits for its ack until it dies
        threading.Timer(0.2, c.close).start()
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=f"to {re.escape(c.address)}: its connection has been down for"):
            sender.send(weights.items(), 3)
        assert time.monotonic() - start < 10
        threads[0].join(10)
        sender.close()
    a.close()


def test_a_receiver_waiting_in_vain_names_the_bucket_and_its_upstream():
    a, b = WeightReceiver(), WeightReceiver()
    push = _hand_made_bucket([a.address, b.address], 1, corrupt=False, last=False)  # bucket 0 from `a`, then nothing
    buckets = b.receive(3, timeout_s=0.2)
    assert [name for name, _ in next(buckets)] == ["w"]
    with pytest.raises(TimeoutError, match=f"v3: bucket 1 did not reach {b.address} within 0.2s; it was to come from {a.address}"):
        next(buckets)
    push.close()
    for r in (a, b):
        r.close()


def test_stale_buckets_are_dropped_and_a_newer_version_refused():
    receiver = WeightReceiver()
    sender = WeightSender([receiver.address], ipc=False)
    sender.send([("w", torch.ones(2))], version=2)  # e.g. left over from a failed sync
    sender.send([("w", torch.full((2,), 3.0))], version=3)
    (bucket,) = list(receiver.receive(version=3, timeout_s=10))
    assert torch.equal(bucket[0][1], torch.full((2,), 3.0))
    sender.send([("w", torch.ones(2))], version=5)
    with pytest.raises(RuntimeError, match=r"expected v4 \(attempt 0\) bucket 0, got v5 \(attempt 0\) bucket 0 from the sender"):
        next(receiver.receive(version=4, timeout_s=10))
    with pytest.raises(TimeoutError, match="v6: bucket 0 did not reach .* within 0.2s"):
        next(receiver.receive(version=6, timeout_s=0.2))
    sender.close()
    receiver.close()


def test_a_second_attempt_at_a_version_drops_what_the_first_left_behind():
    """A relay chain broken half-way leaves the first pass's later buckets queued at a receiver;
    the driver's second pass of the same version carries a higher attempt and loads cleanly."""
    receiver = WeightReceiver()
    sender = WeightSender([receiver.address], bucket_bytes=1 << 10, ipc=False)
    first = {f"w{i}": torch.full((200,), float(i)) for i in range(3)}  # 800 bytes each: one bucket per tensor
    sender.send(first.items(), version=3, attempt=1)
    partial = receiver.receive(3, timeout_s=10, attempt=1)
    next(partial)  # bucket 0 loaded, then this receiver's load failed: buckets 1 and 2 stay queued
    partial.close()
    second = {name: t + 10 for name, t in first.items()}
    sender.send(second.items(), version=3, attempt=2)
    loaded = dict(pair for bucket in receiver.receive(3, timeout_s=10, attempt=2) for pair in bucket)
    assert loaded.keys() == second.keys() and all(torch.equal(loaded[n], second[n]) for n in second)
    sender.send(first.items(), version=3, attempt=3)  # the same thing without telling the attempts apart fails
    partial = receiver.receive(3, timeout_s=10, attempt=3)
    next(partial)
    partial.close()
    sender.send(second.items(), version=3, attempt=3)
    with pytest.raises(RuntimeError, match=r"expected v3 \(attempt 3\) bucket 0, got v3 \(attempt 3\) bucket 1"):
        list(receiver.receive(3, timeout_s=10, attempt=3))
    sender.close()
    receiver.close()


def test_an_error_in_the_sender_thread_surfaces_in_send(monkeypatch):
    receiver = WeightReceiver()
    sender = WeightSender([receiver.address], bucket_bytes=1 << 20, ipc=False)
    real = WeightSender._deliver

    def deliver(self, version, bucket, kind):
        if bucket.index == 1:
            raise OSError("network gone at bucket 1")
        real(self, version, bucket, kind)

    monkeypatch.setattr(WeightSender, "_deliver", deliver)
    with pytest.raises(OSError, match="network gone at bucket 1"):
        sender.send(_weights().items(), 1)
    assert not [t for t in threading.enumerate() if t.name == "weight-sender"]
    sender.close()
    receiver.close()


def test_an_error_while_gathering_the_tensors_surfaces_and_stops_the_sender_thread():
    receiver = WeightReceiver()
    sender = WeightSender([receiver.address], bucket_bytes=1 << 20, ipc=False)

    def gather():
        yield "big", torch.randn(700, 1024)
        raise RuntimeError("all-gather failed on rank 1")

    with pytest.raises(RuntimeError, match="all-gather failed on rank 1"):
        sender.send(gather(), 1)
    assert not [t for t in threading.enumerate() if t.name == "weight-sender"]
    sender.close()
    receiver.close()


def test_receivers_on_this_node_read_in_place_others_get_bytes():
    gpu, cpu = types.SimpleNamespace(device=torch.device("cuda", 0)), torch.zeros(1)
    local = ["tcp://127.0.0.1:5000", "tcp://10.1.2.3:5001"]
    assert same_node.choose_kind(gpu, local, node_ip="10.1.2.3", ipc=None) == "cuda"
    assert same_node.choose_kind(cpu, local, node_ip="10.1.2.3", ipc=None, staging_bytes=1 << 20) == "shm"
    # /dev/shm without room for the staging buffers (a container's 64 MB default): bytes
    assert same_node.choose_kind(cpu, local, node_ip="10.1.2.3", ipc=None, staging_bytes=1 << 60) == "bytes"
    assert same_node.choose_kind(cpu, local, node_ip="10.1.2.3", ipc=True) == "shm"
    assert same_node.choose_kind(gpu, local, node_ip=None, ipc=None) == "bytes"  # 10.1.2.3 is another node then
    assert same_node.choose_kind(gpu, local, node_ip="10.1.2.3", ipc=False) == "bytes"
    assert same_node.choose_kind(None, local[:1], node_ip=None, ipc=True) == "shm"
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        same_node.address_host("127.0.0.1:5000")


class _FakeEvent:
    """An accelerator event as torch.cuda / torch.npu give one: recorded on a stream, synchronized later."""

    def __init__(self):
        self.stream = None

    def record(self, stream):
        self.stream = stream

    def synchronize(self):
        pass


@pytest.mark.parametrize("device_type", ["cuda", "npu"])
def test_the_copy_fence_is_the_devices_own_event_on_its_current_stream_and_none_on_a_cpu(monkeypatch, device_type):
    """A non-blocking copy from an accelerator is only queued on its device's current stream: the
    sender waits on an event from that device type's module (torch.cuda; torch.npu, which torch_npu
    registers), recorded on that stream. A CPU copy is done when copy_ returns: nothing to wait on."""
    assert sender_module.copy_fence(torch.device("cpu")) is None
    streams = []
    fake = types.SimpleNamespace(Event=_FakeEvent, current_stream=lambda device: streams.append(device) or f"stream of {device.index}")
    monkeypatch.setattr(torch, device_type, fake, raising=False)
    device = types.SimpleNamespace(type=device_type, index=1)  # torch.device("npu") needs torch_npu
    fence = sender_module.copy_fence(device)
    assert isinstance(fence, _FakeEvent) and fence.stream == "stream of 1" and streams == [device]
    monkeypatch.delattr(torch, device_type)
    with pytest.raises(RuntimeError, match=f"torch.{device_type} has no Event and current_stream.*import torch_npu"):
        sender_module.copy_fence(device)


def test_the_sender_thread_reads_a_bucket_only_after_its_copy_landed():
    """The device copy into the staging buffer lands when its fence is synchronized (here: the
    fence writes the bytes then, as a late DMA would): the receiver gets the weights, not the
    buffer's old bytes."""
    receiver = WeightReceiver()
    sender = WeightSender([receiver.address], ipc=False)
    weights = torch.arange(64, dtype=torch.float32)
    staging = torch.zeros(256, dtype=torch.uint8)  # what the buffer held before the copy

    class LateCopy(_FakeEvent):
        def synchronize(self):
            staging.copy_(weights.view(torch.uint8))

    piece = Piece("w", "float32", [64], 0, 256, 0, 256)
    sender._deliver(1, sender_module._Bucket(0, True, staging, 256, [piece], [staging[:256]], LateCopy()), "bytes")
    (bucket,) = list(receiver.receive(1, timeout_s=10))
    assert [name for name, _ in bucket] == ["w"] and torch.equal(bucket[0][1], weights)
    sender.close()
    receiver.close()


def test_cuda_ipc_falls_back_to_shared_memory_with_one_warning_where_a_gpu_lacks_peer_access():
    here, peerless = "cuda:0 (GPU-aaaa)", ["GPU 3 (GPU-dddd)"]
    assert same_node.cuda_ipc_route(here, [], ipc=None, shm_room=True) == ("cuda", "")  # every GPU reaches ours
    assert same_node.cuda_ipc_route(here, None, ipc=None, shm_room=True) == ("cuda", "")  # NVML cannot tell: as before
    kind, warning = same_node.cuda_ipc_route(here, peerless, ipc=None, shm_room=True)
    assert kind == "shm" and "\n" not in warning
    assert "GPU 3 (GPU-dddd) of this node cannot reach the sender's GPU cuda:0 (GPU-aaaa) by peer access" in warning
    assert "host shared memory" in warning and "trainer.weight_sync_in_place=false" in warning
    assert same_node.cuda_ipc_route(here, peerless, ipc=None, shm_room=False)[0] == "bytes"  # a small /dev/shm
    assert same_node.cuda_ipc_route(here, peerless, ipc=True, shm_room=False)[0] == "shm"  # in place was asked for
    two = same_node.cuda_ipc_route(here, [*peerless, "GPU 4 (GPU-eeee)"], ipc=None, shm_room=True)[1]
    assert "GPU 3 (GPU-dddd) and 1 more GPU(s) of this node" in two
    assert same_node.gpus_without_peer_access("GPU-not-a-gpu-of-this-node") is None  # no NVML here, or no such GPU


def test_a_sender_asks_about_peer_access_once_per_gpu_and_warns_once(monkeypatch, caplog):
    asked = []
    monkeypatch.setattr(same_node, "device_uuid", lambda device: "aaaa")
    monkeypatch.setattr(same_node, "gpus_without_peer_access", lambda uuid: asked.append(uuid) or ["GPU 1 (GPU-bbbb)"])
    sender = WeightSender(["tcp://127.0.0.1:5000"], bucket_bytes=1 << 20)
    with caplog.at_level("WARNING", logger="raytool.weightsync.sender"):
        kinds = [sender._cuda_ipc_route(torch.device("cuda", 0)) for _ in range(3)]
    assert kinds == ["shm"] * 3 and asked == ["aaaa"]
    assert [r.getMessage() for r in caplog.records] == [
        same_node.cuda_ipc_route("cuda:0 (GPU-aaaa)", ["GPU 1 (GPU-bbbb)"], None, True)[1]]
    sender.close()


def test_in_place_buckets_wait_for_every_receivers_ack_and_name_the_missing_one():
    a, b = WeightReceiver(), WeightReceiver()
    sender = WeightSender([a.address, b.address], bucket_bytes=1 << 20, send_timeout_s=0.5, ipc=True)
    got, threads = _start([a], 3, timeout_s=1)  # b forwards nothing and acks nothing: nobody reads it
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=f"v3: no ack for bucket 0 from {b.address} within 0.5s"):
        sender.send(_weights().items(), 3)
    assert time.monotonic() - start < 5  # the 0.5 s timeout, not a hang
    sender.close()  # its shared-memory files go
    threads[0].join(10)
    # two buckets are in flight at most: `a` got 0 and 1, then the sender gave up
    assert got[0]["buckets"] == [["embed.weight", "layer.0.bf16"], []] and "v3: bucket 2 did not reach" in str(got[0]["error"])
    assert not [f for f in os.listdir(same_node.SHM_DIR) if f.startswith(f"raytool-weights-{os.getpid()}-")]
    for r in (a, b):
        r.close()


def test_staging_files_of_killed_senders_are_removed_and_live_ones_kept(tmp_path):
    """A sender killed with SIGKILL cannot remove its shared-memory files (64 MiB each): the next
    process that makes one removes those whose process is gone, or whose PID a later process reuses."""
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    dead, mine, reused = (tmp_path / f"raytool-weights-{gone.stdout.strip()}-0", tmp_path / f"raytool-weights-{os.getpid()}-0",
                          tmp_path / "raytool-weights-1-0")  # PID 1 started long before this file
    other = tmp_path / "psm_vllm"
    for path in (dead, mine, reused, other):
        path.write_bytes(b"x")
    os.utime(reused, (1.0, 1.0))  # "made" in 1970, before PID 1 started: its maker is gone
    assert sorted(same_node.unlink_dead_senders_files(str(tmp_path))) == sorted([str(dead), str(reused)])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, other.name])


def test_the_header_names_each_hop_upstream():
    header = BucketHeader(1, 0, True, "bytes", 0, [], ["tcp://a:1", "tcp://b:2"], 0, "trainer pid 7")
    assert header.upstream() == "the sender (trainer pid 7)"
    header.hop = 1
    assert header.upstream() == "tcp://a:1"


def _ipc_receive(address_queue, result_queue, version: int = 9, gpu: int | None = None):
    """A receiver in its own process (on GPU `gpu`, if given): puts {"tensors": name -> (device
    type, tensor), "attestation": ...} of sync `version` on `result_queue`."""
    if gpu is not None:
        torch.cuda.set_device(gpu)
    receiver = WeightReceiver()
    address_queue.put(receiver.address)
    out = {}
    for bucket in receiver.receive(version, timeout_s=120):
        for name, tensor in bucket:
            out[name] = (tensor.device.type, tensor.cpu().clone())
    # Bytes, not tensors: a queued CPU tensor travels as a file descriptor that dies with this process.
    buffer = io.BytesIO()
    torch.save({"tensors": out, "attestation": receiver.attestation}, buffer)
    result_queue.put(buffer.getvalue())
    receiver.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ipc_publishes_a_tensor_set_to_another_process(monkeypatch):
    import multiprocessing as mp

    # Both processes use this one GPU: no peer access needed, whatever the node's other GPUs lack.
    monkeypatch.setattr(same_node, "gpus_without_peer_access", lambda uuid: [])
    ctx = mp.get_context("spawn")
    addresses, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_ipc_receive, args=(addresses, results))
    proc.start()
    weights = {name: w.cuda() for name, w in _weights().items()}
    sender = WeightSender([addresses.get(timeout=60)], bucket_bytes=1 << 20)
    stats = sender.send(weights.items(), 9)  # auto: GPU weights, receiver on this node
    got = torch.load(io.BytesIO(results.get(timeout=60)))["tensors"]
    proc.join(30)
    assert stats["kind"] == "cuda" and stats["buckets"] == 3
    assert got.keys() == weights.keys()
    for name, w in weights.items():
        device, t = got[name]
        assert device == "cuda" and t.dtype == w.dtype and torch.equal(t, w.cpu()), name
    sender.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("route", ["bytes", "shm"])
def test_gpu_weights_copied_to_host_staging_arrive_exact(monkeypatch, route):
    """GPU weights through a host staging buffer: page-locked ("bytes", over TCP) or a shared-memory
    file (the fallback where a GPU of the node lacks peer access, forced here). The copies are
    non-blocking: the sender waits for each bucket's fence before it checksums and sends it."""
    if route == "shm":
        monkeypatch.setattr(same_node, "gpus_without_peer_access", lambda uuid: ["GPU 9 (GPU-no-peer-access)"])
    weights = {name: w.cuda() for name, w in _weights().items()}
    receiver = WeightReceiver()
    got, threads = _start([receiver], 4)
    sender = WeightSender([receiver.address], bucket_bytes=1 << 20, ipc=None if route == "shm" else False)
    stats = sender.send(weights.items(), 4)
    threads[0].join(60)
    assert stats["kind"] == route
    _assert_exact(got[0], {name: w.cpu() for name, w in weights.items()})
    sender.close()
    receiver.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nvml_peer_access_agrees_with_cuda_for_the_visible_gpus():
    """The sender's check (NVML, every GPU of the node) against CUDA's own answer for the GPUs this
    process sees; a one-GPU machine has no other GPU to lack it."""
    for index in range(torch.cuda.device_count()):
        peerless = same_node.gpus_without_peer_access(same_node.device_uuid(torch.device("cuda", index)))
        assert peerless is not None, "NVML did not answer on a CUDA machine"
        for other in range(torch.cuda.device_count()):
            if other != index:
                uuid = same_node.device_uuid(torch.device("cuda", other))
                assert any(uuid in name for name in peerless) == (not torch.cuda.can_device_access_peer(other, index))


@pytest.mark.skipif(__import__("raytool.bench.netns", fromlist=["available"]).available() is not None, reason="needs root and iproute2")
def test_the_relay_chain_keeps_fan_out_near_one_link_between_simulated_nodes(tiny_model_path):
    """The sender and 4 receivers each in a network namespace of its own behind one 200 Mbit/s
    link: down the relay chain 4 receivers take about as long as 1 (each link carries the weights
    once), while direct fan-out sends them 4 times through the sender's one link. The namespaces
    are gone afterwards."""
    import subprocess

    from raytool.bench.weight_sync import linked

    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    result = linked(tiny_model_path, 200, 1 << 20, repeats=1)
    assert result["linked_fanout4_vs_1"] <= 1.3, result
    assert result["linked_direct4_vs_1"] >= 3.0, result
    assert 0.1 < result["link_gbps_used"] <= 0.2, result  # one receiver: the link's rate, no more
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout == before


def test_a_broken_chain_names_its_culprits_and_resyncs_only_the_starved_servers():
    """Without Ray: which failed servers broke the relay chain (their actor died, or a forwarder
    could not deliver to them) and which only starved behind them (synced again without the culprits)."""
    from raytool.weightsync import ServerSyncFailure, WeightSyncTimeout, chain_culprits

    targets = {"s0": ["tcp://a:1"], "s1": ["tcp://b:1"], "s2": ["tcp://c:1"], "s3": ["tcp://d:1"]}
    undelivered = WeightSyncTimeout("bucket 0 could not be handed to tcp://b:1", version=3, bucket=0, addresses=("tcp://b:1",), kind="undelivered")
    starved = WeightSyncTimeout("bucket 0 never arrived", version=3, bucket=0, addresses=("tcp://c:1",), kind="starved")
    failures = {
        "s1": ServerSyncFailure("no bucket", False, starved),  # named by s0's undelivered error: a culprit though its actor lives
        "s0": ServerSyncFailure("forwarder failed", False, undelivered),
        "s2": ServerSyncFailure("starved", False, starved),
        "s3": ServerSyncFailure("actor died", True),
    }
    culprits, again = chain_culprits(targets, failures)
    assert culprits == {"s1", "s3"} and again == {"s0": ["tcp://a:1"], "s2": ["tcp://c:1"]}
    assert chain_culprits(targets, {}) == (set(), {})
