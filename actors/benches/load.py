"""`raytool bench load`: 1,000 concurrent trajectories through the real actor graph, no model.

The rollout servers run the scripted engine (`raytool.engines.scripted`): every request is
answered after `rollout.scripted_delay_s` with the next turn of a two-cell code conversation, so
the figures measure raytool itself: the LLM manager, the agent workers, the sandbox pools (local
backend, real cells; the second cell reads the first's state) and the reward workers.

One graph, three rounds submitted the way the driver submits them (`Graph.submit_group`, one
group of `GROUP` samples per prompt, all at once): a warm-up, then 250 and 1,000 trajectories
(`--trajectories N`: N/4 and N).
While a round runs, a sampler reads every actor's RSS and the object store's bytes in use. Per
round: completed, lost (submitted, never returned), duplicated (returned twice), trajectories
whose cells or answer came back wrong, trajectories/s, and the overhead per generate request
beyond the engine's own time (the agent loop's wait minus the engine's time: the manager, two
actor calls, and queueing where the machine's cores are busy), and the CPU time each actor kind
spent per trajectory (its actor processes; a sandbox session's own process is not counted).
Memory growth is the round's peak over the idle level after the warm-up: `memory_1000_vs_250` is
the 1,000 round's growth over the 250 round's (goal <= 4.5: linear or better; agent workers cap
the trajectories they run at once, sandbox pools cap their queues).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import msgspec
import psutil
import ray

from actors.drivers.compose import build
from actors.drivers.session import connect
from raytool.config import RunConfig
from raytool.data import make_splits
from raytool.data.tool_arith import prompt_row
from raytool.engines.scripted import SCRIPT

GROUP = 10  # samples per prompt: 25 groups make 250 trajectories, 100 make 1,000
TRAJECTORIES = 1000  # the big round's (`--trajectories`); the small round has a quarter
WARM_UP = 20
SAMPLE_S = 0.2


def _with_bench_settings(cfg: RunConfig, trajectories: int = TRAJECTORIES) -> RunConfig:
    """The scripted engine, enough agent slots and sandbox queue for `trajectories` at once, one
    turn per script step."""
    r = msgspec.structs.replace(cfg.rollout, engine="scripted", n=GROUP, num_servers=max(2, cfg.rollout.num_servers), num_cpus=0.1)
    a = msgspec.structs.replace(cfg.agent, num_workers=4 if cfg.agent.num_workers == "auto" else max(4, cfg.agent.num_workers), max_turns=len(SCRIPT), format="retool",
                                observation_style="tool_message", tools=None)
    workers = a.num_workers
    a = msgspec.structs.replace(a, max_concurrent_trajectories=max(a.max_concurrent_trajectories, -(-trajectories // workers)))
    s = msgspec.structs.replace(cfg.sandbox, backend="local", num_pools=max(4, cfg.sandbox.num_pools), added_latency_median_s=0.0,
                                added_latency_p95_s=0.0)
    s = msgspec.structs.replace(s, max_queue=max(s.max_queue, -(-2 * trajectories // s.num_pools)))
    w = msgspec.structs.replace(cfg.reward, num_workers=max(2, cfg.reward.num_workers))
    return msgspec.structs.replace(cfg, rollout=r, agent=a, sandbox=s, reward=w)


class _Sampler:
    """Peak RSS per actor kind and peak object-store bytes, read every SAMPLE_S on a thread."""

    def __init__(self, pids: dict[str, list[int]]):
        self.procs = {kind: [psutil.Process(p) for p in ps] for kind, ps in pids.items()}
        self.peak: dict[str, int] = {}
        self.store_peak = 0
        self.cpu_s: dict[str, float] = {}  # CPU seconds each kind's actor processes spent while it ran
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def read(self) -> tuple[dict[str, int], int]:
        rss = {kind: sum(p.memory_info().rss for p in procs) for kind, procs in self.procs.items()}
        return rss, _store_bytes()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, store = self.read()
            for kind, value in rss.items():
                self.peak[kind] = max(self.peak.get(kind, 0), value)
            self.store_peak = max(self.store_peak, store)
            self._stop.wait(SAMPLE_S)

    def _cpu(self) -> dict[str, float]:
        return {kind: sum(sum(p.cpu_times()[:2]) for p in procs) for kind, procs in self.procs.items()}

    def __enter__(self):
        self.cpu_s = self._cpu()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.cpu_s = {kind: seconds - self.cpu_s[kind] for kind, seconds in self._cpu().items()}


def _store_bytes() -> int:
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
    return reply.store_stats.object_store_bytes_used


def _actor_pids(graph) -> dict[str, list[int]]:
    kinds = defaultdict(list)
    for name, actor in graph.light_actors().items():
        kind = name.rsplit("-", 1)[0] if name[-1].isdigit() else name
        kinds[kind].append(ray.get(actor.__ray_call__.remote(lambda self: __import__("os").getpid())))
    return dict(kinds)


def _engine_busy(graph) -> tuple[float, int]:
    stats = ray.get([s.stats.remote() for s in graph.servers.values()])
    return sum(s["busy_s"] for s in stats), sum(s["requests"] for s in stats)


def _round(graph, rows, count: int, tag: str) -> dict:
    busy0, requests0 = _engine_busy(graph)
    start = time.perf_counter()
    groups = [graph.submit_group(rows[g % len(rows)], f"{tag}-{g}", GROUP) for g in range(count // GROUP)]
    results = [graph.group_result(stats) for _, stats in groups]
    elapsed = time.perf_counter() - start
    failed = [r for r in results if not isinstance(r, list)]
    trajectories = [t for (refs, _), r in zip(groups, results) if isinstance(r, list) for t in ray.get(refs.trajectories)]
    busy1, requests1 = _engine_busy(graph)
    uids = [t.uid for t in trajectories]
    expected = {f"{tag}-{g}/{i}" for g in range(count // GROUP) for i in range(GROUP)}
    right = [t for t in trajectories if t.finish_reason == "answer" and [c["output"] for turn in t.turns for c in turn.get("calls", [])] == ["42", "43"]]
    waits = [turn["generate_s"] for t in trajectories for turn in t.turns]
    engine_s = (busy1 - busy0) / max(1, requests1 - requests0)
    return {
        "trajectories": count,
        "completed": len(set(uids) & expected),
        "lost": len(expected - set(uids)),
        "duplicated": len(uids) - len(set(uids)),
        "wrong": len(trajectories) - len(right),
        "infra_failed": sum(t.finish_reason == "infra_failed" for t in trajectories),
        "groups_failed": len(failed),
        "seconds": elapsed,
        "trajectories_per_s": len(set(uids)) / elapsed,
        "engine_s_per_request": engine_s,
        "overhead_ms_per_request": 1000 * (sum(waits) / max(1, len(waits)) - engine_s),
    }


def bench(cfg: RunConfig, trajectories: int = TRAJECTORIES) -> tuple[str, dict]:
    from raytool.config import ConfigError
    from raytool.models import resolve_model

    if trajectories < 40 or trajectories % (4 * GROUP):
        raise ConfigError(f"--trajectories {trajectories}: a multiple of {4 * GROUP} (groups of {GROUP}; the small round has a quarter)")
    big, small = str(trajectories), str(trajectories // 4)
    cfg = _with_bench_settings(cfg, trajectories)
    connect(cfg.cluster.address)
    graph = build(cfg, resolve_model(cfg.model.path), with_trainer=False)
    try:
        rows = [prompt_row(p, cfg.agent.system_prompt) for p in make_splits(100, 1, cfg.data.seed)[0]]
        pids = _actor_pids(graph)
        rounds, memory = {}, {}
        for name, count in (("warm-up", WARM_UP), (small, trajectories // 4), (big, trajectories)):
            if name == small:  # the idle level: every actor warm, nothing running
                idle, idle_store = _Sampler(pids).read()
            with _Sampler(pids) as sampler_round:
                rounds[name] = _round(graph, rows, count, name)
            rounds[name]["cpu_ms_per_trajectory"] = {kind: 1000 * s / count for kind, s in sampler_round.cpu_s.items()}
            if name != "warm-up":
                memory[name] = {"rss_peak": sampler_round.peak, "store_peak": sampler_round.store_peak,
                                "growth": sum(max(0, sampler_round.peak[k] - idle[k]) for k in idle) + max(0, sampler_round.store_peak - idle_store)}
    finally:
        graph.shutdown()
    last = rounds[big]
    ratio = f"memory_{big}_vs_{small}"
    result = {
        "completed": last["completed"],
        "lost": last["lost"],
        "duplicated": last["duplicated"],
        "wrong": last["wrong"],
        "trajectories_per_s": last["trajectories_per_s"],
        "overhead_ms_per_request": last["overhead_ms_per_request"],
        "manager_cpu_ms_per_request": last["cpu_ms_per_trajectory"]["llm-manager"] / len(SCRIPT),
        ratio: memory[big]["growth"] / max(1, memory[small]["growth"]),
        "rounds": rounds,
        "rss_peak_mb": {n: {k: v / 2**20 for k, v in memory[n]["rss_peak"].items()} for n in memory},
        "rss_idle_mb": {k: v / 2**20 for k, v in idle.items()},
        "object_store_peak_mb": {n: memory[n]["store_peak"] / 2**20 for n in memory},
        "scripted_delay_s": cfg.rollout.scripted_delay_s,
        "actors": {k: len(v) for k, v in pids.items()},
    }
    lines = [
        f"load bench: scripted engine ({cfg.rollout.scripted_delay_s:g} s per request), {len(pids.get('rollout-server', []))} servers, "
        f"{cfg.agent.num_workers} agent workers, {cfg.sandbox.num_pools} sandbox pools (local, 2 cells each), {cfg.reward.num_workers} reward workers",
        f"{'round':<10}{'done':>6}{'lost':>6}{'dup':>5}{'wrong':>7}{'traj/s':>8}{'overhead ms/req':>17}",
    ]
    for name in (small, big):
        r = rounds[name]
        lines.append(f"{name:<10}{r['completed']:>6}{r['lost']:>6}{r['duplicated']:>5}{r['wrong']:>7}{r['trajectories_per_s']:>8.1f}{r['overhead_ms_per_request']:>17.1f}")
    lines.append(f"{'peak RSS MiB':<20}" + "".join(f"{k:>16}" for k in idle) + f"{'object store':>14}")
    lines.append(f"{'idle':<20}" + "".join(f"{v / 2**20:>16.0f}" for v in idle.values()) + f"{idle_store / 2**20:>14.1f}")
    for name in (small, big):
        m = memory[name]
        lines.append(f"{name:<20}" + "".join(f"{m['rss_peak'][k] / 2**20:>16.0f}" for k in idle) + f"{m['store_peak'] / 2**20:>14.1f}")
    lines.append(f"{'CPU ms/trajectory':<20}" + "".join(f"{k:>16}" for k in idle))
    for name in (small, big):
        lines.append(f"{name:<20}" + "".join(f"{rounds[name]['cpu_ms_per_trajectory'][k]:>16.1f}" for k in idle))
    lines.append(f"{ratio} {result[ratio]:.2f} (growth over idle, goal <= 4.5); "
                 f"LLM manager CPU per request {result['manager_cpu_ms_per_request']:.2f} ms")
    return "\n".join(lines), result


# -- a slow stage (`raytool bench load --slow-stage judge|sandbox`) ----------------------------------

SLOW_FACTOR = 10  # the slow stage's call takes this many times a trajectory's generation (its three scripted turns)
SLOW_GROUP = 4  # samples per prompt: 64 prompts make the held-out evaluation's burst of 256 trajectories
SLOW_TRAJECTORIES = 256


def _with_slow_stage(cfg: RunConfig, stage: str, judge_url: str | None, latency_s: float) -> RunConfig:
    """The bench's settings with one stage SLOW_FACTOR times slower than generation, one call at a
    time per actor, and timeouts shorter than the queue the burst builds in front of it: a timeout
    that counted the wait would fail most calls."""
    cfg = _with_bench_settings(cfg, SLOW_TRAJECTORIES)
    cfg = msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, n=SLOW_GROUP))
    if stage == "judge":
        judge = msgspec.structs.replace(cfg.reward.judge, base_url=judge_url, concurrency=1, timeout_s=3 * latency_s, max_score=10.0,
                                        cache_size=0)  # every call judged: the script gives every trajectory of a prompt the same answer
        return msgspec.structs.replace(cfg, reward=msgspec.structs.replace(cfg.reward, fn="judge", num_workers=2, call_timeout_s=3 * latency_s, judge=judge))
    s = msgspec.structs.replace(cfg.sandbox, num_pools=2, max_concurrency=1, added_latency_median_s=latency_s, added_latency_p95_s=latency_s)
    return msgspec.structs.replace(cfg, sandbox=s)


def _verdict(prompt: str) -> str:
    """The scripted judge: the script's answer is 43."""
    return "Score: 10" if "\\boxed{43}" in prompt else "Score: 0"


