"""`raytool bench router`: a seeded discrete-event simulation of one GRPO rollout step on N vLLM-like
servers, comparing routing policies by makespan, request latency and prefix-cache hit rate.

Why: `raytool.routing.Router` decides from in-flight counts alone. This measures what its session
stickiness and group affinity buy (prefix-cache hits) and what they cost (load imbalance) against
round-robin, plain least-in-flight, and an oracle that knows every request's true length. The real
Router object makes raytool's picks, and its pick+done overhead is timed on its own.

Server model (one per server, like vLLM with continuous batching and automatic prefix caching):
- up to `max_batch` sequences admitted, the rest wait FIFO; admitted requests are prefilled one at a
  time, prefill first (decode pauses meanwhile, as in vLLM's prefill-priority scheduling), taking
  `prefill_s_per_token` per uncached prompt token;
- decoding advances every running sequence one token per step of `step_a_s + step_b_s * batch`
  seconds (simulated as a fluid: between events the batch and so the step time are constant);
- a per-server LRU of cached prefixes of `kv_cache_tokens` tokens: a group's prompt (GRPO siblings
  share it) and each trajectory's conversation so far (turn k+1 extends turn k's prompt + output).
  A request pays prefill only for what its server does not hold: a session entry counts only behind
  its group's prompt, as vLLM's block hashes chain.

Workload (defaults of `Workload`, one GRPO step, everything submitted at t=0): 8 servers; 256 prompts
x 8 samples; prompt (system + tool schema + task) lognormal median 1500 tokens; 1-4 assistant turns
per trajectory (uniform); output per turn lognormal median 300 tokens, sigma 0.9, times a per-prompt
difficulty factor lognormal(0, 0.5) (hard prompts make all siblings long), capped at 4096; between
turns a tool call of lognormal median 0.5 s (sigma 1.0) whose output adds lognormal median 200
tokens (sigma 0.8); decode step 8 ms + 0.1 ms per sequence in the batch, prefill 0.05 ms per token
(a 7B model on one H100: ~20k prefill tokens/s, ~34 ms per step at batch 256), max_batch 256, and a
KV pool of 800k tokens per server (7B GQA at ~57 KB/token on an 80 GB GPU).

Policies: round-robin; least in flight (ties: fewest requests so far, then server order); raytool
(the real Router with its default affinity_slack, pick at arrival, done at finish, end_session when a
trajectory ends); and the least-work oracle: it knows every output length and each server's queue,
prefill backlog and prefix cache, and sends a request where the server's estimated time to drain,
this request included, is least (it gets cache hits wherever it lands on a server that has them).

What it shows: at 256 trajectories per server the step is throughput-bound and uncached prefill is
over a quarter of a server's time, so stickiness wins and even the oracle, which balances work by
moving sessions off their cached server, loses to raytool. At 32 per server (prompts=32) the step is
bound by its longest trajectory: raytool is then 1.02x the oracle and 0.96x round-robin.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from bisect import bisect_left, insort
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from raytool.routing import Router

POLICIES = ("round_robin", "least_inflight", "raytool", "oracle_least_work")


@dataclass(frozen=True)
class Workload:
    """One GRPO step's trajectories and the servers' cost model (see the module docstring)."""

    servers: int = 8
    prompts: int = 256  # GRPO prompts in the step
    samples: int = 8  # GRPO group size n
    max_turns: int = 4  # assistant turns per trajectory: uniform in 1..max_turns
    prompt_tokens: float = 1500  # median group prompt length (lognormal, sigma 0.5)
    output_tokens: float = 300  # median tokens per assistant turn (lognormal, sigma output_sigma)
    output_sigma: float = 0.9
    difficulty_sigma: float = 0.5  # per-prompt factor on output length shared by the siblings
    max_output_tokens: int = 4096
    tool_tokens: float = 200  # median tool output length (lognormal, sigma 0.8)
    tool_latency_s: float = 0.5  # median tool call latency (lognormal, sigma 1.0)
    max_batch: int = 256
    step_a_s: float = 0.008  # decode step time = step_a_s + step_b_s * batch
    step_b_s: float = 0.0001
    prefill_s_per_token: float = 0.00005
    kv_cache_tokens: int = 800_000


QUICK = Workload(prompts=32, samples=8, max_batch=64, kv_cache_tokens=200_000)  # for tests: ~0.1 s


@dataclass(slots=True)
class _Turn:
    out: int
    tool_tokens: int
    tool_latency_s: float


@dataclass(slots=True)
class _Request:
    traj: int
    group: int
    turn: int
    prompt: int  # the group prompt's tokens
    extra: int  # conversation tokens after the group prompt (previous turns and tool outputs)
    out: int
    arrival: float = 0.0
    est_uncached: int = 0  # uncached prompt tokens at arrival: the server's prefill backlog, for the oracle


def make_trajectories(w: Workload, seed: int) -> list[tuple[int, int, list[_Turn]]]:
    """(group, prompt tokens, turns) per trajectory, group-major as a GRPO step submits them."""
    rng = random.Random(seed)
    trajs = []
    for g in range(w.prompts):
        prompt = max(64, round(rng.lognormvariate(math.log(w.prompt_tokens), 0.5)))
        difficulty = rng.lognormvariate(0.0, w.difficulty_sigma)
        for _ in range(w.samples):
            turns = []
            for _ in range(rng.randint(1, w.max_turns)):
                out = rng.lognormvariate(math.log(w.output_tokens * difficulty), w.output_sigma)
                turns.append(
                    _Turn(
                        out=max(1, min(w.max_output_tokens, round(out))),
                        tool_tokens=max(1, round(rng.lognormvariate(math.log(w.tool_tokens), 0.8))),
                        tool_latency_s=rng.lognormvariate(math.log(w.tool_latency_s), 1.0),
                    )
                )
            trajs.append((g, prompt, turns))
    return trajs


class _PrefixCache:
    """LRU of prefixes by token count: ("g", group) -> prompt tokens, ("s", traj) -> conversation tokens."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.tokens = 0
        self._entries: OrderedDict[tuple[str, int], int] = OrderedDict()

    def cached(self, req: _Request, touch: bool = True) -> int:
        """Prompt tokens of `req` this server holds (a session's only behind its group prompt)."""
        if ("g", req.group) not in self._entries:
            return 0
        session = self._entries.get(("s", req.traj), 0)
        if touch:
            self._entries.move_to_end(("g", req.group))
            if session:
                self._entries.move_to_end(("s", req.traj))
        return req.prompt + min(session, req.extra)

    def put(self, key: tuple[str, int], tokens: int) -> None:
        self.tokens += tokens - self._entries.get(key, 0)
        self._entries[key] = tokens
        self._entries.move_to_end(key)
        while self.tokens > self.capacity:
            self.tokens -= self._entries.popitem(last=False)[1]


