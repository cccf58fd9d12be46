"""The driver: optional cold-start SFT, then the GRPO loop (rollout -> train -> weight sync -> log).

`raytool train` runs `run()`; so does a `ray job submit ... -- raytool train ...` entrypoint, in
which case RAY_ADDRESS points at the cluster and the driver attaches to it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from collections.abc import Callable
from typing import Any
from pathlib import Path

import msgspec
import ray
from tqdm import tqdm

from actors.agent_worker import build_toolset
from actors.drivers.checkpoint import checkpoint_root, latest_checkpoint, load_buffer, read_state, remove_earlier_run, save_checkpoint, where_to_run
from actors.drivers.compose import Graph, build, run_namespace
from actors.drivers.session import actors_by_node, check_row_tools, check_tools, connect, dashboard_url, run_log
from actors.drivers.evaluate import evaluate
from actors.metrics import record_step
from actors.trainer import TrainerLost
from raytool.agent.registry import check_agents
from raytool.distill import check_teacher
from raytool.agent.render import ChatRenderer, as_in_turn, check_template_kwargs
from raytool.config import RunConfig, to_yaml
from raytool.data import PromptLoader, load_conversations, sft_examples
from raytool.data.prompts import PromptRow, drop_too_long, with_system_prompt
from raytool.data.task import Task, load_task
from raytool.device import NO_FAST_ALLOCATOR, fast_allocator_missing
from raytool import console, storage
from raytool.errors import RaytoolError
from raytool.resolve import resolve, with_epochs
from raytool.evaluation import table as eval_table
from raytool.ledger import FILE as LEDGER_FILE, Ledger, outcome_metrics
from raytool.models import load_tokenizer, resolve_model
from raytool.rewards import check_judge, validate_reward_fn
from raytool.streaming import RolloutBatch, RolloutStream
from raytool.tools.registry import ToolSet
from raytool.tracking import Tracker, cut_after_step, validate_backends
from raytool.training.guard import UpdateGuard
from raytool.training import lr_at

log = logging.getLogger(__name__)


def serving_metrics(graph: Graph, server_stats: dict) -> dict:
    """The rollout servers' side of a step: health, retries and the engines' own counters
    (`server_stats`: the manager's server_stats())."""
    control = graph.ask_manager("stats")
    engines = [e for e in server_stats.values() if "error" not in e]
    hits = [e["prefix_cache_hit_rate"] for e in engines if e.get("prefix_cache_hit_rate") is not None]
    metrics = {
        "rollout/servers_healthy": len(control.healthy),
        "rollout/retries": control.retries,
    }
    if hits:
        metrics["rollout/prefix_cache_hit_rate"] = sum(hits) / len(hits)
    return metrics


def sandbox_metrics(graph: Graph) -> dict:
    """The sandbox pools' side of a step: queue depth, latency and outcomes (cumulative counts since
    each pool started); a pool that is being restarted is counted in `sandbox/pools_down`."""
    pools, down = [], 0
    for pool in graph.sandbox_pools:
        try:
            pools.append(ray.get(pool.stats.remote(), timeout=30))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # Ray is restarting it
            down += 1
    metrics = {"sandbox/pools_down": down}
    if not pools:
        return metrics
    metrics |= {
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
    conversations of sft.train_files where it names any, else of the task's generated traces (only
    the chosen ones are tokenized). One line says which."""
    if not task.sft_traces and not cfg.sft.train_files:
        raise RaytoolError("config key 'trainer.sft_warmup_steps': the warm-up needs conversations (sft.train_files) for "
                           "prompts from data files; give them or set trainer.sft_warmup_steps=0")
    own = bool(cfg.sft.train_files)
    pool = [c for path in cfg.sft.train_files for c in load_conversations(path)[0]] if own else task.sft_traces
    chosen = rng.sample(pool, min(len(pool), cfg.trainer.sft_warmup_steps * cfg.sft.batch_size))
    log.info("SFT warm-up: %d steps on %d of the %d conversations %s", cfg.trainer.sft_warmup_steps, len(chosen), len(pool),
             f"of sft.train_files ({', '.join(cfg.sft.train_files)})" if own else "generated with the tool_arith task")
    if own:
        return sft_examples(chosen, tokenizer, cfg.sft.max_length, cfg.agent.chat_template_kwargs, cfg.agent.format)[0]
    if cfg.agent.observation_style == "in_turn":
        chosen = [as_in_turn(m) for m in chosen]
    renderer = ChatRenderer(tokenizer, template_kwargs=cfg.agent.chat_template_kwargs, fmt=cfg.agent.format)
    return [ex for m in chosen for ex in renderer.sft_examples(m)]


def run_sft_warmup(graph: Graph, cfg: RunConfig, examples: list, tracker: Tracker | None) -> None:
    """The in-run cold start: SFT steps on `examples` (batches drawn by the trainer seed), logged to `tracker` if given."""
    rng = random.Random(cfg.trainer.seed)
    sft = cfg.sft
    for step in range(1, cfg.trainer.sft_warmup_steps + 1):
        start = time.perf_counter()
        batch = rng.sample(examples, min(sft.batch_size, len(examples)))
        lr = lr_at(step - 1, sft.lr, sft.warmup_steps, cfg.trainer.sft_warmup_steps, sft.lr_schedule)
        metrics = graph.trainer.sft_step(batch, lr)
        metrics.update(step=step, **{"timing/step_s": time.perf_counter() - start})
        if tracker is not None:
            tracker.log(metrics, phase="sft")


def validate(graph: Graph, cfg: RunConfig, task: Task, step: int, tracker: Tracker | None = None, decode=None) -> dict:
    """Validation metrics at `step` (also logged as a table); the first logging.val_trace_samples
    trajectories of each data source go to `tracker`'s val_traces.jsonl."""
    start = time.perf_counter()
    metrics, trajectories = evaluate(graph, task.val, cfg.eval, prefix=f"val{step}", progress="validation" if cfg.logging.progress else None)
    metrics["timing/validation_s"] = time.perf_counter() - start
    log.info("validation at step %d:\n%s", step, eval_table(metrics, cfg.eval.n))
    if tracker is not None and cfg.logging.val_trace_samples:
        per_source: dict[str, list] = {}
        for source, t in trajectories:
            kept = per_source.setdefault(source, [])
            if len(kept) < cfg.logging.val_trace_samples:
                kept.append(t)
        traced = [(source, t) for source, kept in per_source.items() for t in kept]
        tracker.trace(step, [t for _, t in traced], decode, data_sources=[source for source, _ in traced])
    return metrics


class DriverState(msgspec.Struct):
    """What the driver needs to continue a run exactly, saved next to the trainer's checkpoint."""

    step: int  # GRPO steps done
    version: int  # the policy version at the checkpoint (the control plane's, read when saving): a resumed run syncs it
    loader: dict  # the prompt loader's position
    redo: list[tuple[str, PromptRow]] = []  # groups drawn but not finished at the checkpoint: rolled out again first, same keys and seeds


def run(cfg: RunConfig, run_dir: str | Path | None = None, address: str | None = None, resume: str | Path | None = None,
        overwrite: bool = False) -> Path:
    """Train per `cfg`, writing config.yaml, metrics.jsonl, traces.jsonl and checkpoints to run_dir.
    `resume`: a checkpoint or run directory to continue from (the run directory is reused); else a
    run_dir holding an earlier run is refused, unless `overwrite` (its outputs are then replaced)."""
    checkpoint, run_dir, earlier = where_to_run(cfg, run_dir, resume, overwrite)
    # A missing model, a bad reward fn, unusable data or a name that resolves to nothing stop the
    # run here, before any actor starts and before anything is written.
    model_path = resolve_model(cfg.model.path)
    validate_reward_fn(cfg.reward.fn)
    check_tools(cfg)
    cfg = resolve(cfg)  # the one config every actor receives and config.yaml records
    validate_backends(cfg.logging)
    task = load_task(cfg)
    check_agents(cfg.agent, task.train + task.val)
    check_judge(cfg.reward, task.train + task.val)
    tokenizer = load_tokenizer(model_path)  # renders the warm-up, decodes the traces' prompts
    if cfg.distill.teacher:
        cfg = check_teacher(cfg, tokenizer)  # a teacher URL's model name settled here, for every agent worker
    check_template_kwargs(tokenizer, cfg.agent.chat_template_kwargs)
    toolset = build_toolset(cfg.agent, tokenizer, None)  # the run's tools (names and schemas; no executor in the driver)
    check_row_tools(toolset, task)
    warmup = warmup_examples(cfg, task, tokenizer, random.Random(cfg.trainer.seed)) if cfg.trainer.sft_warmup_steps and checkpoint is None else []
    task = fitting_prompts(cfg, task, model_path, tokenizer, toolset)
    cfg = with_epochs(cfg, len(task.train))
    remove_earlier_run(run_dir, earlier)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    with run_log(run_dir):
        start = time.monotonic()
        connect(address or cfg.cluster.address, log_to_driver=cfg.logging.console_level == "all")
        r = cfg.rollout
        if r.engine == "vllm" and r.num_gpus == 0 and r.cpu_preload and fast_allocator_missing():
            log.warning(NO_FAST_ALLOCATOR)  # the engine's own warning stays in its actor's log
        final = reforming(cfg, run_dir, checkpoint, lambda checkpoint: train(cfg, run_dir, model_path, task, tokenizer, warmup, checkpoint))
        console.show(console.summary(run_dir, time.monotonic() - start, final))
        return run_dir


def reforming(cfg: RunConfig, run_dir: Path, checkpoint: str | None, train_once: Callable[[str | None], Any]) -> Any:
    """`train_once(checkpoint)` -> what it returns; when a trainer rank dies or hangs (TrainerLost), again from the
    run's last checkpoint (with none yet, from the start with fresh logs), up to
    trainer.max_failures times, each said in one line."""
    failures = 0
    while True:
        try:
            return train_once(checkpoint)
        except TrainerLost as exc:
            failures += 1
            if failures > cfg.trainer.max_failures:
                raise TrainerLost(f"{exc} (the trainer group failed {failures} times; trainer.max_failures={cfg.trainer.max_failures})") from exc
            checkpoint = latest_checkpoint(run_dir, cfg)
            log.warning("%s: re-forming the trainer group and restoring %s (failure %d of trainer.max_failures=%d)", exc,
                        checkpoint or "the start: no checkpoint yet (trainer.save_every)", failures, cfg.trainer.max_failures)
            if checkpoint is None:
                start_over(run_dir)


def start_over(run_dir: Path) -> None:
    """A run restarted from the beginning writes its logs afresh."""
    for name in ("metrics.jsonl", "sft_metrics.jsonl", "traces.jsonl", LEDGER_FILE):
        (run_dir / name).unlink(missing_ok=True)


def context_length(cfg: RunConfig, model_path: str) -> int | None:
    """The longest prompt + response a rollout engine takes: rollout.max_model_len, else the model's own limit."""
    if cfg.rollout.max_model_len is not None:
        return cfg.rollout.max_model_len
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)


