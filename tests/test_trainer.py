"""The trainer's numerics without Ray: mixed precision, chunked log-probs, packing, schedules,
KL, LoRA, checkpoints. On the tiny random model, in fp32 on the CPU unless a test says otherwise."""

import math
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed as dist

from raytool.config import load_config
from raytool.training import Trainer, lr_at
from raytool.training.batching import layout, packed_micro_batches, split_across_ranks
from raytool.types import TrainBatch, Trajectory


def _trainer(path, *overrides):
    return Trainer(load_config(None, list(overrides)), path)


def _traj(uid, group, prompt, response, reward, logprobs=None):
    return Trajectory(uid=uid, group_id=group, prompt_ids=prompt, response_ids=response, response_mask=[1] * len(response),
                      rollout_logprobs=logprobs or [0.0] * len(response), messages=[], ground_truth="", reward=reward)


BATCH = [_traj("a", "g", [1, 2, 3], [5, 6, 7], 1.0), _traj("b", "g", [1, 2, 3], [8, 9], 0.0),
         _traj("c", "h", [1, 4], [5, 6, 7, 8, 9], 0.0), _traj("d", "h", [1, 4], [10, 11], 1.0)]


def test_the_trainer_receives_only_what_it_trains_on_and_each_reward_once():
    """A trajectory's TrainSequence: its tokens, the loss mask and the engine's log-probs aligned
    with the tokens after the first (observation tokens masked), nothing of its text, trace or
    reward; a TrainBatch numbers the groups and says which trajectories train."""
    from raytool.types import TIME_LIMIT, Message, TrainSequence

    t = Trajectory(uid="a", group_id="g7", prompt_ids=[1, 2, 3], response_ids=[4, 5, 6, 7], response_mask=[1, 0, 0, 1],
                   rollout_logprobs=[-0.5, 0.0, 0.0, -0.25], messages=[Message(role="user", content="a secret question")],
                   ground_truth="42", reward=1.0, turns=[{"text": "a secret trace"}])
    x = TrainSequence.of(t)
    assert (x.ids, x.mask, x.logprobs) == ([1, 2, 3, 4, 5, 6, 7], [0, 0, 1, 0, 0, 1], [0.0, 0.0, -0.5, 0.0, 0.0, -0.25])
    wire = msgspec.msgpack.encode(x)
    assert b"secret" not in wire and len(wire) < len(msgspec.msgpack.encode(t)) / 2
    late = msgspec.structs.replace(t, uid="c", finish_reason=TIME_LIMIT, reward=0.0)
    batch = TrainBatch.whole([t, msgspec.structs.replace(t, uid="b", group_id="h", reward=0.5), late])
    assert (batch.index, batch.rewards, batch.groups, batch.trained) == ([0, 1, 2], [1.0, 0.5, 0.0], [0, 1, 0], [True, True, False])


@pytest.fixture
def process_group_cleanup():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_trainer_bench_times_both_dtypes_where_the_cpu_computes_bf16(tiny_model_path, process_group_cleanup, monkeypatch):
    import time

    from raytool import device
    from raytool.bench.trainer import _bf16_vs_fp32

    monkeypatch.setattr(device, "cpu_bf16_support", lambda cpuinfo=None: (True, "avx512_bf16"))
    cfg = load_config(None, [])
    trainer = Trainer(cfg, tiny_model_path)
    assert trainer.dtype == torch.bfloat16  # auto, on a CPU that computes bf16

    def timed(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    result, rows = _bf16_vs_fp32(cfg, tiny_model_path, trainer, TrainBatch.whole(BATCH), timed, repeats=1)
    assert result["cpu_bf16_native"] and result["bf16_vs_fp32"] == result["fp32_step_s"] / result["bf16_step_s"] > 0
    assert rows[0].startswith("bf16 RL step") and "avx512_bf16" in rows[0]
    monkeypatch.setattr(device, "cpu_bf16_support", lambda cpuinfo=None: (False, "no avx512_bf16, amx_bf16 or bf16 CPU flag"))
    assert _bf16_vs_fp32(cfg, tiny_model_path, trainer, TrainBatch.whole(BATCH), timed, repeats=1) == (
        {"cpu_bf16_native": False, "bf16_vs_fp32": None},
        ["bf16_vs_fp32: not measured, this CPU has no native bf16 (no avx512_bf16, amx_bf16 or bf16 CPU flag)"])


def test_bf16_compute_with_fp32_master_weights_applies_a_tiny_update(tiny_model_path, process_group_cleanup):
    """At lr 1e-6 (the reference recipes'), a bf16 weight rounds most of an AdamW step away; the
    trainer's fp32 master weights keep it, while forward and backward still run in bf16."""
    trainer = _trainer(tiny_model_path, "trainer.compute_dtype=bfloat16", "trainer.lr=1e-6")
    # On the trainer's device (cpu), also where an accelerator is visible: FSDP2's default mesh would take that.
    assert {p.device.type for p in trainer.policy.parameters()} == {"cpu"}
    before = {n: w.clone() for n, w in trainer.named_weights()}
    assert all(w.dtype == torch.float32 for w in before.values())
    trainer.rl_step(TrainBatch.whole(BATCH))
    changed = sum(int((w != before[n]).sum()) for n, w in trainer.named_weights())
    total = sum(w.numel() for w in before.values())
    assert changed / total > 0.99

    # The same update applied to bf16 weights: almost every element rounds back to where it was.
    pure = {n: w.to(torch.bfloat16) for n, w in before.items()}
    after = {n: w.to(torch.bfloat16) for n, w in trainer.named_weights()}
    updated_bf16 = sum(int((pure[n] + (after[n].float() - before[n]).to(torch.bfloat16) != pure[n]).sum()) for n in pure)
    assert updated_bf16 / total < 0.5


def test_chunked_logprobs_match_a_full_log_softmax(tiny_model_path):
    trainer = _trainer(tiny_model_path, "trainer.logprob_chunk_tokens=3")
    seqs = [[1, 2, 3, 4, 5, 6], [1, 7, 8]]
    lay = layout(seqs, [[0, 1, 2, 3, 4], [0, 1]], trainer.pad_id, packed=False, device="cpu")
    with torch.no_grad():
        logp, ent = trainer.policy(lay.input_ids, lay.select, lay.labels, temperature=0.7, chunk_tokens=3, with_entropy=True)
        logits = trainer.lm(input_ids=torch.tensor([seqs[0]])).logits[0, :-1].float() / 0.7
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seqs[0][1:])[:, None]).squeeze(-1)
    assert torch.allclose(lay.to_grid(logp)[0], expected, atol=1e-5)
    probs = torch.softmax(logits, -1)
    assert torch.allclose(lay.to_grid(ent)[0], -(probs * probs.log()).sum(-1), atol=1e-4)


