"""Mixture-of-experts routing without Ray: routes recorded by the HF engine, carried compactly,
assembled over a trajectory's turns and replayed in the trainer (r3: the engine's; r2: the
trainer's own old-policy routing). On tiny-random-moe (Qwen3-MoE, 2 layers, 4 experts, top-2)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from raytool.config import ConfigError, load_config
from raytool.moe import NO_ROUTE, RouteLog, RouterTap, routes_array
from raytool.types import Routes, SamplingParams, TrainBatch, Trajectory


@pytest.fixture(scope="module")
def moe_path():
    from raytool.models import resolve_model

    return resolve_model("tiny-random-moe")


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_routes_travel_as_compact_bytes_and_each_position_keeps_its_first_computation():
    picks = np.arange(5 * 2 * 2, dtype=np.int16).reshape(5, 2, 2) % 4
    routes = Routes.of(picks, start=3)
    assert len(routes.data) == picks.size * 2 and np.array_equal(routes.array(), picks)
    log = RouteLog()
    log.add(Routes.of(np.zeros((4, 2, 2)), start=0))  # turn 1: prompt + its tokens but the last
    log.add(None)  # an engine that returned none adds nothing
    log.add(Routes.of(np.ones((3, 2, 2)), start=2))  # turn 2 re-read positions 2-3 (cached: as turn 1 computed them) and went on
    got = log.routes().array()
    assert got.shape == (5, 2, 2) and (got[:4] == 0).all() and (got[4:] == 1).all()
    full = routes_array(log.routes(), 7, 2, 2)
    assert full.shape == (7, 2, 2) and (full[5:] == NO_ROUTE).all()
    assert routes_array(log.routes(), 7, 3, 2) is None  # another model's layer count: not used


def test_the_tap_without_replay_computes_what_transformers_computes(moe_path):
    plain, tapped = _model(moe_path), _model(moe_path)
    tap = RouterTap(tapped)
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 7]])
    tap.start_recording()
    with torch.no_grad():
        expected, got = plain(ids).logits, tapped(ids).logits
    recorded = tap.stop_recording()
    assert torch.equal(expected, got)
    assert len(recorded) == 2 and recorded[0][0].shape == (7, 2)  # one forward: [tokens, k] per layer


def test_the_hf_engine_returns_the_routes_of_every_position_it_forwarded(moe_path):
    """Prompt tokens and every generated token but the last (which no forward has read): the
    experts a fresh forward of the same weights picks there."""
    from raytool.engines.hf import HFEngine

    engine = HFEngine(moe_path, record_routes=True, seed=0)
    prompt = [5, 17, 99, 3, 250]
    out = asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=6, temperature=1.0), "r1"))
    routes = out.routes.array()
    assert out.routes.start == 0 and routes.shape == (len(prompt) + len(out.token_ids) - 1, 2, 2)
    model = _model(moe_path)
    tap = RouterTap(model)
    tap.start_recording()
    with torch.no_grad():
        model(torch.tensor([prompt + out.token_ids[:-1]]))
    fresh = np.stack([calls[0].numpy() for calls in tap.stop_recording()], axis=1)
    assert np.array_equal(np.sort(routes, -1), np.sort(fresh, -1))


def _engine_side(path, sequences, noise: float):
    """An engine whose kernels break near-ties differently: its router picks top-k of slightly
    perturbed probabilities (the gate weights are the exact ones). Returns each sequence's routes and
    the log-prob of each token after the first under that computation."""
    model = _model(path)
    tap = RouterTap(model)
    own = tap._pick
    gen = torch.Generator().manual_seed(0)
    tap._pick = lambda layer, probs: own(layer, probs + noise * torch.randn(probs.shape, generator=gen))
    out = []
    for ids in sequences:
        tap.start_recording()
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        picks = np.stack([calls[0].numpy() for calls in tap.stop_recording()], axis=1)
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        out.append((picks, logp.tolist()))
    return out


def _batch(path, noise=3e-3):
    prompts = [[5, 17, 99, 3], [250, 41, 7], [11, 12, 13, 14, 15], [8, 9]]
    responses = [[21, 22, 23, 24, 25, 26], [31, 32, 33, 34], [41, 42, 43], [51, 52, 53, 54, 55]]
    seqs = [p + r for p, r in zip(prompts, responses)]
    trajectories = []
    for i, ((picks, logp), p, r) in enumerate(zip(_engine_side(path, seqs, noise), prompts, responses)):
        trajectories.append(Trajectory(
            uid=f"t{i}", group_id=f"g{i // 2}", prompt_ids=p, response_ids=r, response_mask=[1] * len(r),
            rollout_logprobs=logp[len(p) - 1:], messages=[], ground_truth="", reward=float(i % 2), routes=Routes.of(picks)))
    return trajectories


def _trainer(path, *overrides):
    from raytool.training import Trainer

    return Trainer(load_config(None, ["rollout.engine=hf", "rollout.temperature=1.0", "trainer.compute_dtype=float32", *overrides]), path)


def test_replaying_the_engines_routes_reproduces_its_log_probs(moe_path):
    """r3: where the engine routed some tokens elsewhere than the trainer would, the trainer's
    log-probs under the engine's routes equal the engine's (fp32: to 1e-5); on its own routing
    they differ. Every metric of the replay is reported."""
    batch = _batch(moe_path)
    replayed = _trainer(moe_path, "trainer.router_replay=r3").rl_step(TrainBatch.whole(batch))
    assert replayed["router/replay_differs_frac"] > 0.05  # the engine's noise moved that share of (token, layer) routes
    assert replayed["router/replayed_seq_frac"] == 1.0
    assert replayed["rollout/logprob_abs_diff"] < 1e-5
    assert replayed["router/logprob_abs_diff_without_replay"] > 100 * max(replayed["rollout/logprob_abs_diff"], 1e-7)
    assert replayed["router/logprob_abs_diff_with_replay"] == pytest.approx(replayed["rollout/logprob_abs_diff"], abs=1e-6)
    own = _trainer(moe_path).rl_step(TrainBatch.whole(batch))  # router_replay off: the trainer's own routing
    assert own["rollout/logprob_abs_diff"] == pytest.approx(replayed["router/logprob_abs_diff_without_replay"], rel=1e-4)
    assert "router/replay_differs_frac" not in own and own["moe/load_imbalance"] >= 1.0


def test_a_step_that_trains_nothing_still_measures_the_replay(moe_path):
    """Every reward equal (zero advantages: no sequence is trained) on the tiny random model, as
    in a CPU first look: the step still reports what replay changed."""
    batch = [t.__class__(**{**{f: getattr(t, f) for f in t.__struct_fields__}, "reward": 0.0}) for t in _batch(moe_path)]
    metrics = _trainer(moe_path, "trainer.router_replay=r3").rl_step(TrainBatch.whole(batch))
    assert metrics["actor/skipped_seq_frac"] == 1.0 and metrics["router/replay_differs_frac"] > 0.05
    assert metrics["router/logprob_abs_diff_with_replay"] < 1e-5 < metrics["router/logprob_abs_diff_without_replay"]


def test_missing_truncated_or_misshapen_routes_train_without_replay_and_are_counted(moe_path):
    batch = _batch(moe_path)
    short = batch[1].routes.array()[:2]  # stops before the last trained position
    batch[0] = batch[0].__class__(**{**{f: getattr(batch[0], f) for f in batch[0].__struct_fields__}, "routes": None})
    batch[1] = batch[1].__class__(**{**{f: getattr(batch[1], f) for f in batch[1].__struct_fields__}, "routes": Routes.of(short)})
    batch[2] = batch[2].__class__(**{**{f: getattr(batch[2], f) for f in batch[2].__struct_fields__},
                                     "routes": Routes.of(np.zeros((20, 3, 2), dtype=np.int16))})  # 3 layers: another model's
    metrics = _trainer(moe_path, "trainer.router_replay=r3").rl_step(TrainBatch.whole(batch))
    assert metrics["router/replayed_seq_frac"] == 0.25


def test_r2_replays_the_old_policys_routing_in_the_later_updates(moe_path):
    """Two epochs at a large learning rate: the second epoch's own routing has moved from the old
    policy's, and r2 routes it as the old policy did (the share that moved is reported)."""
    batch = _batch(moe_path, noise=0.0)
    metrics = _trainer(moe_path, "trainer.router_replay=r2", "algorithm.ppo_epochs=2", "trainer.lr=5e-2").rl_step(TrainBatch.whole(batch))
    assert metrics["router/replay_differs_frac"] > 0
    assert "router/replayed_seq_frac" not in metrics  # engine routes are r3's