def fitting_prompts(cfg: RunConfig, task: Task, model_path: str, tokenizer, toolset: ToolSet) -> Task:
    """`task` without the prompts over data.max_prompt_tokens or that cannot fit the engine's
    context with the response budget, each split's left-out rows named in one warning line
    (counted in `data/prompts_too_long`); with data.overlong_prompts=error, the first such row stops the run."""
    context = context_length(cfg, model_path) or 1 << 62
    renderer = ChatRenderer(tokenizer, tools=toolset.schemas if cfg.agent.format != "retool" else None, template_kwargs=cfg.agent.chat_template_kwargs)

    def prompt_tokens(row: PromptRow) -> int:
        return len(renderer.prompt_ids(with_system_prompt(row.prompt, cfg.agent.system_prompt)))

    budget = cfg.agent.max_response_tokens
    limits = {"max_prompt": cfg.data.max_prompt_tokens, "overlong": cfg.data.overlong_prompts}
    train, warned = drop_too_long(task.train, prompt_tokens, context, budget, "training data", **limits)
    if warned:
        log.warning(warned)
    val, warned_val = drop_too_long(task.val, prompt_tokens, context, budget, "validation data", **limits)
    if warned_val:
        log.warning(warned_val)
    if not train:
        raise RaytoolError(f"raytool: no training prompt fits: {warned}")
    return dataclasses.replace(task, train=train, val=val, too_long=len(task.train) - len(train))