def test_packed_and_padded_micro_batches_give_the_same_update(tiny_model_path):
    """Packing (position_ids restarting per sequence) is only chosen with a varlen kernel, but
    its bookkeeping must equal padding's: same loss, same gradients (in fp32: on a CPU with native
    bf16 the auto dtype would shard the model under FSDP2 and round the gradients)."""
    results = []
    for packing in ("false", "true"):
        trainer = _trainer(tiny_model_path, f"trainer.packing={packing}", "trainer.lr=1e-2", "trainer.micro_batch_tokens=64",
                           "trainer.compute_dtype=float32")
        grads = {}
        step = trainer.optimizer.step

        def capture(*args, _t=trainer, _g=grads, _s=step, **kwargs):
            _g.update({n: p.grad.clone() for n, p in _t.lm.named_parameters()})
            return _s(*args, **kwargs)

        trainer.optimizer.step = capture
        results.append((trainer.rl_step(TrainBatch.whole(BATCH)), grads))
    (m_pad, g_pad), (m_pack, g_pack) = results
    assert math.isclose(m_pad["actor/pg_loss"], m_pack["actor/pg_loss"], abs_tol=1e-6)
    for name in g_pad:
        assert torch.allclose(g_pad[name], g_pack[name], atol=1e-5), name


def test_packed_micro_batches_fit_the_budget():
    lengths = [50, 10, 30, 60, 5, 100]
    groups = packed_micro_batches(lengths, 64)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert all(sum(lengths[i] for i in g) <= 64 or len(g) == 1 for g in groups)
    assert [sorted(lengths[i] for i in g) for g in groups] == [[100], [60], [10, 50], [5, 30]]  # first-fit decreasing