def slow_stage_bench(cfg: RunConfig, stage: str, trajectories: int = SLOW_TRAJECTORIES) -> tuple[str, dict]:
    """Every trajectory of `trajectories` / SLOW_GROUP groups submitted at once (as a held-out
    evaluation does) through `Graph.rollout`, with `stage` (judge or sandbox) SLOW_FACTOR times
    slower than generation: throughput against the slow stage's capacity (its slots over its
    measured service time per call), groups lost, retries, and the admission window."""
    from contextlib import nullcontext

    from raytool.bench.judge_server import JudgeServer
    from raytool.config import ConfigError
    from raytool.models import load_tokenizer, resolve_model
    from raytool.streaming import GroupRetries

    if stage not in ("judge", "sandbox"):
        raise ConfigError(f"--slow-stage {stage}: judge or sandbox")
    if trajectories < SLOW_GROUP or trajectories % SLOW_GROUP:
        raise ConfigError(f"--trajectories {trajectories}: a multiple of {SLOW_GROUP} with --slow-stage")
    model = resolve_model(cfg.model.path)
    generation_s = len(SCRIPT) * cfg.rollout.scripted_delay_s
    latency_s = SLOW_FACTOR * generation_s
    with JudgeServer(load_tokenizer(model), _verdict, delay_s=latency_s) if stage == "judge" else nullcontext() as judge_url:
        cfg = _with_slow_stage(cfg, stage, judge_url, latency_s)
        connect(cfg.cluster.address)
        graph = build(cfg, model, with_trainer=False)
        try:
            rows = [prompt_row(p, cfg.agent.system_prompt) for p in make_splits(trajectories // SLOW_GROUP, 1, cfg.data.seed)[0]]
            graph.rollout(rows[:1], prefix="warm-up")
            window, retries = graph.admission_window(), GroupRetries(cfg.rollout.max_group_retries, cfg.rollout.retry_budget)
            cap = window.limit
            with _Sampler(_actor_pids(graph)) as sampler:
                start = time.perf_counter()
                stats, _ = graph.rollout(rows, prefix="slow", window=window, retries=retries)
                elapsed = time.perf_counter() - start
        finally:
            graph.shutdown()
    used = [s.stages[stage if stage == "sandbox" else "reward"] for s in stats if s.stages]
    queue_s, service_s = [q for q, _ in used], [t for _, t in used]
    calls = len(SCRIPT) - 1 if stage == "sandbox" else 1  # the stage's calls per trajectory
    slots = cfg.sandbox.num_pools * cfg.sandbox.max_concurrency if stage == "sandbox" else cfg.reward.num_workers * cfg.reward.judge.concurrency
    per_call_s = sum(service_s) / max(1, len(service_s)) / calls
    capacity = slots / per_call_s / calls  # trajectories per second the stage can take
    timeout_s = cfg.reward.call_timeout_s if stage == "judge" else None
    result = {
        "stage": stage,
        "trajectories": trajectories,
        "completed": len(stats),
        "lost": trajectories - len(stats),
        # the script's two cells ran without error and it answered (a judge's score aside: the sandbox variant's reward is math's)
        "answered": sum(s.finish_reason == "answer" and s.tool_calls == len(SCRIPT) - 1 and not s.tool_errors for s in stats),
        "judged_right": sum(s.reward == 1.0 for s in stats) if stage == "judge" else None,
        "infra_failed": sum(bool(s.infra_failure) for s in stats),
        "retries": retries.spent,
        "seconds": elapsed,
        "trajectories_per_s": len(stats) / elapsed,
        "capacity_per_s": capacity,
        "throughput_vs_capacity": len(stats) / elapsed / capacity,
        "stage_latency_s": latency_s,
        "generation_s": generation_s,
        "service_s_per_call": per_call_s,
        "queue_s_mean": sum(queue_s) / max(1, len(queue_s)),
        "queue_s_max": max(queue_s, default=0.0),
        "queued_past_the_timeout": sum(q > timeout_s for q in queue_s) if timeout_s else None,
        "window_start": cap,
        "window_end": window.limit,
        "window_cuts": window.cuts,
        "groups_in_flight_peak": window.peak,
        "object_store_peak_mb": sampler.store_peak / 2**20,
        "rss_peak_mb": {k: v / 2**20 for k, v in sampler.peak.items()},
    }
    lines = [
        f"slow-stage load bench: {stage} at {latency_s:g} s per call ({SLOW_FACTOR}x a trajectory's generation, {generation_s:g} s), "
        f"{slots} slots; {trajectories} trajectories ({trajectories // SLOW_GROUP} groups of {SLOW_GROUP}) submitted at once",
        f"{'done':>6}{'lost':>6}{'answered':>10}{'retries':>9}{'infra':>7}{'traj/s':>8}{'capacity/s':>12}{'ratio':>7}{'queue s (mean/max)':>21}{'window':>14}",
        f"{result['completed']:>6}{result['lost']:>6}{result['answered']:>10}{result['retries']:>9}{result['infra_failed']:>7}"
        f"{result['trajectories_per_s']:>8.2f}{capacity:>12.2f}{result['throughput_vs_capacity']:>7.2f}"
        f"{result['queue_s_mean']:>11.1f}/{result['queue_s_max']:<9.1f}{f'{cap}->{window.limit} (peak {window.peak})':>14}",
        "goals: ratio >= 0.8 (the slow stage kept busy), 0 lost, 0 retries"
        + (f"; {result['queued_past_the_timeout']} calls queued longer than reward.call_timeout_s={timeout_s:g}s, none timed out for it" if timeout_s else ""),
    ]
    return "\n".join(lines), result