RESYNC_CHECK_S = 5.0  # while waiting for groups, how often the driver looks for restarted servers to re-sync


def rollout_stream(graph: Graph, cfg: RunConfig, loader: PromptLoader) -> RolloutStream:
    """The streaming rollout core on this run's actors (see raytool.streaming)."""

    def submit(row: PromptRow, key: str, attempt: int):
        return graph.submit_group(row, key, attempt=attempt)

    def wait(stats_refs: list, also: list) -> tuple[dict, list]:
        everything = stats_refs + also
        graph.check_alive()
        while not ray.wait(everything, num_returns=1, timeout=RESYNC_CHECK_S)[0]:
            graph.check_alive()  # a server dead for good: stop in one line rather than wait for it
            if stream.training:  # a stopped trainer rank: TrainerLost (the group re-forms), not a wait forever
                graph.trainer.check_heartbeats()
            else:  # a restarted server serves again once it holds the current weights
                graph.resync_stale()
        ready, _ = ray.wait(everything, num_returns=len(everything), timeout=0)
        ready = set(ready)
        return {ref: graph.group_result(ref) for ref in stats_refs if ref in ready}, [ref for ref in also if ref in ready]

    a = cfg.algorithm
    stream = RolloutStream(cfg.data.prompts_per_step, cfg.async_.max_staleness, loader.next_batch, submit, wait,
                           dynamic_sampling=a.dynamic_sampling, max_rounds=a.max_sampling_rounds, policy_version=graph.policy_version,
                           max_retries=cfg.rollout.max_group_retries, retry_budget=cfg.rollout.retry_budget, window=graph.admission_window())
    return stream


