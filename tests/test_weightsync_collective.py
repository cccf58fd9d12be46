"""The collective weight-sync path (gloo here: the same code takes NCCL on CUDA, HCCL on Ascend) and
the attestation every path carries: exact to the bit, dead and stopped receivers named within the
deadline, a group made again after a failure, and a perturbed tensor caught by its name."""

import asyncio
import multiprocessing as mp
import os
import re
import signal
import threading
import time

import pytest
import torch

from raytool.weightsync import AttestationError, WeightReceiver, WeightSender
from raytool.weightsync.protocol import combine, digest, fingerprint
from tests.test_weightsync import _assert_exact, _start, _weights


def _finish(threads):
    for t in threads:
        t.join(30)


@pytest.mark.parametrize("n_receivers", [1, 3])
def test_the_gloo_path_is_exact_to_the_bit_and_keeps_its_group_from_sync_to_sync(n_receivers):
    weights = _weights()
    receivers = [WeightReceiver() for _ in range(n_receivers)]
    sender = WeightSender([r.address for r in receivers], bucket_bytes=1 << 20, backend="collective", send_timeout_s=30)
    try:
        for version in (1, 2):
            weights["scalar"] = torch.tensor(float(version))
            got, threads = _start(receivers, version)
            stats = sender.send(weights.items(), version)
            _finish(threads)
            assert stats["kind"] == "collective" and stats["buckets"] == 3
            for g, r in zip(got, receivers):
                _assert_exact(g, weights)
                # split tensors joined as on the other paths
                assert g["buckets"] == [["embed.weight", "layer.0.bf16"], [], ["big", "scalar", "empty", "ints", "mask", "half"]]
                assert r.attestation == stats["attestation"] != 0  # each receiver verified what the trainer sent
            assert sender._group.generation == 0  # kept: no failure, same receivers
    finally:
        sender.close()
        for r in receivers:
            r.close()


@pytest.mark.parametrize("model", ["tiny-random", "tiny-random-moe"])
def test_the_gloo_path_carries_a_real_models_weights_exactly(model):
    """The trainer's weights as the trainer sends them (bf16 here), a dense model and a MoE's experts."""
    from transformers import AutoModelForCausalLM

    from raytool.models import resolve_model

    weights = {n: p.detach().to(torch.bfloat16) for n, p in AutoModelForCausalLM.from_pretrained(resolve_model(model)).named_parameters()}
    receiver = WeightReceiver()
    sender = WeightSender([receiver.address], bucket_bytes=1 << 20, backend="collective", send_timeout_s=30)
    try:
        got, threads = _start([receiver], 1)
        stats = sender.send(weights.items(), 1)
        _finish(threads)
        _assert_exact(got[0], weights)
        assert receiver.attestation == stats["attestation"]
        if model == "tiny-random-moe":
            assert any(".experts." in name for name in got[0]["tensors"])
    finally:
        sender.close()
        receiver.close()


def _process_receiver(addresses, acks, version: int, slow_s: float) -> None:
    """A receiver in its own process, loading each bucket slowly, as a rollout server does."""
    receiver = WeightReceiver()
    addresses.put(receiver.address)
    for _ in receiver.receive(version, timeout_s=60):
        acks.put(1)
        time.sleep(slow_s)
    receiver.close()


