"""`raytool bench scale`: generate calls/s and routing cost of the two layouts, alternating in one run.

- **central** (the layout before raytool.dataplane, kept as this bench's baseline): every call goes
  caller -> LLMManager -> RolloutServer and back; one process routes for the whole cluster.
- **direct** (raytool's layout): each caller holds a data plane (actors.dataplane) and calls the
  servers itself; the manager is only the control plane.

N scripted rollout servers (`raytool.engines.scripted`: no model, each answer after
`rollout.scripted_delay_s`) and W caller actors (the agent workers' place), which run M multi-turn
trajectories at once between them (each turn's prompt is the conversation so far, its session
sticky, its group shared by GROUP siblings). Rounds alternate central, direct, central, direct ...;
each layout's figures are the median over its rounds. Per layout: generate calls/s, the added
latency per call (the caller's wait minus the engine's delay) at p50 and p99, and the CPU seconds
per call summed over every process outside the engines (callers and manager). From those per-call
costs it projects the ceiling at 8, 64 and 512 callers: central is capped by its one routing
process however many callers there are; direct by the callers' own CPU (one core each assumed).
Last, the Router's cost per pick at 8 to 1,024 servers.

Knobs (`raytool bench scale key=value`): rollout.num_servers (N, default 2 here), agent.num_workers
(W, default 4), agent.max_concurrent_trajectories (M per caller, default 64),
rollout.scripted_delay_s (default 0.02 here). `SCALE_ROUNDS` rounds per layout.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import timeit

import msgspec
import psutil
import ray

from actors.common import actor_options
from actors.drivers.compose import engine_options
from actors.dataplane import data_plane, follow
from actors.llm_manager import LLMManager
from actors.drivers.session import connect
from actors.rollout_server import RolloutServer
from raytool.config import RolloutConfig, RunConfig
from raytool.engines.scripted import SCRIPT
from raytool.routing import Router
from raytool.types import SamplingParams

SCALE_ROUNDS = 3
DELAY_S = 0.02  # the engine's answer time unless rollout.scripted_delay_s is set: short, so routing is what is measured
GROUP = 8
TRAJECTORIES_PER_ROUND = 2  # per concurrent slot: each caller runs M at once, this many times over
PROJECT_AT = (8, 64, 512)


@ray.remote(num_cpus=0)
class _Caller:
    """Stands where an agent-loop worker stands: runs trajectories, through the manager or its own data plane."""

    def __init__(self, servers: dict, manager, rollout, role: str):
        self.manager = manager
        self.plane = data_plane(servers, manager, rollout, role)
        self._following = asyncio.get_running_loop().create_task(follow(self.plane, manager))

    def pid(self) -> int:
        import os

        return os.getpid()

    async def run(self, layout: str, prompt: list[int], trajectories: int, concurrent: int, tag: str) -> list[float]:
        """`trajectories` multi-turn trajectories, `concurrent` at a time -> every call's wait in seconds."""
        waits: list[float] = []
        slots = asyncio.Semaphore(concurrent)
        sampling = SamplingParams(max_tokens=64, temperature=0.0)

        async def trajectory(i: int) -> None:
            async with slots:
                ids, uid, group = list(prompt), f"{tag}-{i}", f"{tag}-g{i // GROUP}"
                for turn in range(len(SCRIPT)):
                    start = time.perf_counter()
                    if layout == "central":
                        out = await self.manager.generate.remote(ids, sampling, f"{uid}-t{turn}", uid, group)
                    else:
                        out = await self.plane.generate(ids, sampling, f"{uid}-t{turn}", uid, group)
                    waits.append(time.perf_counter() - start)
                    ids = ids + out.token_ids
                if layout == "central":
                    self.manager.end_session.remote(uid)
                else:
                    self.plane.end_session(uid)

        await asyncio.gather(*(trajectory(i) for i in range(trajectories)))
        return waits