def grpo_step(graph: Graph, stream: RolloutStream, step: int, progress: bool = False) -> tuple[dict, RolloutBatch]:
    """One GRPO step: take a batch from the stream, train on it while the stream goes on, publish
    the new weights (the next policy version) -> (the step's metrics, the batch). `progress`: a bar on
    stderr while the trainer waits for its batch."""
    step_start = time.perf_counter()
    with tqdm(total=stream.per_step * graph.cfg.rollout.n, desc=f"rollout step {step}", unit="traj", disable=not progress, leave=False) as bar:
        stream.on_finished = bar.update
        batch, batch_metrics = stream.next_batch(step)
        stream.on_finished = None
    rollout_s = time.perf_counter() - step_start

    train_start = time.perf_counter()
    training = graph.trainer.rl_step_refs(batch)
    stream.train_while_rolling(training)
    train_metrics = graph.trainer.gather(training)[0]
    train_s = time.perf_counter() - train_start

    sync_start = time.perf_counter()
    sync = graph.publish_weights()
    stream.trained()
    sync_s = time.perf_counter() - sync_start

    engines = graph.ask_manager("server_stats")
    metrics = {"step": step, **batch_metrics, **train_metrics, **serving_metrics(graph, engines), **sandbox_metrics(graph)}
    step_s = time.perf_counter() - step_start
    rollout_idle_s, trainer_wait_s = stream.clock.lap()
    generated = sum(s.generated_tokens for s in batch.stats())
    metrics.update({
        "rollout/tokens_per_s": generated / max(rollout_s if stream.k == 0 else step_s, 1e-9),
        "timing/step_s": step_s,
        "timing/rollout_s": rollout_s,  # waiting for the batch (the trainer idle)
        "timing/train_s": train_s,
        "timing/weight_sync_s": sync_s,
        "trainer/idle_ratio": trainer_wait_s / step_s,
        "rollout/idle_ratio": min(1.0, rollout_idle_s / step_s),
        "weight_sync/bytes": sync.sent["bytes"],
        "weight_sync/failed_servers": len(sync.failed),
        "policy_version": sync.version,
    })
    # The dashboard's view of the step (Ray metrics on the head's Prometheus endpoint).
    record_step(step, step_s=step_s, train_s=train_s, sync_s=sync_s, rollout_s=rollout_s, trainer_version=sync.version,
                server_versions={name: e["policy_version"] for name, e in engines.items() if "policy_version" in e})
    return metrics, batch


def traced(batch: RolloutBatch, count: int) -> list:
    """The batch's first `count` trajectories, over as many groups as they take (logging.trace_samples)."""
    out = []
    for group in batch.groups:
        if len(out) >= count:
            break
        out += ray.get(group.ref.trajectories)[: count - len(out)]
    return out


def _at_version(state: DriverState, graph: Graph) -> DriverState:
    """The driver's state to save, with the policy version the control plane holds now."""
    return msgspec.structs.replace(state, version=graph.policy_version())


def _origin(row, key: str) -> str:
    """Where a group's prompt came from, for a line that names it."""
    origin = getattr(row, "origin", "") or f"group {key}"
    source = getattr(row, "data_source", "")
    return f"{origin} (data source {source})" if source else origin