@dataclass
class _Server:
    w: Workload
    cache: _PrefixCache
    t: float = 0.0
    prog: float = 0.0  # decode steps every running sequence has taken, as a fluid
    running: list = field(default_factory=list)  # sorted (finish prog, id, request)
    prefilling: deque = field(default_factory=deque)  # admitted, waiting for or in prefill (head)
    prefill_end: float | None = None
    waiting: deque = field(default_factory=deque)  # not admitted: batch full
    version: int = 0  # invalidates this server's stale events in the heap
    finish_prog_sum: float = 0.0  # for the oracle
    queued_out: list = field(default_factory=list)  # sorted outputs of prefilling + waiting (oracle)
    queued_out_sum: int = 0
    backlog_tokens: int = 0  # oracle's estimate of uncached prompt tokens still to prefill
    cached_tokens: int = 0
    prompt_tokens: int = 0

    def step_s(self) -> float:
        return self.w.step_a_s + self.w.step_b_s * len(self.running)

    def advance(self, now: float) -> None:
        if self.prefill_end is None and self.running:
            self.prog += (now - self.t) / self.step_s()
        self.t = now

    def next_time(self) -> float | None:
        if self.prefill_end is not None:
            return self.prefill_end
        if self.running:
            return self.t + (self.running[0][0] - self.prog) * self.step_s()
        return None

    def arrive(self, now: float, req: _Request) -> None:
        self.advance(now)
        req.est_uncached = req.prompt + req.extra - self.cache.cached(req, touch=False)
        self.waiting.append(req)
        insort(self.queued_out, req.out)
        self.queued_out_sum += req.out
        self.backlog_tokens += req.est_uncached
        self._admit(now)

    def on_event(self, now: float) -> list[_Request]:
        """Finish a prefill or the sequences due now; returns the requests that completed."""
        finished = []
        if self.prefill_end is not None:
            self.t = now
            req = self.prefilling.popleft()
            self.cache.put(("g", req.group), req.prompt)
            insort(self.running, (self.prog + req.out, id(req), req))
            self.finish_prog_sum += self.prog + req.out
            self.queued_out.pop(bisect_left(self.queued_out, req.out))
            self.queued_out_sum -= req.out
            self.backlog_tokens -= req.est_uncached
            self.prefill_end = None
            if self.prefilling:
                self._start_prefill(now)
        else:
            self.t, self.prog = now, self.running[0][0]  # snap: this event was scheduled for it
            while self.running and self.running[0][0] <= self.prog + 1e-9:
                fin, _, req = self.running.pop(0)
                self.finish_prog_sum -= fin
                self.cache.put(("s", req.traj), req.extra + req.out)
                finished.append(req)
        self._admit(now)
        return finished

    def drain_estimate_s(self, req: _Request) -> float:
        """Seconds this server needs to finish all it holds plus `req`, had it no further arrivals."""
        rem_sum = self.finish_prog_sum - len(self.running) * self.prog + self.queued_out_sum + req.out
        rem_max = max(self.running[-1][0] - self.prog if self.running else 0, self.queued_out[-1] if self.queued_out else 0, req.out)
        backlog = self.backlog_tokens + req.prompt + req.extra - self.cache.cached(req, touch=False)
        w = self.w
        return backlog * w.prefill_s_per_token + rem_sum * w.step_b_s + w.step_a_s * max(rem_max, rem_sum / w.max_batch)

    def _admit(self, now: float) -> None:
        while self.waiting and len(self.running) + len(self.prefilling) < self.w.max_batch:
            self.prefilling.append(self.waiting.popleft())
            if len(self.prefilling) == 1:
                self._start_prefill(now)

    def _start_prefill(self, now: float) -> None:
        req = self.prefilling[0]
        cached = self.cache.cached(req)
        self.cached_tokens += cached
        self.prompt_tokens += req.prompt + req.extra
        self.prefill_end = now + (req.prompt + req.extra - cached) * self.w.prefill_s_per_token