def _spawn_receiver(version: int, slow_s: float = 0.5):
    ctx = mp.get_context("spawn")
    addresses, acks = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_process_receiver, args=(addresses, acks, version, slow_s), daemon=True)
    proc.start()
    return proc, addresses.get(timeout=60), acks


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_receiver_killed_or_stopped_mid_sync_is_named_within_the_deadline_and_the_group_is_made_again(fault):
    """Two receivers, one in its own process. It is sent SIGKILL (its connections drop: named in
    seconds, as undelivered) or SIGSTOP (alive, silent: named when the deadline passes, as the one
    that did not ack) once it has taken a bucket. The other receiver's sync fails too (it is
    starved); the next sync, to the survivor alone, makes a new group and arrives exact."""
    weights = _weights()
    proc, address, acks = _spawn_receiver(1)
    survivor = WeightReceiver()
    deadline_s = 4.0
    sender = WeightSender([survivor.address, address], bucket_bytes=1 << 20, backend="collective", send_timeout_s=deadline_s,
                          down_after_s=0.5)
    try:
        got, threads = _start([survivor], 1, timeout_s=deadline_s)

        def strike():
            acks.get(timeout=60)
            os.kill(proc.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)

        striker = threading.Thread(target=strike)
        striker.start()
        start = time.monotonic()
        with pytest.raises(TimeoutError) as failed:
            sender.send(weights.items(), 1)
        took = time.monotonic() - start
        striker.join(30)
        assert failed.value.addresses == (address,)
        if fault == "kill":
            assert failed.value.kind == "undelivered" and re.search(r"its connection has been down for \d+s", str(failed.value))
            assert took < deadline_s + 1
        else:
            assert failed.value.kind == "no_ack" and re.search(rf"no ack for bucket \d from {re.escape(address)} within {deadline_s:g}s", str(failed.value))
            assert took < 2 * deadline_s + 2
        _finish(threads)
        assert "error" in got[0]  # starved: the group it waited in was aborted
        assert sender._group is None  # a group a sync failed in is never reused
        sender.close()
        sender = WeightSender([survivor.address], bucket_bytes=1 << 20, backend="collective", send_timeout_s=30)
        got, threads = _start([survivor], 2)
        sender.send(weights.items(), 2)
        _finish(threads)
        _assert_exact(got[0], weights)
    finally:
        sender.close()
        survivor.close()
        proc.kill()
        proc.join(10)


def test_a_receiver_that_never_joins_is_named_by_the_store():
    """A receiver whose process lives but never reads its header (it never joins the group)."""
    a, b = WeightReceiver(), WeightReceiver()
    sender = WeightSender([a.address, b.address], bucket_bytes=1 << 20, backend="collective", send_timeout_s=1.5)
    try:
        got, threads = _start([a], 1, timeout_s=1.5)
        with pytest.raises(TimeoutError, match=f"{re.escape(b.address)} did not join the gloo group of bucket 0 within 1.5s") as failed:
            sender.send(_weights().items(), 1)
        assert failed.value.kind == "no_group" and failed.value.addresses == (b.address,)
        _finish(threads)
    finally:
        sender.close()
        for r in (a, b):
            r.close()


def test_digests_name_a_changed_byte_and_a_swap():
    data = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    base = fingerprint(data)
    changed = data.clone()
    changed[1000] ^= 1
    swapped = data.clone().view(torch.int32)
    swapped[[3, 7]] = swapped[[7, 3]]
    odd = torch.arange(7, dtype=torch.uint8)
    assert len({base, fingerprint(changed), fingerprint(swapped.view(torch.uint8)), fingerprint(odd), fingerprint(odd[:6])}) == 5
    assert fingerprint(data.clone()) == base  # the same bytes, the same digest
    assert digest(data) != digest(changed) and combine([1, 2]) != combine([2, 1])


def test_an_engine_that_loaded_a_perturbed_tensor_refuses_the_version_naming_it(tiny_model_path):
    """One tensor changed after the receiver verified it (as a faulty load would): the engine's
    check of its parameters against the trainer's digests names it, and the engine serves nothing
    of that version; a correct sync afterwards is attested and served."""
    from raytool.engines.hf import HFEngine
    from raytool.types import SamplingParams

    engine = HFEngine(tiny_model_path, seed=0)
    named = [(n, p.detach().clone()) for n, p in engine.model.named_parameters()]
    victim = named[3][0]
    real_load = engine.load_weights

    def faulty_load(bucket):
        bucket = list(bucket)
        loaded = real_load(bucket)
        if any(name == victim for name, _ in bucket):
            with torch.no_grad():
                dict(engine.model.named_parameters())[victim].view(-1)[0] += 1.0
        return loaded

    async def scenario():
        (address,) = await engine.bind_weight_receivers("127.0.0.1")
        sender = WeightSender([address], bucket_bytes=1 << 20, backend="collective", send_timeout_s=30)
        try:
            engine.load_weights = faulty_load
            receiving = asyncio.create_task(engine.receive_weights(1, 30.0))
            await asyncio.to_thread(sender.send, named, 1)
            with pytest.raises(AttestationError, match=f"loaded '{re.escape(victim)}' \\(bytes 0-\\d+\\) differently from what the trainer sent"):
                await receiving
            with pytest.raises(RuntimeError, match="last weight load failed half-way"):
                await engine.generate([1, 2, 3], SamplingParams(max_tokens=2), "refused")
            engine.load_weights = real_load
            receiving = asyncio.create_task(engine.receive_weights(2, 30.0))
            stats = await asyncio.to_thread(sender.send, named, 2)
            await receiving
            assert engine.attestation == stats["attestation"] and engine.policy_version == 2
        finally:
            sender.close()

    asyncio.run(scenario())
    engine.shutdown()