def train(cfg: RunConfig, run_dir: Path, model_path: str, task: Task, tokenizer, warmup: list, checkpoint: str | None) -> str | None:
    """Start the actors and run the loop (SFT warm-up, then GRPO steps) of `run` -> where the final
    model's HF export is (None: trainer.save_final is off).

    Each step takes a batch of finished groups from the rollout stream, trains on it while the
    stream goes on (asynchronous mode: admission lets new groups start within async.max_staleness),
    then publishes the new weights to the servers, which load them between engine steps."""
    console.show(console.banner(cfg, model_path, run_dir.resolve()))
    graph = build(cfg, model_path, namespace=cfg.cluster.namespace or run_namespace(f"raytool-{run_dir.resolve().name}"), watch=True)
    if graph.cfg != cfg:  # the trainer's autos, decided on its device: config.yaml records what the run runs with
        cfg = graph.cfg
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
    console.show(console.placement(actors_by_node(graph.namespace), dashboard_url()))
    if graph.gateway_url:
        (run_dir / "gateway.json").write_text(json.dumps({"url": graph.gateway_url, "model": cfg.model.path}) + "\n")
        console.show([f"OpenAI-compatible gateway: {graph.gateway_url}/v1 (model {cfg.model.path!r})"])
    root = checkpoint_root(cfg, run_dir)
    saved = read_state(checkpoint, DriverState) if checkpoint is not None else None
    if saved is not None:  # the steps after the checkpoint are done again: each logged once
        cut_after_step(run_dir, saved.step)
    tracker = Tracker(run_dir, cfg.logging, config=msgspec.to_builtins(cfg))
    loader = PromptLoader(task.train, cfg.data.prompts_per_step, seed=cfg.data.seed)
    try:
        if cfg.trainer.save_every or cfg.trainer.save_final:  # a run that never saves needs no storage
            graph.trainer.check_storage(root)
        state = saved or DriverState(step=0, version=0, loader=loader.state_dict())
        buffered = []
        if checkpoint is not None:
            graph.trainer.load_checkpoint(str(checkpoint))
            loader.load_state_dict(state.loader)
            buffered = load_buffer(checkpoint, PromptRow)
            graph.sync_weights(state.version)
            console.show([f"resumed from {checkpoint} at step {state.step} ({len(state.redo)} groups to roll out again, "
                          f"{len(buffered)} finished groups to train)"])
        elif cfg.trainer.sft_warmup_steps:
            run_sft_warmup(graph, cfg, warmup, tracker)
            graph.trainer.start_rl(snapshot_reference=cfg.algorithm.kl_on)  # the KL reference is the cold-started policy
            graph.publish_weights()
        if cfg.eval.before_train and task.val and state.step == 0:
            tracker.log({"step": 0, **validate(graph, cfg, task, 0, tracker, tokenizer.decode)})
        stream = rollout_stream(graph, cfg, loader)
        stream.restore(list(state.redo), buffered)
        ledger = Ledger(run_dir, resume_step=state.step if checkpoint is not None else None)
        guard = UpdateGuard(cfg.trainer.max_skipped_steps)
        for step in range(state.step + 1, cfg.trainer.total_steps + 1):
            metrics, batch = grpo_step(graph, stream, step, progress=cfg.logging.progress)
            guard.after_step(step, metrics, [(_origin(g.row, g.key), s.reward) for g in batch.groups for s in g.stats])
            every, last = cfg.eval.every, step == cfg.trainer.total_steps
            if task.val and ((every and (step % every == 0 or last)) or (cfg.eval.after_train and last)):
                metrics.update(validate(graph, cfg, task, step, tracker, tokenizer.decode))
            outcomes = stream.take_outcomes()
            metrics.update(outcome_metrics(outcomes), **{"data/prompts_too_long": task.too_long})
            tracker.log(metrics)
            ledger.record(step, **outcomes)
            if cfg.logging.trace_samples:
                tracker.trace(step, traced(batch, cfg.logging.trace_samples), tokenizer.decode)
            redo, waiting = stream.unfinished()
            state.step, state.loader, state.redo = step, loader.state_dict(), redo
            every = cfg.trainer.save_every
            if every and step % every == 0 and not (cfg.trainer.save_final and step == cfg.trainer.total_steps):
                save_checkpoint(graph.trainer, root, _at_version(state, graph), waiting, to_yaml(cfg), cfg.trainer.keep_checkpoints, run_dir)
        redo, waiting = stream.unfinished()
        ledger.finish(state.step, [key for key, _ in redo] + [g.key for g in waiting])
        if cfg.trainer.save_final:
            directory = save_checkpoint(graph.trainer, root, _at_version(state, graph), waiting, to_yaml(cfg), cfg.trainer.keep_checkpoints, run_dir)
            return graph.trainer.export_hf(storage.join(directory, "hf"))
        return None
    finally:
        tracker.close()
        graph.shutdown()
