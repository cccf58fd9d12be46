"""The HF engine and the trainer on the tiny random model: they agree on log-probs, and training moves."""

import asyncio
import math

from pathlib import Path

import pytest
import torch

from raytool.engines.hf import HFEngine
from raytool.config import load_config
from raytool.training import Trainer, micro_batches
from raytool.types import SamplingParams, TrainBatch, Trajectory


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return HFEngine(tiny_model_path, seed=0)


async def _gather(engine, prompts, sampling):
    return await asyncio.gather(*(engine.generate(p, sampling, f"r{i}") for i, p in enumerate(prompts)))


def _trainer(path, *overrides):
    """A trainer in fp32: these tests read `trainer.lm` directly, which a bf16 trainer (auto on CPUs
    with native bf16) shards under FSDP2 even on one rank; its own forward goes through the root."""
    return Trainer(load_config(None, ["trainer.compute_dtype=float32", *overrides]), path)


def _token_logprobs(model, ids):
    """log p(x_t | x_<t) for t >= 1 under an HF model, [B, T-1]."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_batched_greedy_generation_matches_single_requests(engine):
    prompts = [[1, 9690, 198, 2683], [1, 4093, 198, 2020, 800, 23313, 429, 216, 33]]
    sampling = SamplingParams(max_tokens=8, temperature=0.0)
    batched = asyncio.run(_gather(engine, prompts, sampling))
    single = [asyncio.run(_gather(engine, [p], sampling))[0] for p in prompts]
    for b, s in zip(batched, single):
        assert b.token_ids == s.token_ids and b.finish_reason == "length" and len(b.token_ids) == 8
        assert all(abs(x - y) < 1e-4 for x, y in zip(b.logprobs, s.logprobs))


def test_engine_logprobs_match_the_trainer(engine, tiny_model_path):
    prompt = [1, 4093, 198, 2020, 800]
    out = asyncio.run(_gather(engine, [prompt], SamplingParams(max_tokens=6, temperature=1.0)))[0]
    ids = torch.tensor([prompt + out.token_ids])
    logp = _token_logprobs(engine.model, ids)[0, len(prompt) - 1 :]
    assert torch.allclose(logp, torch.tensor(out.logprobs), atol=1e-4)


def test_logprobs_are_of_the_distribution_sampled_from(engine):
    # top_k=1 leaves one candidate: the sampler's distribution is a point mass, log-prob 0.
    out = asyncio.run(_gather(engine, [[1, 2, 3]], SamplingParams(max_tokens=5, temperature=1.0, top_k=1)))[0]
    greedy = asyncio.run(_gather(engine, [[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0.0)))[0]
    assert out.token_ids == greedy.token_ids and all(abs(lp) < 1e-6 for lp in out.logprobs)
    assert all(lp < 0 for lp in greedy.logprobs)  # greedy reports the model's own softmax


def test_stop_token_ends_a_request(engine):
    greedy = asyncio.run(_gather(engine, [[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0.0)))[0]
    stop = greedy.token_ids[2]
    out = asyncio.run(_gather(engine, [[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(stop,))))[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy.token_ids[: greedy.token_ids.index(stop) + 1]


def test_micro_batches_respect_the_token_budget():
    lengths = [5, 100, 7, 60, 61, 3, 250]
    groups = micro_batches(lengths, 128)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or max(lengths[i] for i in g) * len(g) <= 128


def _traj(uid, group, prompt, response, reward):
    return Trajectory(uid=uid, group_id=group, prompt_ids=prompt, response_ids=response, response_mask=[1] * len(response),
                      rollout_logprobs=[0.0] * len(response), messages=[], ground_truth="", reward=reward)


def test_rl_step_moves_the_policy_toward_rewarded_samples(tiny_model_path):
    trainer = _trainer(tiny_model_path, "trainer.lr=1e-2", "trainer.micro_batch_tokens=16")
    good, bad = [5, 6, 7, 8], [9, 10, 11, 12]
    batch = [_traj("a", "g", [1, 2, 3], good, 1.0), _traj("b", "g", [1, 2, 3], bad, 0.0)]

    def seq_logp(resp):
        ids = torch.tensor([[1, 2, 3] + resp])
        with torch.no_grad():
            return _token_logprobs(trainer.lm, ids)[0, 2:].sum().item()

    before = seq_logp(good) - seq_logp(bad)
    metrics = trainer.rl_step(TrainBatch.whole(batch))
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0
    assert seq_logp(good) - seq_logp(bad) > before
    # A group with equal rewards has zero advantage: no gradient at all.
    flat = trainer.rl_step(TrainBatch.whole([_traj("c", "h", [1, 2], good, 1.0), _traj("d", "h", [1, 2], bad, 1.0)]))
    assert flat["actor/grad_norm"] == 0.0


def test_off_policy_epochs_use_old_logprobs_and_report_engine_drift(tiny_model_path):
    trainer = _trainer(tiny_model_path, "trainer.lr=1e-2", "algorithm.ppo_epochs=2", "algorithm.mini_batches=2", "trainer.micro_batch_tokens=16")
    batch = [_traj(str(i), "g", [1, 2, 3], [5 + i, 6, 7], float(i % 2)) for i in range(4)]
    metrics = trainer.rl_step(TrainBatch.whole(batch))
    # The second pass sees a policy that moved: its ratio departs from 1 (ppo_kl != 0).
    assert metrics["actor/ppo_kl"] != 0 and math.isfinite(metrics["actor/pg_loss"])
    # rollout_logprobs are 0.0 in these hand-made trajectories: the drift is the trainer's -logp.
    assert metrics["rollout/logprob_abs_diff"] > 1.0


def test_sft_steps_lower_the_loss_and_checkpoint_reloads(tiny_model_path, renderer, tmp_path):
    from transformers import AutoModelForCausalLM

    from raytool.data import make_splits, sft_messages

    trainer = _trainer(tiny_model_path, "trainer.micro_batch_tokens=2048")
    batch = [renderer.sft_examples(sft_messages(p))[0] for p in make_splits(4, 1, seed=0)[0]]
    losses = [trainer.sft_step(batch, lr=3e-3)["sft/loss"] for _ in range(6)]
    assert losses[-1] < losses[0] * 0.9
    out = Path(trainer.export_hf(tmp_path / "hf"))
    reloaded = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
    for name, param in trainer.lm.named_parameters():
        assert torch.equal(reloaded[name], param.detach()), name
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()


def test_a_trajectory_stopped_by_its_wall_clock_limit_is_left_out_of_the_loss_and_its_groups_statistics(tiny_model_path):
    """A time-limited trajectory (finish reason time_limit) is truncated, not a wrong answer: the
    update is the one of the batch without it, though it scored 0 beside a 1 and a 0."""
    import msgspec

    from raytool.types import TIME_LIMIT

    def update(batch):
        trainer = _trainer(tiny_model_path, "trainer.lr=1e-2", "trainer.micro_batch_tokens=16")
        metrics = trainer.rl_step(TrainBatch.whole(batch))
        return metrics, {n: p.detach().clone() for n, p in trainer.lm.named_parameters()}

    kept = [_traj("a", "g", [1, 2, 3], [5, 6, 7], 1.0), _traj("b", "g", [1, 2, 3], [8, 9], 0.0)]
    slow = msgspec.structs.replace(_traj("c", "g", [1, 2, 3], [10, 11, 12, 13], 0.0), finish_reason=TIME_LIMIT)
    m_with, w_with = update(kept + [slow])
    m_without, w_without = update(kept)
    assert m_with["adv/abs_mean"] == pytest.approx(m_without["adv/abs_mean"])  # scored as wrong, the group's mean would be 1/3
    for name, w in w_without.items():
        assert torch.equal(w_with[name], w), name


def test_skipping_zero_advantage_sequences_changes_nothing(tiny_model_path, monkeypatch):
    from raytool.algos import losses

    batch = [_traj("a", "g", [1, 2, 3], [5, 6, 7], 1.0), _traj("b", "g", [1, 2, 3], [8, 9], 0.0),
             _traj("c", "flat", [1, 2], [5, 6, 7, 8], 1.0), _traj("d", "flat", [1, 2], [9, 9], 1.0)]

    def grads_of_one_step(trainer):
        grads = {}
        step = trainer.optimizer.step

        def capture(*args, **kwargs):  # the gradient the optimizer is handed
            grads.update({n: p.grad.clone() for n, p in trainer.lm.named_parameters()})
            return step(*args, **kwargs)

        trainer.optimizer.step = capture
        return trainer.rl_step(TrainBatch.whole(batch)), grads

    settings = ("trainer.lr=1e-2", "trainer.micro_batch_tokens=16")
    m1, g1 = grads_of_one_step(_trainer(tiny_model_path, *settings))
    monkeypatch.setattr(losses.ppo_clip, "zero_advantage_is_noop", False)
    m2, g2 = grads_of_one_step(_trainer(tiny_model_path, *settings))
    assert m1["actor/skipped_seq_frac"] == 0.5 and m2["actor/skipped_seq_frac"] == 0.0
    assert abs(m1["actor/pg_loss"] - m2["actor/pg_loss"]) < 1e-6
    assert abs(m1["actor/grad_norm"] - m2["actor/grad_norm"]) < 1e-5
    for name in g1:
        # equal up to float summation order (other micro-batch shapes)
        assert torch.allclose(g1[name], g2[name], rtol=1e-4, atol=1e-6), name


def test_hf_engine_takes_a_weight_sync_over_zmq(engine):
    from raytool.weightsync import WeightSender

    async def sync():
        (address,) = await engine.bind_weight_receivers("127.0.0.1")
        sender = WeightSender([address], bucket_bytes=1 << 20)
        try:
            named = [(n, torch.full_like(p, 0.01)) for n, p in engine.model.named_parameters() if "norm" in n]
            receiving = asyncio.create_task(engine.receive_weights(7, 30.0))
            await asyncio.to_thread(sender.send, named, 7)
            return await receiving, len(named)
        finally:
            sender.close()

    before = {n: p.clone() for n, p in engine.model.named_parameters() if "norm" in n}
    loaded, sent = asyncio.run(sync())
    assert loaded == sent and engine.policy_version == 7 and engine.engine_stats()["policy_version"] == 7
    for n, p in engine.model.named_parameters():
        if n in before:
            assert torch.all(p == 0.01)
    with torch.no_grad():  # put the fixture's model back for the other tests
        for n, p in engine.model.named_parameters():
            if n in before:
                p.copy_(before[n])


def test_an_engine_whose_weight_load_failed_serves_nothing_until_a_sync_completes(tiny_model_path):
    """No bucket comes (the sender died): the load times out, the engine may hold half old, half
    new weights, so it refuses requests; the next complete sync makes it serve again."""
    from raytool.weightsync import WeightSender, WeightSyncTimeout

    engine = HFEngine(tiny_model_path, seed=0)
    sampling = SamplingParams(max_tokens=2, temperature=0.0)

    async def scenario():
        (address,) = await engine.bind_weight_receivers("127.0.0.1")
        with pytest.raises(WeightSyncTimeout) as failed:
            await engine.receive_weights(3, 0.3)
        assert failed.value.kind == "starved" and failed.value.addresses == (address,)
        with pytest.raises(RuntimeError, match="last weight load failed half-way"):
            await engine.generate([1, 2, 3], sampling, "refused")
        sender = WeightSender([address], bucket_bytes=1 << 20)
        try:
            named = [(n, p.detach().clone()) for n, p in engine.model.named_parameters()]
            receiving = asyncio.create_task(engine.receive_weights(4, 30.0))
            await asyncio.to_thread(sender.send, named, 4)
            await receiving
        finally:
            sender.close()
        return await engine.generate([1, 2, 3], sampling, "served")

    out = asyncio.run(scenario())
    assert len(out.token_ids) == 2 and out.policy_version == 4