def test_a_lora_sync_is_attested_and_an_adapter_that_never_reached_the_engine_is_named(tiny_model_path):
    """LoRA syncs the merged weights: the engine attests them. An engine that never took the adapted
    tensors (it kept the base q_proj, the failure that let a run train one model while sampling
    another) is named at the first such tensor, and serves nothing of that version."""
    from raytool.engines.hf import HFEngine
    from raytool.types import TrainBatch
    from tests.test_trainer import BATCH, _trainer

    trainer = _trainer(tiny_model_path, "trainer.lora_rank=4", "trainer.lr=1e-2")
    trainer.rl_step(TrainBatch.whole(BATCH))
    trainer.rl_step(TrainBatch.whole(BATCH))  # lora_B starts at 0: the second step moves the merged weights
    merged = [(n, w.detach().clone()) for n, w in trainer.named_weights()]
    engine = HFEngine(tiny_model_path, seed=0)
    real_load = engine.load_weights

    async def scenario():
        (address,) = await engine.bind_weight_receivers("127.0.0.1")
        sender = WeightSender([address], bucket_bytes=1 << 20, backend="collective", send_timeout_s=30)
        try:
            engine.load_weights = lambda bucket: real_load([(n, t) for n, t in bucket if "q_proj" not in n])
            receiving = asyncio.create_task(engine.receive_weights(1, 30.0))
            await asyncio.to_thread(sender.send, merged, 1)
            with pytest.raises(AttestationError, match=r"loaded 'model\.layers\.0\.self_attn\.q_proj\.weight' .* differently"):
                await receiving
            engine.load_weights = real_load
            receiving = asyncio.create_task(engine.receive_weights(2, 30.0))
            stats = await asyncio.to_thread(sender.send, merged, 2)
            await receiving
            assert engine.attestation == stats["attestation"]
        finally:
            sender.close()

    asyncio.run(scenario())
    engine.shutdown()


def test_a_second_attempt_drops_what_the_first_left_behind_and_takes_a_new_group():
    """A receiver that stopped after loading bucket 0 of attempt 1 (its ack never came): the sender
    names it when the deadline passes and aborts the group. The driver's second pass of the same
    version carries a higher attempt: the receiver drops the first pass's queued header, joins the
    new generation's group and loads the weights exactly."""
    receiver = WeightReceiver()
    sender = WeightSender([receiver.address], bucket_bytes=1 << 10, backend="collective", send_timeout_s=1.5)
    try:
        first = {f"w{i}": torch.full((200,), float(i)) for i in range(3)}  # 800 bytes each: one bucket per tensor
        partial = receiver.receive(3, timeout_s=10, attempt=1)
        loader = threading.Thread(target=next, args=(partial,))  # takes bucket 0, then stops: no ack
        loader.start()
        with pytest.raises(TimeoutError, match=rf"no ack for bucket \d from {re.escape(receiver.address)}"):
            sender.send(first.items(), version=3, attempt=1)
        loader.join(10)
        partial.close()
        second = {name: t + 10 for name, t in first.items()}
        loaded: dict = {}

        def receive_second():
            for bucket in receiver.receive(3, timeout_s=10, attempt=2):
                loaded.update((n, t.clone()) for n, t in bucket)

        second_thread = threading.Thread(target=receive_second)
        second_thread.start()
        stats = sender.send(second.items(), version=3, attempt=2)
        second_thread.join(30)
        assert sender._group.generation == 1 and receiver.attestation == stats["attestation"]
        assert loaded.keys() == second.keys() and all(torch.equal(loaded[n], second[n]) for n in second)
    finally:
        sender.close()
        receiver.close()