def test_router_replay_on_a_dense_model_or_where_no_routes_can_come_is_one_line(tiny_model_path):
    with pytest.raises(ValueError, match=r"'trainer.router_replay' is r3, but .* is a dense model"):
        _trainer(tiny_model_path, "trainer.router_replay=r3")
    for overrides, why in [
        (["rollout.engine=scripted"], "scripted engine runs no model"),
        (["rollout.engine=vllm"], "vLLM's CPU build cannot return routed experts"),
        (["rollout.engine=hf", "trainer.sequence_parallel_size=2", "trainer.num_workers=2"], "sequence parallelism"),
        (["rollout.engine=hf", "trainer.compile=true"], "torch.compile"),
    ]:
        with pytest.raises(ConfigError, match=rf"config key 'trainer.router_replay' .*{why}"):
            load_config(None, ["trainer.router_replay=r3", *overrides])


def test_the_load_balancing_loss_is_transformers_own_and_only_on_when_asked(moe_path):
    """The tap's loss on a padded batch equals transformers' load_balancing_loss_func over the
    router logits it returns (with the attention mask); trainer.router_aux_loss_coef adds it to
    the RL loss (0 by default: RL recipes run without it)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = _model(moe_path)
    tap = RouterTap(model)
    ids = torch.tensor([[5, 17, 99, 3, 250, 41], [7, 8, 9, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    tap.balancing, tap.valid = True, mask.reshape(-1).bool()
    out = model(ids, attention_mask=mask, output_router_logits=True)
    ours = tap.balance_loss()
    theirs = load_balancing_loss_func(out.router_logits, 4, 2, mask)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5) and ours.requires_grad
    batch = _batch(moe_path)
    assert "moe/aux_loss" not in _trainer(moe_path).rl_step(TrainBatch.whole(batch))
    on = _trainer(moe_path, "trainer.router_aux_loss_coef=0.01").rl_step(TrainBatch.whole(batch))
    assert 1.5 < on["moe/aux_loss"] < 4.0  # k = 2 when balanced, experts x k at worst


def test_a_second_family_mixtral_trains_records_and_replays(tmp_path):
    """Mixtral's router (always renormalised, float32 weights): the tap computes what transformers
    does, and a trainer replays engine routes on it."""
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    from raytool.models import resolve_model

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=49152, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
                           router_aux_loss_coef=0.0)
    MixtralForCausalLM(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(resolve_model("tiny-random")).save_pretrained(tmp_path)
    plain, tapped = _model(tmp_path), _model(tmp_path)
    RouterTap(tapped)
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 7]])
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, tapped(ids).logits)
    batch = _batch(str(tmp_path))
    metrics = _trainer(str(tmp_path), "trainer.router_replay=r3", "trainer.router_aux_loss_coef=0.01").rl_step(TrainBatch.whole(batch))
    assert metrics["router/replayed_seq_frac"] == 1.0 and metrics["router/replay_differs_frac"] > 0
    assert metrics["router/logprob_abs_diff_with_replay"] < 1e-5 < metrics["router/logprob_abs_diff_without_replay"]
    assert "moe/aux_loss" in metrics


def test_a_balancing_loss_on_a_dense_model_is_one_line(tiny_model_path):
    with pytest.raises(ValueError, match=r"'trainer.router_aux_loss_coef' is 0.1, but .* has no router"):
        _trainer(tiny_model_path, "trainer.router_aux_loss_coef=0.1")
