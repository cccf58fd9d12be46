"""`raytool bench pipeline`: the synchronous loop against the asynchronous one on the same workload.

One graph (the run config's engine, sandbox, reward and trainer), one process. The sandbox adds a
long-tailed latency to every cell (lognormal, median 0.3 s, p95 2 s, unless the config sets one):
time in which a synchronous step's engine and trainer both wait. After the config's SFT warm-up
the trainer's state is saved; every segment (one mode, `steps` + 1 GRPO steps) starts from it and
from the same prompts, and the modes alternate (sync, async 1, async 2, sync, ...) so that drift
hits all alike. A segment's first step is not timed (an asynchronous stream starts empty); its
groups still running at the end are drained before the next segment, untimed.

Reported per mode: step time, the time the trainer waited for a batch, training and weight-sync
time, `trainer/idle_ratio`, `rollout/idle_ratio`, token staleness. From the synchronous steps:
the ideal asynchronous step, max(generation, training + sync), and
- async_vs_sync: the best asynchronous mode's step time / the synchronous step time (goal <= 0.77);
- async_vs_ideal: the ideal step time / that asynchronous step time, the share of the ideal
  speed-up achieved (goal >= 0.7).
"""

from __future__ import annotations

import random
import tempfile

import msgspec

from actors.drivers.compose import build
from actors.drivers.pipeline import connect, grpo_step, rollout_stream, run_sft_warmup, warmup_examples
from raytool.config import RunConfig
from raytool.data import PromptLoader
from raytool.data.task import load_task
from raytool.models import load_tokenizer, resolve_model

MODES = (0, 1, 2)  # async.max_staleness of each segment (0: the synchronous loop)


def _with_bench_settings(cfg: RunConfig) -> RunConfig:
    s = cfg.sandbox
    if not s.added_latency_median_s:
        s = msgspec.structs.replace(s, added_latency_median_s=0.3, added_latency_p95_s=2.0)
    return msgspec.structs.replace(cfg, sandbox=s, async_=msgspec.structs.replace(cfg.async_, max_staleness=max(MODES)))


def _segment(graph, cfg: RunConfig, loader: PromptLoader, k: int, steps: int) -> list[dict]:
    stream = rollout_stream(graph, msgspec.structs.replace(cfg, async_=msgspec.structs.replace(cfg.async_, max_staleness=k)), loader)
    timed = []
    for step in range(1, steps + 2):
        metrics, _ = grpo_step(graph, stream, step)
        if step > 1:
            timed.append(metrics)
    stream.drain()
    return timed


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def bench(cfg: RunConfig, steps: int = 3, repeats: int = 2) -> tuple[str, dict]:
    cfg = _with_bench_settings(cfg)
    model_path = resolve_model(cfg.model.path)
    task = load_task(cfg)
    connect(cfg.cluster.address)
    graph = build(cfg, model_path)
    rows: dict[int, list[dict]] = {k: [] for k in MODES}
    try:
        if cfg.trainer.sft_warmup_steps:
            run_sft_warmup(graph, cfg, warmup_examples(cfg, task, load_tokenizer(model_path), random.Random(cfg.trainer.seed)), None)
        with tempfile.TemporaryDirectory(prefix="raytool-bench-pipeline-") as start:
            graph.trainer.save_checkpoint(start)
            loader = PromptLoader(task.train, cfg.data.prompts_per_step, seed=cfg.data.seed)
            first = loader.state_dict()
            for _ in range(repeats):
                for k in MODES:
                    graph.trainer.load_checkpoint(start)
                    graph.publish_weights()
                    loader.load_state_dict(first)
                    timed = _segment(graph, cfg, loader, k, steps)
                    rows[k] += timed
    finally:
        graph.shutdown()
    return _report(cfg, rows, steps, repeats)


def _report(cfg: RunConfig, rows: dict[int, list[dict]], steps: int, repeats: int) -> tuple[str, dict]:
    per_mode = {}
    for k, timed in rows.items():
        per_mode[k] = {
            "step_s": _mean(timed, "timing/step_s"),
            "wait_s": _mean(timed, "timing/rollout_s"),
            "train_s": _mean(timed, "timing/train_s"),
            "sync_s": _mean(timed, "timing/weight_sync_s"),
            "trainer_idle_ratio": _mean(timed, "trainer/idle_ratio"),
            "rollout_idle_ratio": _mean(timed, "rollout/idle_ratio"),
            "staleness_token_mean": _mean(timed, "staleness/token_mean"),
            "staleness_token_max": max(r["staleness/token_max"] for r in timed),
            "dropped_stale": sum(r["rollout/groups_dropped_stale"] for r in timed),
            "trained_seq_frac": 1.0 - _mean(timed, "actor/skipped_seq_frac"),  # training time follows it: all-equal groups are skipped
        }
    sync = per_mode[0]
    ideal_s = max(sync["wait_s"], sync["train_s"] + sync["sync_s"])  # in the synchronous loop the wait is the generation time
    best = min((k for k in MODES if k), key=lambda k: per_mode[k]["step_s"])
    result = {
        "async_vs_sync": per_mode[best]["step_s"] / sync["step_s"],
        "async_vs_ideal": ideal_s / per_mode[best]["step_s"],
        "ideal_step_s": ideal_s,
        "ideal_vs_sync": ideal_s / sync["step_s"],
        "best_max_staleness": best,
        "modes": {str(k): v for k, v in per_mode.items()},
        "steps_timed_per_mode": steps * repeats,
        "model": cfg.model.path,
        "engine": cfg.rollout.engine,
        "partial_rollout": cfg.async_.partial_rollout,
        "tool_latency": {"median_s": cfg.sandbox.added_latency_median_s, "p95_s": cfg.sandbox.added_latency_p95_s},
    }
    header = f"{'mode':<12}{'step s':>8}{'wait s':>8}{'train s':>9}{'sync s':>8}{'trainer idle':>14}{'rollout idle':>14}{'stale tok':>11}{'dropped':>9}"
    lines = [
        f"pipeline bench: {cfg.model.path} on {cfg.rollout.engine}, {cfg.data.prompts_per_step} prompts x {cfg.rollout.n} per step, "
        f"tool latency lognormal median {cfg.sandbox.added_latency_median_s:g}s p95 {cfg.sandbox.added_latency_p95_s:g}s, "
        f"{steps * repeats} timed steps per mode",
        header,
    ]
    for k, m in per_mode.items():
        name = "sync" if k == 0 else f"async k={k}"
        lines.append(f"{name:<12}{m['step_s']:>8.2f}{m['wait_s']:>8.2f}{m['train_s']:>9.2f}{m['sync_s']:>8.2f}{m['trainer_idle_ratio']:>14.2f}"
                     f"{m['rollout_idle_ratio']:>14.2f}{m['staleness_token_mean']:>11.2f}{m['dropped_stale']:>9d}")
    lines.append(f"ideal async step {ideal_s:.2f}s (max(generation, training + sync) of the sync steps) = {result['ideal_vs_sync']:.3f} x sync")
    lines.append(f"async_vs_sync {result['async_vs_sync']:.3f} (k={best}; goal <= 0.77)   async_vs_ideal {result['async_vs_ideal']:.3f} (goal >= 0.7)")
    return "\n".join(lines), result