def _with_bench_settings(cfg: RunConfig) -> RunConfig:
    r = cfg.rollout
    delay = r.scripted_delay_s if r.scripted_delay_s != RolloutConfig().scripted_delay_s else DELAY_S  # a delay the user set is kept
    r = msgspec.structs.replace(r, engine="scripted", num_servers=max(2, r.num_servers), num_cpus=0.1, scripted_delay_s=delay)
    a = msgspec.structs.replace(cfg.agent, num_workers=4 if cfg.agent.num_workers == "auto" else max(4, cfg.agent.num_workers), max_concurrent_trajectories=min(cfg.agent.max_concurrent_trajectories, 64))
    return msgspec.structs.replace(cfg, rollout=r, agent=a)


def _cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def _round(layout: str, callers: list, prompt: list[int], per_caller: int, concurrent: int, pids: list[int], delay_s: float, tag: str) -> dict:
    cpu0, start = _cpu_s(pids), time.perf_counter()
    waits = [w for ws in ray.get([c.run.remote(layout, prompt, per_caller, concurrent, f"{tag}-{i}") for i, c in enumerate(callers)]) for w in ws]
    elapsed, cpu = time.perf_counter() - start, _cpu_s(pids) - cpu0
    added = sorted(max(0.0, w - delay_s) for w in waits)
    return {"calls": len(waits), "calls_per_s": len(waits) / elapsed, "added_ms_p50": 1000 * added[len(added) // 2],
            "added_ms_p99": 1000 * added[min(len(added) - 1, int(0.99 * len(added)))], "cpu_ms_per_call": 1000 * cpu / len(waits)}


def _pick_us(n: int, picks: int = 20_000) -> float:
    """The Router's pick + done, in microseconds, with n servers and groups of GROUP requests."""
    router = Router([f"s{i}" for i in range(n)])
    counter = iter(range(10**9))

    def one() -> None:
        i = next(counter)
        name = router.pick(f"sess{i}", f"g{i // GROUP}")
        router.done(name)
        router.end_session(f"sess{i}")

    return 1e6 * min(timeit.repeat(one, number=picks, repeat=3)) / picks


def bench(cfg: RunConfig) -> tuple[str, dict]:
    from raytool.models import load_tokenizer, resolve_model

    cfg = _with_bench_settings(cfg)
    r, a = cfg.rollout, cfg.agent
    connect(cfg.cluster.address)
    model_path = resolve_model(cfg.model.path)
    tokenizer = load_tokenizer(model_path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 6 * 7 + 1? Use the code tool."}], add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    options = dict(num_cpus=r.num_cpus)
    servers = {f"scale-server-{i}": RolloutServer.options(**actor_options(**options)).remote(f"scale-server-{i}", model_path, "scripted",
                                                                                           engine_options(cfg, seed=i))
               for i in range(r.num_servers)}
    manager = LLMManager.options(**actor_options(0.0)).remote(servers, affinity_slack=r.affinity_slack, stall_timeout_s=r.stall_timeout_s,
                                                              no_server_wait_s=60.0)
    callers = [_Caller.options(**actor_options(0.0)).remote(servers, manager, r, f"caller-{i}") for i in range(a.num_workers)]
    try:
        addresses = ray.get([s.ready.remote() for s in servers.values()])
        ray.get(manager.set_addresses.remote(dict(zip(servers, addresses))))
        caller_pids = ray.get([c.pid.remote() for c in callers])
        manager_pid = ray.get(manager.__ray_call__.remote(lambda self: __import__("os").getpid()))
        pids = [*caller_pids, manager_pid]
        concurrent = a.max_concurrent_trajectories
        per_caller = concurrent * TRAJECTORIES_PER_ROUND
        _round("central", callers, prompt, concurrent, concurrent, pids, r.scripted_delay_s, "warm-c")
        _round("direct", callers, prompt, concurrent, concurrent, pids, r.scripted_delay_s, "warm-d")
        rounds: dict[str, list[dict]] = {"central": [], "direct": []}
        manager_cpu: dict[str, list[float]] = {"central": [], "direct": []}
        for k in range(SCALE_ROUNDS):
            for layout in ("central", "direct"):
                m0 = _cpu_s([manager_pid])
                result = _round(layout, callers, prompt, per_caller, concurrent, pids, r.scripted_delay_s, f"{layout}-{k}")
                manager_cpu[layout].append(1000 * (_cpu_s([manager_pid]) - m0) / result["calls"])
                rounds[layout].append(result)
    finally:
        for actor in [*callers, manager, *servers.values()]:
            ray.kill(actor)

    def median(layout: str, key: str) -> float:
        return statistics.median(x[key] for x in rounds[layout])

    layouts = {}
    for layout in ("central", "direct"):
        layouts[layout] = {key: median(layout, key) for key in ("calls_per_s", "added_ms_p50", "added_ms_p99", "cpu_ms_per_call")}
        layouts[layout]["manager_cpu_ms_per_call"] = statistics.median(manager_cpu[layout])
    c, d = layouts["central"], layouts["direct"]
    # Ceilings: each caller is a process with a core of its own; the central manager is one process for all.
    caller_c = max(1e-6, c["cpu_ms_per_call"] - c["manager_cpu_ms_per_call"])
    caller_d = max(1e-6, d["cpu_ms_per_call"] - d["manager_cpu_ms_per_call"])
    projected = {str(w): {"central": min(1000 * w / caller_c, 1000 / max(1e-6, c["manager_cpu_ms_per_call"])),
                          "direct": 1000 * w / caller_d} for w in PROJECT_AT}
    picks = {str(n): _pick_us(n) for n in (8, 64, 256, 1024)}
    result = {
        "servers": r.num_servers, "callers": a.num_workers, "concurrent_trajectories": concurrent * a.num_workers,
        "turns": len(SCRIPT), "scripted_delay_s": r.scripted_delay_s, "rounds": SCALE_ROUNDS,
        "layouts": layouts, "all_rounds": rounds,
        "scale_vs_central": d["calls_per_s"] / c["calls_per_s"],
        "cpu_per_call_vs_central": d["cpu_ms_per_call"] / c["cpu_ms_per_call"],
        "projected_calls_per_s": projected,
        "router_pick_us": picks, "router_pick_1024_vs_8": picks["1024"] / picks["8"],
    }
    lines = [f"scale bench: {r.num_servers} scripted servers ({r.scripted_delay_s:g} s per answer), {a.num_workers} callers x "
             f"{concurrent} trajectories of {len(SCRIPT)} turns at once, {SCALE_ROUNDS} alternating rounds per layout (medians)",
             f"{'layout':<10}{'calls/s':>10}{'added p50 ms':>14}{'added p99 ms':>14}{'CPU ms/call':>13}{'of it manager':>15}"]
    for layout, x in layouts.items():
        lines.append(f"{layout:<10}{x['calls_per_s']:>10.0f}{x['added_ms_p50']:>14.1f}{x['added_ms_p99']:>14.1f}{x['cpu_ms_per_call']:>13.2f}"
                     f"{x['manager_cpu_ms_per_call']:>15.2f}")
    lines.append(f"scale_vs_central {result['scale_vs_central']:.2f} (goal >= 1.5)   cpu_per_call_vs_central "
                 f"{result['cpu_per_call_vs_central']:.2f} (goal <= 0.5)")
    lines.append("projected ceiling, calls/s (one core per caller; central is capped by its one routing process):")
    lines += [f"  {w:>4} callers: central {p['central']:>9.0f}   direct {p['direct']:>9.0f}" for w, p in projected.items()]
    lines.append("Router pick+done, us: " + "   ".join(f"{n} servers {us:.1f}" for n, us in picks.items()))
    return "\n".join(lines), result
