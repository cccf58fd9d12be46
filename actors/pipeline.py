"""The driver: optional cold-start SFT, then the GRPO loop (rollout -> train -> weight sync -> log).

`raytool train` runs `run()`; so does a `ray job submit ... -- raytool train ...` entrypoint, in
which case RAY_ADDRESS points at the cluster and the driver attaches to it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
import traceback
from datetime import datetime
from pathlib import Path

import msgspec
import ray

from actors.compose import Graph, build, run_namespace, with_tool_sandbox_settings
from actors.evaluate import evaluate
from actors.metrics import record_step
from raytool.agent.render import ChatRenderer, as_in_turn
from raytool.config import ConfigError, RunConfig, to_yaml
from raytool.data import PromptLoader, load_conversations, sft_examples
from raytool.data.task import Task, load_task
from raytool.errors import RaytoolError
from raytool.evaluation import table as eval_table
from raytool.models import resolve_model
from raytool.rewards import validate_reward_fn
from raytool.tools.registry import load_tool_config
from raytool.tracking import Tracker, validate_backends
from raytool.training import lr_at

log = logging.getLogger(__name__)


def default_run_dir() -> Path:
    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")


@contextlib.contextmanager
def run_log(run_dir: Path):
    """Copy the driver's log records to RUN_DIR/run.log; an exception that ends the run leaves its
    full traceback there (remote ones included) and names the file on `exc.run_log`, so the console
    can stay at one line."""
    path = run_dir / "run.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield path
    except BaseException as exc:
        handler.stream.write("".join(traceback.format_exception(exc)))
        exc.run_log = str(path)
        raise
    finally:
        root.removeHandler(handler)
        handler.close()


def check_tools(cfg: RunConfig) -> None:
    """The tool YAML (agent.tools) must load in the driver: its classes import and build, and its
    sandbox settings agree with the run's; otherwise the first agent worker would be the one to say."""
    if not cfg.agent.tools:
        return
    try:
        with_tool_sandbox_settings(cfg)
        load_tool_config(cfg.agent.tools)
    except ConfigError as exc:
        raise ConfigError(f"config key 'agent.tools': {exc}") from None


