"""`raytool bench trl`: raytool's GRPO step against TRL's `GRPOTrainer` on the same work, in one run.

Both train the run config's model from the same weights on the task's training prompts (as chat
messages, with the agent's system prompt), `data.prompts_per_step` prompts x `rollout.n` samples
per step, one assistant turn of at most `max_new_tokens` tokens sampled at `rollout.temperature`
(top-p 1), scored by the same reward (`score`: the last \\boxed{} against the answer, plus a small
dense term so that a group's rewards vary and both train every step), with the same learning
rate, clip range, gradient clip, token-mean loss, group-normalised advantages, no KL term, one
update per batch, in the same compute dtype, on the CPU (TRL with `use_cpu`: the comparison of
issue 57). TRL runs as it does out of the box (its own `model.generate`); raytool as it runs (its
rollout server, its trainer, the weight sync).

The rounds alternate in one process: TRL's training loop calls raytool's step after each of its own
(a `TrainerCallback`), so that a noisy machine slows both alike. The first step of each is a
warm-up, not timed. Reported: each one's step time (median), the tokens it trained per second
(prompt and completion of every sample), `raytool_vs_trl` (raytool's step time over TRL's: below 1
is faster), and raytool's trainer tokens per step with and without shared prefixes.

TRL is an optional extra (`pip install 'raytool[trl]'`), not in the default install.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import msgspec
import torch

from actors.drivers.compose import build
from actors.drivers.pipeline import connect, grpo_step, rollout_stream
from raytool.config import RunConfig
from raytool.data import PromptLoader
from raytool.data.prompts import with_system_prompt
from raytool.data.task import load_task
from raytool.errors import RaytoolError
from raytool.models import resolve_model
from raytool.rewards.math import judge, last_boxed
from raytool.training.trainer import compute_dtype

MAX_NEW_TOKENS = 64


def score(text: str, ground_truth: str) -> float:
    """The bench's reward: 1 for the right boxed answer, plus 0.01 per digit written (at most 10
    counted): an untrained model rarely boxes the answer within a few dozen tokens, and a group
    whose rewards are all equal trains nothing (raytool skips it; TRL runs it for no change)."""
    digits = min(sum(c.isdigit() for c in text), 10)
    return float(judge(last_boxed(text), ground_truth, verifier=None)["acc"]) + 0.01 * digits


def raytool_reward(view: dict, ground_truth: str, extra: dict) -> float:
    """`score` as raytool's reward workers call it (reward.fn = this file:raytool_reward)."""
    return score(view["response"], ground_truth)


def same_work(cfg: RunConfig, max_new_tokens: int = MAX_NEW_TOKENS) -> RunConfig:
    """`cfg` as the work TRL can do too: one turn of at most `max_new_tokens`, the bench's reward,
    no KL, one update per batch, no warm-up, the synchronous loop."""
    replace = msgspec.structs.replace
    return replace(
        cfg,
        agent=replace(cfg.agent, max_turns=1, max_response_tokens=max_new_tokens),
        rollout=replace(cfg.rollout, max_tokens_per_turn=max_new_tokens, top_p=1.0, top_k=-1),
        reward=replace(cfg.reward, fn=f"{Path(__file__).resolve()}:raytool_reward"),
        algorithm=replace(cfg.algorithm, kl_loss_coef=0.0, kl_reward_coef=0.0, ppo_epochs=1, mini_batches=1, loss_agg="token-mean",
                          entropy_coeff=0.0),
        trainer=replace(cfg.trainer, sft_warmup_steps=0),
        async_=replace(cfg.async_, max_staleness=0),
    )


def trl_reward(completions: list, ground_truth: list[str], **_) -> list[float]:
    """`score` as TRL calls a reward function: each completion (its messages, or its text) with its row's answer."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [score(text, truth) for text, truth in zip(texts, ground_truth)]


def trl_config(cfg: RunConfig, out_dir: str, steps: int, bf16: bool):
    """TRL's GRPOConfig for the same work as `cfg` (after `same_work`)."""
    from trl import GRPOConfig

    a, t = cfg.algorithm, cfg.trainer
    return GRPOConfig(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=cfg.data.prompts_per_step * cfg.rollout.n,
        gradient_accumulation_steps=1, num_generations=cfg.rollout.n, max_completion_length=cfg.rollout.max_tokens_per_turn,
        temperature=cfg.rollout.temperature, top_p=1.0, learning_rate=t.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=t.weight_decay, max_grad_norm=t.grad_clip, beta=0.0, epsilon=a.clip_ratio_low, epsilon_high=a.clip_ratio_high,
        loss_type="dapo", scale_rewards="group" if a.norm_adv_by_std else "none", num_iterations=1, use_cpu=True, bf16=bf16,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, seed=t.seed,
    )