class _Policy:
    """Picks a server index when a request arrives; told when it finishes and when its trajectory ends."""

    def pick(self, req: _Request, now: float) -> int:
        raise NotImplementedError

    def done(self, server: int, req: _Request, latency_s: float) -> None:
        pass

    def end(self, req: _Request) -> None:
        pass


class _RoundRobin(_Policy):
    def __init__(self, servers: list[_Server]):
        self.n, self.last = len(servers), -1

    def pick(self, req: _Request, now: float) -> int:
        self.last = (self.last + 1) % self.n
        return self.last


class _LeastInFlight(_Policy):
    """Fewest requests in flight; ties as the Router breaks them (fewest so far, then order)."""

    def __init__(self, servers: list[_Server]):
        self.in_flight, self.requests = [0] * len(servers), [0] * len(servers)

    def pick(self, req: _Request, now: float) -> int:
        i = min(range(len(self.in_flight)), key=lambda s: (self.in_flight[s], self.requests[s]))
        self.in_flight[i] += 1
        self.requests[i] += 1
        return i

    def done(self, server: int, req: _Request, latency_s: float) -> None:
        self.in_flight[server] -= 1


class _Raytool(_Policy):
    """The real Router, with its defaults, making every pick."""

    def __init__(self, servers: list[_Server]):
        self.names = [f"server-{i}" for i in range(len(servers))]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.router = Router(self.names)

    def pick(self, req: _Request, now: float) -> int:
        return self.index[self.router.pick(f"traj-{req.traj}", f"group-{req.group}")]

    def done(self, server: int, req: _Request, latency_s: float) -> None:
        self.router.done(self.names[server], ok=True, latency_s=latency_s)

    def end(self, req: _Request) -> None:
        self.router.end_session(f"traj-{req.traj}")


class _OracleLeastWork(_Policy):
    """Knows every output length: the server whose estimated drain time, with this request, is least."""

    def __init__(self, servers: list[_Server]):
        self.servers = servers

    def pick(self, req: _Request, now: float) -> int:
        for srv in self.servers:
            srv.advance(now)
        return min(range(len(self.servers)), key=lambda i: self.servers[i].drain_estimate_s(req))


_POLICY_CLASSES = {"round_robin": _RoundRobin, "least_inflight": _LeastInFlight, "raytool": _Raytool, "oracle_least_work": _OracleLeastWork}


@dataclass
class PolicyRun:
    makespan_s: float
    latencies_s: list[float]
    cached_tokens: int
    prompt_tokens: int