def connect(address: str | None) -> None:
    """Attach to `address` (or RAY_ADDRESS), else start a private local Ray instance."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    ray.init(address=address or "local", log_to_driver=True)


def rollout_metrics(stats: list[dict]) -> dict:
    n = len(stats)
    calls = sum(s["tool_calls"] for s in stats)
    metrics = {
        "reward/mean": sum(s["reward"] for s in stats) / n,
        "acc/mean": sum(s["acc"] for s in stats) / n,
        "response_length/mean": sum(s["response_length"] for s in stats) / n,
        "generated_tokens/mean": sum(s["generated_tokens"] for s in stats) / n,
        "num_turns/mean": sum(s["num_turns"] for s in stats) / n,
        "tool/calls_per_traj": calls / n,
        "tool/error_rate": sum(s["tool_errors"] for s in stats) / calls if calls else 0.0,
        "rollout/trajectories": n,
    }
    # Counts per step, by kind (raytool.tools.base.ERROR_KINDS), as a rate per call.
    for kind in sorted({k for s in stats for k in s.get("tool_error_kinds", {})}):
        metrics[f"tool/errors/{kind}"] = sum(s["tool_error_kinds"].get(kind, 0) for s in stats) / max(calls, 1)
    metrics["tool/repaired"] = sum(s.get("tool_repaired", 0) for s in stats)
    metrics["tool/cut_in_fence"] = sum(s.get("tool_cut_in_fence", 0) for s in stats)
    metrics["reward/timeouts"] = sum(s.get("verify_timeout", 0.0) for s in stats)  # answers whose check ran out of time (scored wrong)
    for reason in sorted({s["finish_reason"] for s in stats}):
        metrics[f"finish/{reason}"] = sum(s["finish_reason"] == reason for s in stats) / n
    return metrics


def serving_metrics(graph: Graph, server_stats: dict) -> dict:
    """The rollout servers' side of a step: health, retries and the engines' own counters
    (`server_stats`: the manager's server_stats())."""
    manager = ray.get(graph.manager.stats.remote())
    engines = [e for e in server_stats.values() if "error" not in e]
    hits = [e["prefix_cache_hit_rate"] for e in engines if e.get("prefix_cache_hit_rate") is not None]
    metrics = {
        "rollout/servers_healthy": len(manager["in_flight"]) - len(manager["ejected"]),
        "rollout/retries": manager["retries"],
    }
    if hits:
        metrics["rollout/prefix_cache_hit_rate"] = sum(hits) / len(hits)
    return metrics


def sandbox_metrics(graph: Graph) -> dict:
    """The sandbox pools' side of a step: queue depth, latency and outcomes (cumulative counts)."""
    pools = ray.get([p.stats.remote() for p in graph.sandbox_pools])
    metrics = {
        "sandbox/queue_depth": sum(p["queue_depth"] for p in pools),
        "sandbox/latency_p50_s": max(p["latency_p50_s"] for p in pools),
        "sandbox/latency_p99_s": max(p["latency_p99_s"] for p in pools),
        "sandbox/breakers_open": sum(p["breaker"] != "closed" for p in pools),
        "sandbox/rejected": sum(p["rejected"] for p in pools),
    }
    for status in sorted({s for p in pools for s in p["status"]}):
        metrics[f"sandbox/status/{status}"] = sum(p["status"].get(status, 0) for p in pools)
    return metrics


def warmup_examples(cfg: RunConfig, task: Task, tokenizer, rng: random.Random) -> list:
    """The SFT examples the in-run cold start samples from: as many as the warm-up can use of the
    task's generated traces, or of the conversations of sft.train_files (only those are tokenized)."""
    if not task.sft_traces and not cfg.sft.train_files:
        raise RaytoolError("config key 'trainer.sft_warmup_steps': the warm-up needs conversations (sft.train_files) for "
                           "data.task=files; give them or set trainer.sft_warmup_steps=0")
    pool = task.sft_traces or [c for path in cfg.sft.train_files for c in load_conversations(path)[0]]
    chosen = rng.sample(pool, min(len(pool), cfg.trainer.sft_warmup_steps * cfg.sft.batch_size))
    if not task.sft_traces:
        return sft_examples(chosen, tokenizer, cfg.sft.max_length, cfg.agent.chat_template_kwargs)[0]
    if cfg.agent.observation_style == "in_turn":
        chosen = [as_in_turn(m) for m in chosen]
    renderer = ChatRenderer(tokenizer, template_kwargs=cfg.agent.chat_template_kwargs)
    return [ex for m in chosen for ex in renderer.sft_examples(m)]


def run_sft_warmup(graph: Graph, cfg: RunConfig, examples: list, tracker: Tracker) -> None:
    """The in-run cold start: SFT steps on `examples` (batches drawn by the trainer seed)."""
    rng = random.Random(cfg.trainer.seed)
    sft = cfg.sft
    for step in range(1, cfg.trainer.sft_warmup_steps + 1):
        start = time.perf_counter()
        batch = rng.sample(examples, min(sft.batch_size, len(examples)))
        lr = lr_at(step - 1, sft.lr, sft.warmup_steps, cfg.trainer.sft_warmup_steps, sft.lr_schedule)
        metrics = graph.trainer.sft_step(batch, lr)
        metrics.update(step=step, **{"timing/step_s": time.perf_counter() - start})
        tracker.log(metrics, phase="sft")


def group_rewards_vary(stats: list[dict]) -> list[bool]:
    """Per group (stats carry their `group`), whether its rewards differ: a group whose samples all
    scored the same has zero advantage under GRPO and teaches nothing."""
    rewards: dict[int, set] = {}
    for s in stats:
        rewards.setdefault(s["group"], set()).add(s["reward"])
    return [len(rewards[g]) > 1 for g in sorted(rewards)]


def collect_rollouts(graph: Graph, cfg: RunConfig, loader: PromptLoader, step: int) -> tuple[list[dict], list, dict]:
    """One step's training batch -> (stats of the trajectories trained on, their group refs, and
    metrics of everything rolled out). With algorithm.dynamic_sampling, groups whose rewards are all
    equal are dropped and more prompts are rolled out until data.prompts_per_step groups are kept or
    algorithm.max_sampling_rounds rounds are done."""
    want, algo = cfg.data.prompts_per_step, cfg.algorithm
    progress = f"rollout step {step}" if cfg.logging.progress else None
    everything, kept_stats, kept_refs = [], [], []
    for rounds in range(1, (algo.max_sampling_rounds if algo.dynamic_sampling else 1) + 1):
        stats, refs = graph.rollout(loader.next_batch(), f"s{step}r{rounds}g", progress)
        everything += stats
        if not algo.dynamic_sampling:
            return stats, refs, rollout_metrics(stats)
        for g, varies in enumerate(group_rewards_vary(stats)):
            if varies and len(kept_refs) < want:
                kept_stats += [{**s, "group": len(kept_refs)} for s in stats if s["group"] == g]
                kept_refs.append(refs[g])
        if len(kept_refs) == want:
            break
    metrics = rollout_metrics(everything)  # what the policy did, before the filter
    metrics.update({"rollout/sampling_rounds": rounds, "rollout/prompts_drawn": rounds * want, "rollout/groups_kept": len(kept_refs)})
    if not kept_refs:  # nothing to learn from in any round: train on the last one (its advantages are all zero)
        return stats, refs, metrics
    return kept_stats, kept_refs, metrics


def validate(graph: Graph, cfg: RunConfig, task: Task, step: int) -> dict:
    """Validation metrics at `step` (also logged as a table)."""
    start = time.perf_counter()
    metrics, _ = evaluate(graph, task.val, cfg.eval, prefix=f"val{step}", progress="validation" if cfg.logging.progress else None)
    metrics["timing/validation_s"] = time.perf_counter() - start
    log.info("validation at step %d:\n%s", step, eval_table(metrics, cfg.eval.n))
    return metrics


class DriverState(msgspec.Struct):
    """What the driver needs to continue a run exactly, saved next to the trainer's checkpoint."""

    step: int  # GRPO steps done
    version: int  # policy version the rollout servers hold
    loader: dict  # the prompt loader's position


def save_checkpoint(trainer, run_dir: Path, state: msgspec.Struct) -> Path:
    """The trainer group's checkpoint in run_dir/checkpoints/step_N, with the driver's `state`
    (a Struct with a `step`) next to it as driver_state.json."""
    directory = (run_dir / "checkpoints" / f"step_{state.step}").resolve()
    trainer.save_checkpoint(str(directory))
    (directory / "driver_state.json").write_bytes(msgspec.json.encode(state))
    log.info("checkpoint: %s", directory)
    return directory


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from what a user passes to --resume: the checkpoint itself, or a run
    directory (its latest checkpoint)."""
    path = Path(path)
    if (path / "driver_state.json").is_file():
        return path
    candidates = [d for d in (path / "checkpoints").glob("step_*") if (d / "driver_state.json").is_file()]
    if not candidates:
        raise RaytoolError(f"--resume {path}: no checkpoint there (expected a checkpoints/step_N directory with driver_state.json, or a run directory holding them)")
    return max(candidates, key=lambda d: int(d.name.removeprefix("step_")))


def latest_run_dir(root: Path = Path("runs")) -> Path:
    runs = sorted((d for d in root.glob("*") if (d / "checkpoints").is_dir()), key=lambda d: d.stat().st_mtime)
    if not runs:
        raise RaytoolError(f"--resume: no run with checkpoints under {root.resolve()}; pass the run or checkpoint directory")
    return runs[-1]


def run(cfg: RunConfig, run_dir: str | Path | None = None, address: str | None = None, resume: str | Path | None = None) -> Path:
    """Train per `cfg`, writing config.yaml, metrics.jsonl, traces.jsonl and checkpoints to run_dir.
    `resume`: a checkpoint or run directory to continue from (the run directory is reused)."""
    checkpoint = find_checkpoint(resume) if resume is not None else None
    if checkpoint is not None and run_dir is None:
        run_dir = checkpoint.parent.parent
    # A missing model, a bad reward fn or unusable data stop the run here, before any actor starts.
    model_path = resolve_model(cfg.model.path)
    validate_reward_fn(cfg.reward.fn)
    check_tools(cfg)
    validate_backends(cfg.logging)
    task = load_task(cfg)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)  # renders the warm-up, decodes the traces' prompts
    warmup = warmup_examples(cfg, task, tokenizer, random.Random(cfg.trainer.seed)) if cfg.trainer.sft_warmup_steps and checkpoint is None else []
    run_dir = Path(run_dir) if run_dir else default_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    with run_log(run_dir):
        connect(address or cfg.cluster.address)
        log.info("run directory: %s", run_dir.resolve())
        train(cfg, run_dir, model_path, task, tokenizer, warmup, checkpoint)
    return run_dir


def train(cfg: RunConfig, run_dir: Path, model_path: str, task: Task, tokenizer, warmup: list, checkpoint: Path | None) -> None:
    """Start the actors and run the loop (SFT warm-up, then GRPO steps) of `run`."""
    graph = build(cfg, model_path, namespace=cfg.cluster.namespace or run_namespace(f"raytool-{run_dir.resolve().name}"))
    tracker = Tracker(run_dir, cfg.logging, config=msgspec.to_builtins(cfg))
    loader = PromptLoader(task.train, cfg.data.prompts_per_step, seed=cfg.data.seed)
    kl_on = cfg.algorithm.kl_loss_coef > 0 or cfg.algorithm.kl_reward_coef > 0
    try:
        state = DriverState(step=0, version=0, loader=loader.state_dict())
        if checkpoint is not None:
            state = msgspec.json.decode((checkpoint / "driver_state.json").read_bytes(), type=DriverState)
            graph.trainer.load_checkpoint(str(checkpoint))
            loader.load_state_dict(state.loader)
            graph.sync_weights(state.version)
            log.info("resumed from %s at step %d", checkpoint, state.step)
        elif cfg.trainer.sft_warmup_steps:
            run_sft_warmup(graph, cfg, warmup, tracker)
            if kl_on:  # the KL reference is the cold-started policy
                graph.trainer.snapshot_reference()
            state.version += 1
            graph.sync_weights(state.version)
        if cfg.eval.before_train and task.val and state.step == 0:
            tracker.log({"step": 0, **validate(graph, cfg, task, 0)})
        for step in range(state.step + 1, cfg.trainer.total_steps + 1):
            step_start = time.perf_counter()
            stats, traj_refs, batch_metrics = collect_rollouts(graph, cfg, loader, step)
            rollout_s = time.perf_counter() - step_start

            train_start = time.perf_counter()
            train_metrics = graph.trainer.rl_step(traj_refs, stats)
            train_s = time.perf_counter() - train_start

            sync_start = time.perf_counter()
            state.version += 1
            sync = graph.sync_weights(state.version)
            sync_s = time.perf_counter() - sync_start

            engines = ray.get(graph.manager.server_stats.remote())
            metrics = {"step": step, **batch_metrics, **train_metrics, **serving_metrics(graph, engines), **sandbox_metrics(graph)}
            metrics.update({
                "rollout/tokens_per_s": sum(s["generated_tokens"] for s in stats) / rollout_s,
                "timing/step_s": time.perf_counter() - step_start,
                "timing/rollout_s": rollout_s,
                "timing/train_s": train_s,
                "timing/weight_sync_s": sync_s,
                "weight_sync/bytes": sync["sent"]["bytes"],
                "weight_sync/failed_servers": len(sync["failed"]),
                "policy_version": state.version,
            })
            # The dashboard's view of the step (Ray metrics on the head's Prometheus endpoint).
            record_step(step, step_s=metrics["timing/step_s"], train_s=train_s, sync_s=sync_s, rollout_s=rollout_s, trainer_version=state.version,
                        server_versions={name: e["policy_version"] for name, e in engines.items() if "policy_version" in e})
            every = cfg.eval.every
            if every and task.val and (step % every == 0 or step == cfg.trainer.total_steps):
                metrics.update(validate(graph, cfg, task, step))
            tracker.log(metrics)
            if cfg.logging.trace_samples:
                tracker.trace(step, ray.get(traj_refs[0])[: cfg.logging.trace_samples], tokenizer.decode)
            state.step, state.loader = step, loader.state_dict()
            every = cfg.trainer.save_every
            if every and step % every == 0 and not (cfg.trainer.save_final and step == cfg.trainer.total_steps):
                save_checkpoint(graph.trainer, run_dir, state)
        if cfg.trainer.save_final:
            directory = save_checkpoint(graph.trainer, run_dir, state)
            log.info("final model (HF format): %s", graph.trainer.export_hf(str(directory / "hf")))
    finally:
        tracker.close()
        graph.shutdown()