def test_packed_layouts_give_flash_attention_the_bounds_transformers_would_derive(tiny_model_path, monkeypatch):
    """With a flash-attention kernel, a packed micro-batch's sequence bounds go to transformers as
    cu_seq_lens/max_length, computed on the host; they equal what transformers would otherwise
    derive from the position ids in every layer (reading values back from the device)."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    seqs, scored = [[1, 2, 3], [4, 5], [6, 7, 8, 9]], [[0, 1], [0], [0, 1, 2]]
    lay = layout(seqs, scored, 0, packed=True, device="cpu")
    (cu_q, cu_k), (max_q, _) = prepare_fa_kwargs_from_position_ids(lay.position_ids)
    kwargs = lay.varlen_kwargs()
    assert torch.equal(kwargs["cu_seq_lens_q"], cu_q) and torch.equal(kwargs["cu_seq_lens_k"], cu_k) and kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == int(max_q) == 4
    assert layout(seqs, scored, 0, packed=False, device="cpu").varlen_kwargs() == {}

    trainer = _trainer(tiny_model_path, "trainer.packing=true", "trainer.compute_dtype=float32")
    trunk, _ = trainer.policy._parts()
    seen = []

    class Stop(Exception):
        pass

    def spy(*args, **kw):
        seen.append(kw)
        raise Stop

    monkeypatch.setattr(trunk, "forward", spy)
    for implementation in ("sdpa", "flash_attention_2"):
        monkeypatch.setattr(trainer.lm.config, "_attn_implementation", implementation)
        with pytest.raises(Stop):
            trainer.policy(lay.input_ids, lay.select, lay.labels, position_ids=lay.position_ids, varlen=kwargs)
    assert "cu_seq_lens_q" not in seen[0] and seen[1]["cu_seq_lens_q"] is kwargs["cu_seq_lens_q"] and seen[1]["max_length_k"] == 4


def test_learning_rate_schedules():
    assert [lr_at(s, 1.0, 4, 20, "constant") for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_at(4, 1.0, 4, 20, "cosine") == 1.0
    assert math.isclose(lr_at(12, 1.0, 4, 20, "cosine"), 0.5)  # half-way through the decay
    assert math.isclose(lr_at(20, 1.0, 4, 20, "cosine", min_ratio=0.1), 0.1)


def test_ranks_get_balanced_shares_of_the_batch():
    lengths = [[100, 10, 10, 10], [50, 50], [5]]
    shares = split_across_ranks(lengths, 2)
    flat = sorted((g, i) for share in shares for g, pos in share.items() for i in pos)
    assert flat == [(g, i) for g, group in enumerate(lengths) for i in range(len(group))]
    loads = [sum(lengths[g][i] for g, pos in share.items() for i in pos) for share in shares]
    assert abs(loads[0] - loads[1]) <= 10
    assert len(split_across_ranks([[7]], 4)[3]) == 0  # fewer trajectories than ranks: some ranks idle


def test_kl_to_the_reference_is_zero_then_grows(tiny_model_path):
    trainer = _trainer(tiny_model_path, "algorithm.kl_loss_coef=0.1", "algorithm.kl_reward_coef=0.05", "trainer.lr=1e-2")
    first = trainer.rl_step(TrainBatch.whole(BATCH))
    assert first["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6) and first["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    second = trainer.rl_step(TrainBatch.whole(BATCH))
    assert second["actor/kl_loss"] > 1e-6 and second["actor/reward_kl_penalty"] > 1e-6
    assert first["actor/entropy"] > 0


@pytest.mark.parametrize("fresh", [True, False])
def test_grpo_starts_from_a_fresh_optimizer_after_the_warm_up(tiny_model_path, fresh):
    """After SFT steps, start_rl drops AdamW's SFT moments (trainer.fresh_rl_optimizer, on by
    default): the first RL step then equals one taken by a trainer that never had them; and it
    freezes the warmed-up weights as the KL reference (KL 0 at the first RL step)."""
    from raytool.types import SFTExample

    sft = [SFTExample(input_ids=[1, 5, 6, 7, 8], loss_mask=[0, 0, 1, 1, 1]), SFTExample(input_ids=[1, 9, 10, 11], loss_mask=[0, 1, 1, 1])]
    overrides = ["algorithm.kl_loss_coef=0.1", "trainer.lr=1e-2", f"trainer.fresh_rl_optimizer={str(fresh).lower()}"]
    trainer = _trainer(tiny_model_path, *overrides)
    for _ in range(3):
        trainer.sft_step(sft, lr=1e-2)
    assert trainer.optimizer.state
    trainer.start_rl(snapshot_reference=True)
    assert bool(trainer.optimizer.state) is not fresh
    # the same warmed-up weights in a trainer with no optimizer history
    twin = _trainer(tiny_model_path, *overrides)
    with torch.no_grad():
        for p, q in zip(twin.policy.parameters(), trainer.policy.parameters()):
            p.copy_(q)
    twin.start_rl(snapshot_reference=True)
    metrics = trainer.rl_step(TrainBatch.whole(BATCH))
    twin.rl_step(TrainBatch.whole(BATCH))
    assert metrics["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    same = all(torch.equal(p, q) for p, q in zip(trainer.policy.parameters(), twin.policy.parameters()))
    assert same is fresh


def test_lora_trains_adapters_and_syncs_merged_weights(tiny_model_path):
    trainer = _trainer(tiny_model_path, "trainer.lora_rank=4", "trainer.lr=1e-2")
    base = {n: w.clone() for n, w in trainer.named_weights()}
    trainable = [n for n, p in trainer.lm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    trainer.rl_step(TrainBatch.whole(BATCH))
    trainer.rl_step(TrainBatch.whole(BATCH))  # lora_B starts at 0: the second step moves the merged weights
    merged = dict(trainer.named_weights())
    assert merged.keys() == base.keys()  # HF names: what the rollout engine loads
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[name], base[name])
    assert torch.equal(merged["model.norm.weight"], base["model.norm.weight"])  # no adapter: untouched


def test_4bit_is_refused_where_it_cannot_run(tiny_model_path):
    from raytool.config import ConfigError

    for overrides, why in [([], "set trainer.lora_rank"), (["trainer.lora_rank=8"], "trainer.num_gpus"),
                           (["trainer.lora_rank=8", "trainer.num_gpus=1", "cluster.accelerator=NPU"], "not cluster.accelerator NPU")]:
        with pytest.raises(ConfigError, match=f"config key 'trainer.load_in_4bit' .*{why}"):
            load_config(None, ["trainer.load_in_4bit=true", *overrides])
    with pytest.raises(ValueError, match="config key 'trainer.load_in_4bit' needs a CUDA GPU.*runs on cpu: set it false"):
        _trainer(tiny_model_path, "trainer.load_in_4bit=true", "trainer.lora_rank=4", "trainer.num_gpus=1")


def test_qlora_trains_adapters_on_an_nf4_base_and_syncs_it_dequantized_and_merged(tiny_model_path, tmp_path, monkeypatch, process_group_cleanup):
    """bitsandbytes runs NF4 on a CPU too (slowly), which lets this check the whole QLoRA path here;
    raytool itself refuses 4-bit on a CPU (the test above)."""
    from bitsandbytes.functional import dequantize_4bit
    from transformers import AutoModelForCausalLM

    from raytool.training import trainer as trainer_module
    from raytool.training.export import export_checkpoint

    monkeypatch.setattr(trainer_module, "check_4bit", lambda device: None)
    options = ("trainer.load_in_4bit=true", "trainer.num_gpus=1", "trainer.lora_rank=4", "trainer.lr=1e-2", "trainer.compute_dtype=bfloat16",
               "trainer.activation_checkpointing=true")
    trainer = _trainer(tiny_model_path, *options)
    q_proj = trainer.lm.get_base_model().model.layers[0].self_attn.q_proj
    assert q_proj.base_layer.weight.dtype == torch.uint8 and q_proj.base_layer.weight.quant_state.quant_type == "nf4"
    assert {n for n, p in trainer.lm.named_parameters() if p.requires_grad} == {n for n, _ in trainer.lm.named_parameters() if "lora_" in n}
    assert {p.dtype for p in trainer.params} == {torch.float32}
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    hf_names = {n for n, _ in hf.named_parameters()}
    for _ in range(2):  # lora_B starts at 0: the second step moves the merged weights
        metrics = trainer.rl_step(TrainBatch.whole(BATCH))
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0

    synced = dict(trainer.named_weights(torch.bfloat16))  # what weight sync sends the engine
    assert synced.keys() == hf_names and all(w.dtype == torch.bfloat16 for w in synced.values())
    name = "model.layers.0.self_attn.q_proj.weight"
    base = dequantize_4bit(q_proj.base_layer.weight.data, q_proj.base_layer.weight.quant_state).float()
    delta = (q_proj.lora_B["default"].weight @ q_proj.lora_A["default"].weight) * q_proj.scaling["default"]
    assert delta.abs().max() > 0
    assert torch.equal(synced[name], (base + delta).to(torch.bfloat16))
    original = hf.get_parameter(name).detach()
    assert float((base - original).norm() / original.norm()) < 0.15  # NF4 stands for the weight (about 10% error at 4 bits)

    # The engine's model with the synced weights computes what the trainer's 4-bit model + adapters do.
    engine = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    engine.load_state_dict(synced, strict=False)
    ids = torch.tensor([[1, 5, 9, 13, 7, 3, 22, 8]])
    with torch.no_grad():
        ours = trainer.lm(input_ids=ids).logits.float()
        theirs = engine(input_ids=ids).logits.float()
    assert float((ours - theirs).abs().max()) < 0.05 * float(ours.abs().max())

    # The checkpoint holds the adapters (the base is model_path quantized again); resume and export agree.
    trainer.save_checkpoint(tmp_path / "ckpt")
    saved = sum(f.stat().st_size for f in (tmp_path / "ckpt" / "dcp").iterdir())
    frozen = sum(p.numel() * p.element_size() for p in trainer.policy.parameters() if not p.requires_grad)
    assert saved < frozen / 10  # adapters, their AdamW moments and DCP's metadata; no base
    expected = trainer.rl_step(TrainBatch.whole(BATCH))
    resumed = _trainer(tiny_model_path, *options)
    resumed.load_checkpoint(tmp_path / "ckpt")
    got = resumed.rl_step(TrainBatch.whole(BATCH))
    assert {k: v for k, v in got.items() if not k.startswith("perf/")} == {k: v for k, v in expected.items() if not k.startswith("perf/")}
    assert all(torch.equal(w, v) for (_, w), (_, v) in zip(resumed.named_weights(), trainer.named_weights()))
    exported = dict(AutoModelForCausalLM.from_pretrained(export_checkpoint(str(tmp_path / "ckpt"), tmp_path / "hf")).named_parameters())
    trainer_after_save = _trainer(tiny_model_path, *options)
    trainer_after_save.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(exported[n], w) for n, w in trainer_after_save.named_weights())


def test_checkpoint_resumes_the_exact_same_next_step(tiny_model_path, tmp_path):
    cfg = ("trainer.lr=1e-2", "algorithm.ppo_epochs=2", "algorithm.mini_batches=2", "trainer.lr_schedule=cosine", "trainer.warmup_steps=1")
    trainer = _trainer(tiny_model_path, *cfg)
    trainer.rl_step(TrainBatch.whole(BATCH))
    trainer.save_checkpoint(tmp_path / "ckpt")
    expected = trainer.rl_step(TrainBatch.whole(BATCH))
    weights = dict(trainer.named_weights())

    resumed = _trainer(tiny_model_path, *cfg)
    resumed.load_checkpoint(tmp_path / "ckpt")
    got = resumed.rl_step(TrainBatch.whole(BATCH))  # mini-batch order comes from the restored RNG
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/ppo_kl"):
        assert got[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-9), key
    for name, w in resumed.named_weights():
        assert torch.equal(w, weights[name]), name


@pytest.mark.integration
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_two_fsdp_ranks_compute_the_single_process_gradient(tiny_model_path, tmp_path, agg):
    """torchrun with 2 ranks (FSDP2 over gloo), each on its share of the batch, vs one process on
    the whole batch: the same gradient, loss and grad norm."""
    import subprocess
    import sys
    from pathlib import Path

    script = str(Path(__file__).parent / "helpers" / "fsdp_step.py")
    torchrun = str(Path(sys.executable).parent / "torchrun")
    # one row per sequence on both sides: a rank holds part of a group, so shared-prefix trees would
    # differ from the single process's and round differently (their exactness: test_prefix_sharing.py)
    extra = [f"algorithm.loss_agg={agg}", "trainer.prefix_sharing=false"]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, script, tiny_model_path, str(tmp_path / "one.pt"), *extra], check=True, env=env, timeout=300)
    subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", script, tiny_model_path, str(tmp_path / "two.pt"), *extra],
                   check=True, env=env, timeout=300, capture_output=True)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert one["grads"].keys() == two["grads"].keys()
    for name, g in one["grads"].items():
        assert torch.allclose(g, two["grads"][name], rtol=1e-4, atol=1e-7), name
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4), key
    # The 2-rank sharded checkpoint loads in one process (another world size) with its weights.
    from transformers import AutoModelForCausalLM

    from raytool.training.export import export_checkpoint

    exported = dict(AutoModelForCausalLM.from_pretrained(export_checkpoint(str(tmp_path / "two.pt.ckpt"), tmp_path / "hf")).named_parameters())
    for name, w in two["weights"].items():
        assert torch.equal(exported[name], w), name


@pytest.mark.integration
def test_ulysses_sequence_parallelism_computes_the_single_process_update(tiny_model_path, tmp_path):
    """SP 2 over 2 gloo ranks (packed micro-batches, activation checkpointing) and SP 2 x
    data-parallel 2 over 4 ranks (padded micro-batches), vs one process without SP, all in fp32: the same
    log-probs, loss, entropy and gradient of every parameter. The tiny model has 2 query heads and
    1 KV head, so the KV head is repeated for the all-to-all."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    fp32 = ["trainer.compute_dtype=float32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = str(Path(__file__).parent / "helpers" / "fsdp_step.py")
    subprocess.run([sys.executable, script, tiny_model_path, str(tmp_path / "one.pt"), *fp32], check=True, env=env, timeout=300, capture_output=True)
    one = torch.load(tmp_path / "one.pt")
    runs = {"sp2-packed-checkpointed": (2, ["trainer.packing=true", "trainer.activation_checkpointing=true"]),
            "sp2-dp2-padded": (4, ["trainer.num_workers=4"])}
    for name, (ranks, extra) in runs.items():
        overrides = [*fp32, "trainer.sequence_parallel_size=2", "trainer.num_workers=2", *extra]
        _torchrun(script, tiny_model_path, str(tmp_path / f"{name}.pt"), *overrides, ranks=ranks)
        got = torch.load(tmp_path / f"{name}.pt")
        torch.testing.assert_close(got["logprobs"], one["logprobs"], rtol=1e-5, atol=1e-5, msg=name)
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert got["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-7), (name, key)
        for param, g in one["grads"].items():
            torch.testing.assert_close(got["grads"][param], g, rtol=1e-4, atol=1e-6, msg=f"{name}: {param}")


def test_sequence_parallelism_refuses_what_it_cannot_split(tiny_model_path):
    from raytool.config import ConfigError

    with pytest.raises(ConfigError, match="trainer.sequence_parallel_size' is 2: it must divide trainer.num_workers"):
        load_config(None, ["trainer.sequence_parallel_size=2", "trainer.num_workers=3"])
    with pytest.raises(ConfigError, match="sequence_parallel_size' > 1 runs attention in PyTorch SDPA"):
        load_config(None, ["trainer.sequence_parallel_size=2", "trainer.num_workers=2", "model.attn_implementation=flash_attention_2"])
    with pytest.raises(ConfigError, match="LoRA runs on one trainer worker"):
        load_config(None, ["trainer.sequence_parallel_size=2", "trainer.num_workers=2", "trainer.lora_rank=8"])
    from transformers import AutoConfig

    from raytool.training.sequence_parallel import check_heads

    with pytest.raises(ValueError, match="is 4, which does not divide the model's 2 attention heads"):
        check_heads(AutoConfig.from_pretrained(tiny_model_path).num_attention_heads, 4)


def _torchrun(script: str, *args: str, ranks: int = 2) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    torchrun = str(Path(sys.executable).parent / "torchrun")
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", str(ranks), str(Path(__file__).parent / "helpers" / script), *args],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, f"torchrun {script} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def _save_63m_llama(directory) -> int:
    """A 63M-parameter Llama (16 layers of width 512, tied embeddings), random, saved to `directory`: its fp32 bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=512, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=8,
                                         num_key_value_heads=4, vocab_size=1024, max_position_embeddings=512, tie_word_embeddings=True))
    model.save_pretrained(directory)
    return sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.integration
def test_only_rank_0_reads_the_checkpoint_and_the_others_hold_their_shard(tiny_model_path, tmp_path):
    """2 gloo ranks building the trainer: rank 1 builds on the meta device and receives its shards
    from rank 0, so its memory grows by about half the fp32 model, not the whole; the weights (and
    the KL reference's) equal transformers' own fp32 loading bit for bit, tied weights and rotary
    buffers included; with LoRA and activation checkpointing too."""
    import json

    fp32_bytes = _save_63m_llama(tmp_path / "model")
    runs = {"big": (str(tmp_path / "model"), []), "lora": (tiny_model_path, ["trainer.lora_rank=4", "trainer.activation_checkpointing=true"])}
    for name, (path, overrides) in runs.items():
        _torchrun("rank0_load.py", path, str(tmp_path / name), *overrides)
        ranks = [json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in (0, 1)]
        assert ranks[0]["checked"] > 0 and ranks[0]["mismatched"] == [] and ranks[0]["reference_mismatched"] == [], name
        assert all(r["buffers_equal"] for r in ranks), name
    big = [json.loads((tmp_path / f"big.rank{r}.json").read_text()) for r in (0, 1)]
    growth = [r["peak"] - r["rss_before"] for r in big]
    assert growth[0] > 0.9 * fp32_bytes  # rank 0 reads it all (the measurement sees a full load; 1.5x when nothing else runs)
    # Rank 1 holds its half; its growth is a peak (ru_maxrss) over a current RSS, so transient
    # buffers add to it: 0.67x once in a loaded full run (2026-11-28). A full read would be 0.9x or more.
    assert growth[1] < 0.8 * fp32_bytes, f"rank 1 grew by {growth[1] / fp32_bytes:.2f}x the fp32 model"


@pytest.mark.integration
def test_the_hf_export_streams_one_tensor_at_a_time_and_only_rank_0_keeps_any(tmp_path):
    """4 gloo ranks export a 63M-parameter model (242 MiB in fp32) in bf16 shards of 8 MiB: no rank's
    host memory grows by anything near the model (the 32B recipe's export gathered the whole fp32
    model on each of a node's 8 ranks: 131 GB a rank); the shards are indexed as transformers
    indexes them and hold the trainer's weights in bf16, bit for bit. Measured here: rank 0 grew by
    0.18x the fp32 model (the open shard, safetensors' serialized copy of it, the gathered tensor,
    gloo's buffers), the others by 0.10-0.14x; gathering the whole model is 1x or more."""
    import json

    fp32_bytes = _save_63m_llama(tmp_path / "model")
    _torchrun("export_peak.py", str(tmp_path / "model"), str(tmp_path / "run"), str(8 * 2**20), "model.dtype=bfloat16", ranks=4)
    ranks = [json.loads((tmp_path / f"run.rank{r}.json").read_text()) for r in range(4)]
    head = ranks[0]
    assert head["names_equal"] and head["mismatched"] == [] and head["dtypes"] == ["torch.bfloat16"] and head["config_dtype"] == "bfloat16"
    assert len(head["files"]) >= 14 and head["files"][0] == f"model-00001-of-{len(head['files']):05d}.safetensors"
    assert sorted(set(head["index"]["weight_map"].values())) == head["files"] and head["index"]["metadata"]["total_size"] == fp32_bytes // 2
    growth = [(r["peak"] - r["rss_before"]) / fp32_bytes for r in ranks]
    assert growth[0] < 0.3, f"rank 0 grew by {growth[0]:.2f}x the fp32 model during the export"  # the whole model in bf16 alone is 0.5x
    assert max(growth[1:]) < 0.25, f"the other ranks grew by {[round(g, 2) for g in growth[1:]]}x the fp32 model during the export"


def _grads(trainer, batch):
    """The update's gradients (captured before the optimizer step) and metrics."""
    grads = {}
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda: grads.update({i: p.grad.clone() for i, p in enumerate(trainer.params)})
    try:
        return trainer.rl_step(TrainBatch.whole(batch)), grads
    finally:
        trainer.optimizer.step = step


def test_asynchronous_mode_weights_each_token_by_the_truncated_trainer_engine_ratio(tiny_model_path):
    """Engine log-probs equal to the trainer's give weights of 1, the synchronous update and no
    truncation; engine log-probs far below the trainer's (a stale behaviour policy) cut every
    weight to the threshold, which scales the update by it: the gradient doubles at 2.0."""
    torch.manual_seed(0)
    probe = _trainer(tiny_model_path)
    seqs = [t.prompt_ids + t.response_ids for t in BATCH]
    exact = []
    for t, ids in zip(BATCH, seqs):
        lay = layout([ids], [list(range(len(t.prompt_ids) - 1, len(ids) - 1))], 0, packed=False, device="cpu")
        with torch.no_grad():
            logp, _ = probe.policy(lay.input_ids, lay.select, lay.labels, temperature=1.0)
        exact.append(logp.flatten().tolist())
    same = [msgspec.structs.replace(t, rollout_logprobs=lp) for t, lp in zip(BATCH, exact)]
    stale = [msgspec.structs.replace(t, rollout_logprobs=[x - 5.0 for x in lp]) for t, lp in zip(BATCH, exact)]
    asynchronous = ["async.max_staleness=1", "async.partial_rollout=wait", "trainer.grad_clip=1e9"]  # gradients as computed, not clipped
    sync_metrics, sync_grads = _grads(_trainer(tiny_model_path, "trainer.grad_clip=1e9"), same)
    metrics, grads = _grads(_trainer(tiny_model_path, *asynchronous), same)
    assert metrics["rollout_corr/is_mean"] == pytest.approx(1.0, abs=1e-4) and metrics["rollout_corr/is_truncated_frac"] == 0.0
    assert "rollout_corr/is_mean" not in sync_metrics
    for i in sync_grads:
        torch.testing.assert_close(grads[i], sync_grads[i], rtol=1e-3, atol=1e-7)
    metrics, grads = _grads(_trainer(tiny_model_path, *asynchronous), stale)
    assert metrics["rollout_corr/is_truncated_frac"] == 1.0 and metrics["rollout_corr/is_mean"] == pytest.approx(2.0)
    assert metrics["rollout_corr/mismatch_k1"] == pytest.approx(-5.0, abs=1e-3)
    for i in sync_grads:
        torch.testing.assert_close(grads[i], 2.0 * sync_grads[i], rtol=1e-3, atol=1e-7)


def _grads_at_step(trainer):
    """Every gradient as the optimizer step sees it (clipped), filled in at that step."""
    grads = {}
    step = trainer.optimizer.step

    def capture(*args, **kwargs):
        grads.update({n: p.grad.clone() for n, p in trainer.lm.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    return grads


@pytest.mark.parametrize("overrides", [[], ["algorithm.kl_loss_coef=0.1", "algorithm.kl_reward_coef=0.05", "algorithm.mini_batches=2",
                                            "trainer.activation_checkpointing=true", "trainer.logprob_chunk_tokens=4"]])
def test_the_micro_batch_loop_reads_nothing_back_from_the_device(tiny_model_path, process_group_cleanup, monkeypatch, overrides):
    """On a GPU a read of a device value (.item(), float(t), bool(t), .tolist(), .cpu()) waits for
    every queued kernel, so the host cannot queue micro-batch k+1 while micro-batch k runs. None
    may happen in the micro-batch loop (each micro-step, and the log-prob passes for KL and
    mini-batches): not in raytool's code, nor in the model's forward and backward (transformers' "sdpa" asks whether position ids are packed on every
    forward; the padded layout runs its causal SDPA under a name without that check). Host-to-device
    copies are pinned and non-blocking: `tests/test_gpu.py` checks the same loop under CUDA's sync
    debug mode."""
    trainer = _trainer(tiny_model_path, *overrides)
    reads = []
    names = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def spy(name):
        def read(self, *args, **kwargs):
            reads.append(name)
            return saved[name](self, *args, **kwargs)
        return read

    def guarded(method):
        def run(*args, **kwargs):
            for n in names:
                monkeypatch.setattr(torch.Tensor, n, spy(n))
            try:
                return method(*args, **kwargs)
            finally:
                for n in names:
                    monkeypatch.setattr(torch.Tensor, n, saved[n])
        return run

    calls = []
    for method in ("_rl_micro_step", "_fill"):
        original = getattr(trainer, method)
        monkeypatch.setattr(trainer, method, guarded(lambda *a, _m=original, _n=method, **k: (calls.append(_n), _m(*a, **k))[1]))
    metrics = trainer.rl_step(TrainBatch.whole(BATCH))
    assert reads == [] and math.isfinite(metrics["actor/pg_loss"])
    assert calls.count("_rl_micro_step") >= 1 and ("_fill" in calls) == bool(overrides)


def test_the_old_policy_pass_is_the_updates_own_forward_and_gives_the_same_update(tiny_model_path):
    """One mini-batch, one epoch: the policy cannot change between the old log-probs and the update,
    so they are the update's own forward (no separate pass, as the test above counts). Computed by a
    separate pass instead, the update is the same: loss, gradient norm and every weight."""
    a, b = _trainer(tiny_model_path), _trainer(tiny_model_path)
    own, micro = b._own_sequences, b._rl_micro_step

    def with_an_old_pass(*args):
        index, seqs, routes = own(*args)
        b._fill(seqs, "old", b.policy)
        return index, seqs, routes

    b._own_sequences = with_an_old_pass
    b._rl_micro_step = lambda group, on_policy, *rest: micro(group, False, *rest)
    shortcut, separate = a.rl_step(TrainBatch.whole(BATCH)), b.rl_step(TrainBatch.whole(BATCH))
    assert shortcut["actor/pg_loss"] != 0.0
    assert shortcut["actor/pg_loss"] == pytest.approx(separate["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert shortcut["actor/grad_norm"] == pytest.approx(separate["actor/grad_norm"], rel=1e-5)
    for (name, p), (_, q) in zip(a.policy.named_parameters(), b.policy.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_layers_and_head_give_the_eager_update(tiny_model_path):
    """trainer.compile: each decoder layer and the log-prob chunk run as inductor code (here the
    C++ backend), with activation checkpointing and the head's chunks recomputed in backward; the
    loss, entropy and every gradient equal eager's (fp32), and switching back runs eager again."""
    from torch._dynamo.utils import counters

    from raytool.training.model import _chunk_logprobs

    overrides = ("trainer.compute_dtype=float32", "trainer.activation_checkpointing=true", "trainer.logprob_chunk_tokens=4", "trainer.lr=1e-2")
    eager = _trainer(tiny_model_path, *overrides)
    compiled = _trainer(tiny_model_path, *overrides, "trainer.compile=true")
    captured = counters["stats"]["calls_captured"]
    g_eager, g_compiled = _grads_at_step(eager), _grads_at_step(compiled)
    m_eager, m_compiled = eager.rl_step(TrainBatch.whole(BATCH)), compiled.rl_step(TrainBatch.whole(BATCH))
    assert counters["stats"]["calls_captured"] > captured  # dynamo traced the layers and the head
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert math.isclose(m_eager[key], m_compiled[key], rel_tol=1e-5, abs_tol=1e-7), key
    assert g_eager.keys() == g_compiled.keys() and len(g_eager) > 0
    for name, g in g_eager.items():
        assert torch.allclose(g, g_compiled[name], rtol=1e-4, atol=1e-6), name
    trunk, _ = compiled.policy._parts()
    assert all("forward" in layer.__dict__ for layer in trunk.layers) and compiled.policy.chunk_logprobs is not _chunk_logprobs
    compiled.policy.set_compiled(False)
    assert not any("forward" in layer.__dict__ for layer in trunk.layers) and compiled.policy.chunk_logprobs is _chunk_logprobs

    # `raytool bench trainer`'s comparison switches the same trainer both ways and leaves it as configured
    from raytool.bench.trainer import _compile_vs_eager

    compiled.policy.set_compiled(True)
    steps = []
    result, rows = _compile_vs_eager(compiled, TrainBatch.whole(BATCH), 40, lambda fn: (steps.append(fn()), 0.25 if len(steps) % 2 else 0.5)[1], repeats=2)
    assert len(steps) == 5 and all(math.isfinite(m["actor/pg_loss"]) for m in steps)
    assert result == {"compile_vs_eager": 2.0, "compiled_tokens_per_s": 160.0, "eager_tokens_per_s": 80.0}
    assert rows[0].startswith("compiled RL step 0.250 s, eager 0.500 s: compile_vs_eager = 2.00")
    assert "forward" in trunk.layers[0].__dict__


def test_fused_kernels_take_the_place_of_every_layers_norms_mlp_and_the_rotary_embedding(tiny_model_path, tmp_path):
    """trainer.kernels: Liger-Kernel's RMSNorm, SwiGLU MLP and RoPE replace the model's own on every
    layer and the final norm, with and without LoRA adapters. Only which modules are replaced is
    checked here: the Triton kernels run on CUDA GPUs only (Triton's CPU interpreter fails on Liger
    0.8.5's scalar arguments), so their numerical equality to the eager step is tests/test_gpu.py's.
    In a process of its own: the RoPE patch is module-wide in transformers."""
    import json
    import subprocess
    import sys

    pytest.importorskip("liger_kernel", reason="Liger-Kernel is not installed (raytool[gpu]; scripts/setup.sh installs it but on NPU nodes)")
    helper = Path(__file__).parent / "helpers" / "fused_kernels.py"
    done = subprocess.run([sys.executable, str(helper), "modules", tiny_model_path], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    for name in ("plain", "lora"):
        assert result[name] == {"mlp": "LigerSwiGLUMLP.forward", "input_layernorm": "LigerRMSNorm.forward", "final_norm": "LigerRMSNorm.forward",
                                "layers": 2, "patched_layers": 2}, name
    assert result["rope"] == "liger_kernel.transformers.rope"

    from raytool.training.trainer import check_kernels

    check_kernels(torch.device("cuda"), tiny_model_path)  # llama: Liger has kernels for it (no GPU is touched)
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="'trainer.kernels': Liger-Kernel has no kernels for model type 'gpt2'"):
        check_kernels(torch.device("cuda"), str(tmp_path / "gpt2"))


def test_fused_kernels_are_off_by_default_and_refused_where_they_cannot_run(tiny_model_path, monkeypatch):
    import importlib.util

    from raytool.config import ConfigError
    from raytool.planner import architecture, resolve_auto
    from raytool.training.trainer import check_kernels

    for overrides, words in ((["cluster.accelerator=NPU", "trainer.num_gpus=1"], "not NPUs"), ([], "the trainer runs on CPUs")):
        with pytest.raises(ConfigError, match=f"'trainer.kernels' .*{words}"):
            load_config(None, ["trainer.kernels=true", *overrides])
    with pytest.raises(ValueError, match="'trainer.kernels' needs a CUDA GPU .* this trainer runs on cpu"):
        check_kernels(torch.device("cpu"), tiny_model_path)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"'trainer.kernels' needs Liger-Kernel: pip install 'raytool\[gpu\]'"):
        check_kernels(torch.device("cuda"), tiny_model_path)
    arch = architecture(tiny_model_path)
    for on_accelerator, why in ((True, "Liger-Kernel's fused kernels are not yet measured to pay on a GPU"), (False, "on a CPU")):
        cfg, notes = resolve_auto(load_config(None, ["trainer.num_gpus=1"] if on_accelerator else []), arch, on_accelerator, 80 * 2**30)
        assert cfg.trainer.kernels is False and f"trainer.kernels auto: off ({why}" in notes[-1]


def test_compile_is_refused_where_it_cannot_run(tiny_model_path):
    from raytool.config import ConfigError

    for overrides, words in ((["cluster.accelerator=NPU", "trainer.num_gpus=1"], "no NPU backend"),
                             (["trainer.num_workers=2", "trainer.sequence_parallel_size=2"], "sequence parallelism"),
                             (["trainer.load_in_4bit=true", "trainer.lora_rank=8", "trainer.num_gpus=1"], "4-bit")):
        with pytest.raises(ConfigError, match=f"'trainer.compile' .*{words}"):
            load_config(None, ["trainer.compile=true", *overrides])
    with pytest.raises(ValueError, match="'trainer.compile': inductor compiles for CUDA GPUs and CPUs, not meta"):
        Trainer(load_config(None, ["trainer.compile=true"]), tiny_model_path, device="meta")


def test_the_trainer_bench_times_the_plain_loop_at_the_largest_budget_that_fits():
    """On a GPU the plain loop's full logits may not fit raytool's 16k-token micro-batches: the bench
    halves its budget after each out-of-memory error and reports the one it timed."""
    from raytool.bench.trainer import largest_that_fits

    tried, resets = [], []

    def run(budget):
        tried.append(budget)
        if budget > 4096:
            raise torch.OutOfMemoryError("CUDA out of memory")

    assert largest_that_fits(run, 16384, lambda: resets.append(1)) == 4096
    assert tried == [16384, 8192, 4096] and len(resets) == 2
    with pytest.raises(torch.OutOfMemoryError):
        largest_that_fits(run, 16384, lambda: None, floor=8192)


def test_a_plain_loop_out_of_memory_in_the_timed_steps_keeps_the_trainer_bench_figures(tiny_model_path, process_group_cleanup, monkeypatch):
    """The plain loop's warm-up fits but a timed step runs out of memory (on an H100, next to
    raytool's trainer): the plain loop is reported as not measured, raytool's figures stand."""
    from raytool.bench import trainer as trainer_bench

    plain_steps = []

    def plain_step(*args):
        plain_steps.append(args)
        if len(plain_steps) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(trainer_bench, "_plain_step", plain_step)
    monkeypatch.setattr(trainer_bench, "_batch", lambda *args: BATCH)  # a unit test's batch, not the bench's
    monkeypatch.setattr(trainer_bench, "_bf16_vs_fp32", lambda *args: ({}, []))  # each times its own steps, not this behaviour
    monkeypatch.setattr(trainer_bench, "_compile_vs_eager", lambda *args: ({}, []))
    table, result = trainer_bench.bench(load_config(None, [f"model.path={tiny_model_path}"]), repeats=1)
    assert len(plain_steps) == 2 and result["trainer_tokens_per_s"] > 0
    assert result["plain_tokens_per_s"] is None and result["trainer_vs_plain"] is None and result["plain_micro_batch_tokens"] == 4096
    assert "plain HF loop: not measured, out of memory at 4096-token micro-batches" in table and "trainer_vs_plain" not in table


def test_a_mixture_of_experts_trains_and_exports_its_experts_one_by_one(tmp_path):
    """tiny-random-moe (Qwen3-MoE, 4 experts, 2 per token) in the trainer: one RL step moves the
    experts and the router, and the HF export holds the checkpoint's layout (experts.N.gate_proj,
    as the original and vLLM have it, not transformers' fused in-memory tensors) with the trained weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from raytool.models import resolve_model

    path = resolve_model("tiny-random-moe")
    trainer = _trainer(path, "trainer.lr=1e-2")
    before = {name: w.clone() for name, w in trainer.named_weights()}
    metrics = trainer.rl_step(TrainBatch.whole(BATCH))
    assert math.isfinite(metrics["actor/grad_norm"]) and metrics["actor/grad_norm"] > 0
    after = dict(trainer.named_weights())
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.gate.weight"):
        assert not torch.equal(before[name], after[name]), name
    exported = trainer.export_hf(tmp_path / "hf")
    written, original = load_file(Path(exported) / "model.safetensors"), load_file(Path(path) / "model.safetensors")
    assert sorted(written) == sorted(original) and "model.layers.1.mlp.experts.3.up_proj.weight" in written
    reloaded = dict(AutoModelForCausalLM.from_pretrained(exported).named_parameters())
    for name, w in after.items():
        assert torch.equal(reloaded[name], w), name


def test_a_non_finite_reward_or_gradient_skips_the_update_and_non_finite_weights_are_never_saved(tiny_model_path, tmp_path):
    """verl skips an update whose gradient norm is not finite, and says so; a NaN reward used to
    train the model into NaN and announce it as the final model."""
    from raytool.training.trainer import NonFiniteWeights

    trainer = _trainer(tiny_model_path, "trainer.lr=1e-2")
    before = {name: w.clone() for name, w in trainer.named_weights()}
    nan_reward = [_traj("a", "g", [1, 2, 3], [5, 6, 7], float("nan")), *BATCH[1:]]
    out = trainer.rl_step(TrainBatch.whole(nan_reward))
    assert out["actor/skipped_updates"] == 1.0 and out["actor/nonfinite_reward"] == 1.0
    assert all(torch.equal(w, before[name]) for name, w in trainer.named_weights())

    original = trainer._rl_micro_step

    def poisoned(*args, **kwargs):  # a loss that went NaN: every gradient NaN
        original(*args, **kwargs)
        for p in trainer.params:
            if p.grad is not None:
                p.grad.fill_(float("nan"))

    trainer._rl_micro_step = poisoned
    out = trainer.rl_step(TrainBatch.whole(BATCH))
    assert out["actor/skipped_updates"] == 1.0 and math.isnan(out["actor/grad_norm"])
    assert all(torch.equal(w, before[name]) for name, w in trainer.named_weights())
    trainer._rl_micro_step = original
    assert trainer.rl_step(TrainBatch.whole(BATCH))["actor/skipped_updates"] == 0.0  # a finite batch trains again
    assert not all(torch.equal(w, before[name]) for name, w in trainer.named_weights())
    trainer.save_checkpoint(tmp_path / "finite")

    with torch.no_grad():
        next(iter(trainer.params)).view(-1)[0] = float("inf")
    for write in (lambda: trainer.save_checkpoint(tmp_path / "poisoned"), lambda: trainer.export_hf(tmp_path / "hf")):
        with pytest.raises(NonFiniteWeights, match="non-finite values .* on rank 0"):
            write()
    assert not (tmp_path / "poisoned").exists() and not (tmp_path / "hf").exists()


def test_the_driver_names_the_rows_of_a_skipped_update_and_stops_after_too_many_in_a_row(caplog):
    from raytool.training.guard import SkippedUpdates, UpdateGuard

    guard = UpdateGuard(2)
    rows = [("train.parquet row 3 (0-based) (data source openai/gsm8k)", float("nan")), ("train.parquet row 4 (0-based)", 1.0)]
    guard.after_step(1, {"actor/skipped_updates": 1.0, "actor/nonfinite_reward": 1.0}, rows)
    assert "step 1: 1 update skipped, the weights left as they were: non-finite rewards from train.parquet row 3 (0-based)" in caplog.text
    guard.after_step(2, {"actor/skipped_updates": 0.0}, rows)  # a trained step ends the run of skips
    guard.after_step(3, {"actor/skipped_updates": 2.0, "actor/grad_norm": float("nan")}, [("r", 1.0)])
    assert "step 3: 2 updates skipped" in caplog.text and "non-finite loss or gradient norm" in caplog.text
    with pytest.raises(SkippedUpdates, match=r"^2 GRPO steps in a row skipped their update \(trainer.max_skipped_steps=2\); step 4"):
        guard.after_step(4, {"actor/skipped_updates": 1.0}, rows)


def test_distillation_trains_each_token_on_the_teachers_word_on_it(tiny_model_path):
    """distill.teacher: each trained token's advantage is -(log p_student - log p_teacher), so the
    update's gradient is that of -(1/N) sum_t A_t log p_t (on-policy, token-mean); a teacher that
    agrees with the student everywhere gives no gradient at all; a masked observation token gets none."""
    fp32 = "trainer.compute_dtype=float32"  # exact comparisons: not bf16, which a CPU with native bf16 would pick
    probe = _trainer(tiny_model_path, fp32)
    batch = [*BATCH[:3], msgspec.structs.replace(BATCH[3], response_ids=[10, 11, 12], response_mask=[1, 0, 1], rollout_logprobs=[0.0] * 3)]
    exact = []
    for t in batch:
        ids = t.prompt_ids + t.response_ids
        lay = layout([ids], [list(range(len(t.prompt_ids) - 1, len(ids) - 1))], 0, packed=False, device="cpu")
        with torch.no_grad():
            logp, _ = probe.policy(lay.input_ids, lay.select, lay.labels, temperature=1.0)
        exact.append([lp * m for lp, m in zip(logp.flatten().tolist(), t.response_mask)])
    gen = torch.Generator().manual_seed(0)
    gaps = [(torch.rand(len(lp), generator=gen) * 2 - 1).tolist() for lp in exact]  # log p_student - log p_teacher per token
    student = [msgspec.structs.replace(t, rollout_logprobs=lp) for t, lp in zip(batch, exact)]
    taught = [msgspec.structs.replace(t, teacher_logprobs=[(s - g) * m for s, g, m in zip(lp, gap, t.response_mask)])
              for t, lp, gap in zip(student, exact, gaps)]
    distill = ["distill.teacher=tiny-random", "distill.kl_coef=0.5", "trainer.grad_clip=1e9", fp32]
    metrics, grads = _grads(_trainer(tiny_model_path, *distill), taught)
    tokens = sum(sum(t.response_mask) for t in batch)
    kl = sum(g * m for t, gap in zip(batch, gaps) for g, m in zip(gap, t.response_mask)) / tokens
    assert metrics["distill/reverse_kl"] == pytest.approx(kl, abs=1e-5)

    manual = _trainer(tiny_model_path, fp32)
    loss = 0.0
    for t, gap in zip(batch, gaps):
        ids = t.prompt_ids + t.response_ids
        lay = layout([ids], [list(range(len(t.prompt_ids) - 1, len(ids) - 1))], 0, packed=False, device="cpu")
        logp, _ = manual.policy(lay.input_ids, lay.select, lay.labels, temperature=1.0)
        adv = torch.tensor([-0.5 * g * m for g, m in zip(gap, t.response_mask)])
        loss = loss - (adv * logp.flatten()).sum() / tokens
    loss.backward()
    for i, p in enumerate(manual.params):
        torch.testing.assert_close(grads[i], p.grad, rtol=1e-4, atol=2e-6)  # one padded batch against one row at a time

    agreeing = [msgspec.structs.replace(t, teacher_logprobs=list(t.rollout_logprobs)) for t in student]
    metrics, grads = _grads(_trainer(tiny_model_path, *distill), agreeing)
    assert metrics["distill/reverse_kl"] == 0.0 and all(float(g.abs().max()) == 0.0 for g in grads.values())
    with pytest.raises(ValueError, match="no teacher log-probs"):
        _trainer(tiny_model_path, *distill).rl_step(TrainBatch.whole(student))