def simulate(w: Workload, policy: str, seed: int) -> PolicyRun:
    """One GRPO step of `w` under `policy`; the same seed gives the same trajectories to every policy."""
    trajs = make_trajectories(w, seed)
    servers = [_Server(w, _PrefixCache(w.kv_cache_tokens)) for _ in range(w.servers)]
    picker = _POLICY_CLASSES[policy](servers)
    events: list = []  # (time, tie, server, version, None) or (time, tie, -1, 0, request whose tool call returns)
    tie = itertools.count()
    latencies, makespan = [], 0.0

    def schedule(i: int) -> None:
        srv = servers[i]
        srv.version += 1
        t = srv.next_time()
        if t is not None:
            heapq.heappush(events, (t, next(tie), i, srv.version, None))

    def submit(now: float, traj: int, turn: int, extra: int) -> None:
        group, prompt, turns = trajs[traj]
        req = _Request(traj, group, turn, prompt, extra, turns[turn].out, arrival=now)
        i = picker.pick(req, now)
        servers[i].arrive(now, req)
        schedule(i)

    for traj in range(len(trajs)):
        submit(0.0, traj, 0, 0)
    while events:
        now, _, i, version, prev = heapq.heappop(events)
        if prev is not None:
            tool = trajs[prev.traj][2][prev.turn]
            submit(now, prev.traj, prev.turn + 1, prev.extra + prev.out + tool.tool_tokens)
            continue
        if version != servers[i].version:
            continue
        for req in servers[i].on_event(now):
            latencies.append(now - req.arrival)
            picker.done(i, req, now - req.arrival)
            turns = trajs[req.traj][2]
            if req.turn + 1 < len(turns):
                heapq.heappush(events, (now + turns[req.turn].tool_latency_s, next(tie), -1, 0, req))
            else:
                picker.end(req)
                makespan = now
        schedule(i)
    return PolicyRun(makespan, latencies, sum(s.cached_tokens for s in servers), sum(s.prompt_tokens for s in servers))


def router_overhead_us(calls: int = 100_000, servers: int = 8, trajectories: int = 2048, group_size: int = 8, window: int = 256) -> float:
    """Wall-clock microseconds per Router.pick + Router.done, with `window` requests kept in flight."""
    router = Router([f"server-{i}" for i in range(servers)])
    rng = random.Random(0)
    keys = [(f"traj-{t}", f"group-{t // group_size}") for t in range(trajectories)]
    order = [keys[rng.randrange(trajectories)] for _ in range(calls)]
    pending: deque = deque()
    start = time.perf_counter()
    for session, group in order:
        pending.append(router.pick(session, group))
        if len(pending) > window:
            router.done(pending.popleft(), ok=True, latency_s=1.0)
    while pending:
        router.done(pending.popleft(), ok=True, latency_s=1.0)
    return (time.perf_counter() - start) / calls * 1e6


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(w: Workload = Workload(), seeds: tuple[int, ...] = (0, 1, 2), overhead_calls: int = 100_000) -> tuple[str, dict]:
    """Every policy on every seed: (a printable table, the result dict with the headline ratios)."""
    summary = {}
    for policy in POLICIES:
        runs = [simulate(w, policy, seed) for seed in seeds]
        summary[policy] = {
            "makespan_s": sum(r.makespan_s for r in runs) / len(runs),
            "p50_s": sum(_percentile(r.latencies_s, 0.50) for r in runs) / len(runs),
            "p99_s": sum(_percentile(r.latencies_s, 0.99) for r in runs) / len(runs),
            "prefix_hit_rate": sum(r.cached_tokens for r in runs) / sum(r.prompt_tokens for r in runs),
        }
    ours = summary["raytool"]
    result = {
        "makespan_vs_oracle": ours["makespan_s"] / summary["oracle_least_work"]["makespan_s"],
        "makespan_vs_round_robin": ours["makespan_s"] / summary["round_robin"]["makespan_s"],
        "p99_vs_least_inflight": ours["p99_s"] / summary["least_inflight"]["p99_s"],
        "prefix_hit_rate": ours["prefix_hit_rate"],
        "overhead_us": router_overhead_us(overhead_calls, servers=w.servers),
        "policies": summary,
        "seeds": list(seeds),
        "workload": {k: getattr(w, k) for k in w.__dataclass_fields__},
    }
    return _table(summary, result), result


def _table(summary: dict, result: dict) -> str:
    lines = [f"{'policy':<20}{'makespan s':>12}{'p50 s':>9}{'p99 s':>9}{'prefix hit':>12}"]
    for policy, s in summary.items():
        lines.append(f"{policy:<20}{s['makespan_s']:>12.1f}{s['p50_s']:>9.2f}{s['p99_s']:>9.2f}{s['prefix_hit_rate']:>12.1%}")
    lines.append("")
    for key in ("makespan_vs_oracle", "makespan_vs_round_robin", "p99_vs_least_inflight", "prefix_hit_rate", "overhead_us"):
        lines.append(f"{key:<26}{result[key]:.3f}")
    return "\n".join(lines)


def bench(cfg=None, quick: bool = False) -> tuple[str, dict]:
    """`raytool bench router`: the workload is the module's own (the run config is not used)."""
    if quick:
        return run(QUICK, seeds=(0,), overhead_calls=5_000)
    return run()