def bench(cfg: RunConfig, steps: int = 3) -> tuple[str, dict]:
    try:
        import datasets
        from transformers import TrainerCallback
        from trl import GRPOTrainer
    except ImportError as exc:
        raise RaytoolError(f"raytool bench trl needs TRL: pip install 'raytool[trl]' ({exc})") from None
    cfg = same_work(cfg)
    model_path = resolve_model(cfg.model.path)
    task = load_task(cfg)
    rows = [{"prompt": [msgspec.to_builtins(m) for m in with_system_prompt(r.prompt, cfg.agent.system_prompt)], "ground_truth": r.ground_truth}
            for r in task.train]
    connect(cfg.cluster.address)
    graph = build(cfg, model_path)
    ours: list[dict] = []
    theirs: list[float] = []
    tokens: list[float] = []

    class Alternate(TrainerCallback):
        """After each of TRL's steps (timed from its start), one of raytool's."""

        def __init__(self, stream):
            self.stream, self.started, self.step = stream, 0.0, 0

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            theirs.append(time.perf_counter() - self.started)
            self.step += 1
            metrics, _ = grpo_step(graph, self.stream, self.step)
            ours.append(metrics)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "num_tokens" in logs:
                tokens.append(float(logs["num_tokens"]))

    try:
        stream = rollout_stream(graph, cfg, PromptLoader(task.train, cfg.data.prompts_per_step, seed=cfg.data.seed))
        bf16 = compute_dtype(cfg.trainer.compute_dtype, torch.device("cpu")) == torch.bfloat16  # TRL on the CPU, as raytool's trainer here
        with tempfile.TemporaryDirectory(prefix="raytool-bench-trl-") as out:
            trainer = GRPOTrainer(model=model_path, reward_funcs=trl_reward, args=trl_config(cfg, out, steps + 1, bf16),
                                  train_dataset=datasets.Dataset.from_list(rows), callbacks=[Alternate(stream)])
            trainer.train()
        stream.drain()
    finally:
        graph.shutdown()
    return report(cfg, ours, theirs, tokens, bf16)


def report(cfg: RunConfig, ours: list[dict], theirs: list[float], tokens: list[float], bf16: bool) -> tuple[str, dict]:
    """The table and result from the per-step figures, the first step of each left out (warm-up).
    `tokens`: TRL's running count of the tokens it trained on, after each step."""
    if len(ours) < 2 or len(theirs) < 2:
        raise RaytoolError("raytool bench trl: fewer than two steps ran; nothing to time after the warm-up")
    ours_s = statistics.median(m["timing/step_s"] for m in ours[1:])
    theirs_s = statistics.median(theirs[1:])
    ours_tokens = statistics.mean(m["perf/update_tokens"] for m in ours[1:])
    theirs_tokens = (tokens[-1] - tokens[0]) / (len(tokens) - 1) if len(tokens) > 1 else float("nan")
    row_tokens = statistics.mean(m["perf/update_row_tokens"] for m in ours[1:])
    unshared = statistics.mean(m["perf/update_row_tokens_unshared"] for m in ours[1:])
    result = {
        "raytool_vs_trl": ours_s / theirs_s, "raytool_step_s": ours_s, "trl_step_s": theirs_s,
        "raytool_tokens_per_s": ours_tokens / ours_s, "trl_tokens_per_s": theirs_tokens / theirs_s,
        "raytool_train_s": statistics.median(m["timing/train_s"] for m in ours[1:]),
        "raytool_rollout_s": statistics.median(m["timing/rollout_s"] for m in ours[1:]),
        "trainer_row_tokens_per_step": row_tokens, "trainer_row_tokens_unshared": unshared,
        "shared_vs_unshared_tokens": row_tokens / unshared if unshared else None,
        "steps_timed": len(theirs) - 1, "compute_dtype": "bfloat16" if bf16 else "float32", "model": cfg.model.path,
        "prompts_x_samples": [cfg.data.prompts_per_step, cfg.rollout.n], "max_new_tokens": cfg.rollout.max_tokens_per_turn,
    }
    lines = [
        f"trl bench: {cfg.model.path}, {cfg.data.prompts_per_step} prompts x {cfg.rollout.n} samples, at most "
        f"{cfg.rollout.max_tokens_per_turn} new tokens, {result['compute_dtype']}, {len(theirs) - 1} timed steps each (alternating)",
        f"{'':10}{'step s':>9}{'tokens/s':>10}",
        f"{'TRL':10}{theirs_s:>9.2f}{result['trl_tokens_per_s']:>10.0f}",
        f"{'raytool':10}{ours_s:>9.2f}{result['raytool_tokens_per_s']:>10.0f}   (rollout {result['raytool_rollout_s']:.2f} s, "
        f"train {result['raytool_train_s']:.2f} s)",
        f"raytool_vs_trl {result['raytool_vs_trl']:.2f} (step time; below 1: raytool is faster)",
        f"trainer tokens per step: {row_tokens:.0f} with shared prefixes, {unshared:.0f} without"
        + (f" ({result['shared_vs_unshared_tokens']:.2f}x)" if unshared else ""),
    ]
    return "\n".join(lines), result
