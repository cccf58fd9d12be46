"""Custom Ray metrics of the actors and the driver (ray.util.metrics), served by Ray on each node's metrics port.

What Ray 2.60 does with them (read in its source, measured here):
- every process exports its metrics every `metrics_report_interval_ms` (default 10 s; set
  RAY_metrics_report_interval_ms in a process's environment, floored at 1 s) to its node's metrics
  agent, which serves them as Prometheus text at http://NODE:METRICS_EXPORT_PORT/metrics (the port
  `ray start --metrics-export-port` gives). The agent prefixes every name with `ray_`, and a counter
  gets `_total`: the counter `raytool_sandbox_cells` is scraped as `ray_raytool_sandbox_cells_total`.
  Each series also carries Ray's labels (WorkerId, NodeAddress, SessionName, ...).
- a process sends a gauge only in the interval it was set in, and the agent drops a gauge series
  not refreshed for two of its own intervals (~20 s by default). So the gauges here are not set
  where things happen but by a sampler thread per process that reads the current state every
  half report interval (at most 5 s): an idle server keeps its series, a dead one loses it.
- a histogram's `_sum` is rebuilt by the agent from bucket midpoints: approximate; `_count` and
  the buckets are exact.
- metrics recorded in the driver (a `ray.init(address=...)` process or a `ray job submit`
  entrypoint) are exported too; recording in a process that is not connected is a no-op.

Every series has a `run` tag: $RAYTOOL_RUN if set, else the Ray job id (the driver and the actors
it starts share it). Recording costs a few microseconds per request and never raises: a metric
that fails logs one warning and the request goes on.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

RUN_ENV = "RAYTOOL_RUN"
MAX_SAMPLE_S = 5.0  # gauges are re-set at least this often (the agent forgets them after ~20 s)
TOKENS_WINDOW_S = 30.0  # tokens/s is the rate over this recent window

# Histogram bucket bounds, in seconds.
GENERATE_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]
SANDBOX_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
REWARD_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]

POOL_EVENTS = ("rejected", "retried", "fast_failed", "probes")  # PooledBackend.counts


class RateWindow:
    """Events per second over the last `window_s` seconds, in `buckets` time slots (thread-safe:
    the request path adds, the sampler thread reads). Until `window_s` has passed since the first
    event the rate is over the time since then, so a fresh server does not read low."""

    def __init__(self, window_s: float = TOKENS_WINDOW_S, buckets: int = 30):
        self.window_s = window_s
        self.width = window_s / buckets
        self.slots: collections.deque[list] = collections.deque()  # [slot index, count], oldest first
        self.first: float | None = None
        self.lock = threading.Lock()

    def add(self, n: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        slot = int(now // self.width)
        with self.lock:
            if self.first is None:
                self.first = now
            if self.slots and self.slots[-1][0] == slot:
                self.slots[-1][1] += n
            else:
                self.slots.append([slot, n])
            self._drop_old(slot)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self.lock:
            if self.first is None:
                return 0.0
            self._drop_old(int(now // self.width))
            total = sum(n for _, n in self.slots)
        return total / max(self.width, min(self.window_s, now - self.first))

    def _drop_old(self, slot: int) -> None:
        oldest = slot - round(self.window_s / self.width) + 1
        while self.slots and self.slots[0][0] < oldest:
            self.slots.popleft()


# -- plumbing: one metric object per name per process, a sampler thread, recording that never raises ---


def run_tag() -> str:
    if os.environ.get(RUN_ENV):
        return os.environ[RUN_ENV]
    try:
        import ray

        return ray.get_runtime_context().get_job_id() if ray.is_initialized() else "none"
    except Exception:  # no Ray context in this process: the tag is only a label
        return "none"


_made: dict[str, object] = {}
_made_lock = threading.Lock()


def _metric(kind: str, name: str, description: str, tag_keys: tuple[str, ...] = (), boundaries: list[float] | None = None):
    """The process's one `kind` metric called `name` (made on first use, with the run tag set)."""
    metric = _made.get(name)
    if metric is None:
        from ray.util import metrics

        with _made_lock:
            metric = _made.get(name)
            if metric is None:
                keys = ("run", *tag_keys)
                if kind == "histogram":
                    metric = metrics.Histogram(name, description, boundaries=boundaries, tag_keys=keys)
                else:
                    metric = getattr(metrics, kind.capitalize())(name, description, tag_keys=keys)
                metric.set_default_tags({"run": run_tag()})
                _made[name] = metric
    return metric


_warned: set[str] = set()


def _never_raises(fn: Callable) -> Callable:
    """A recording function that logs its first failure and otherwise says nothing: metrics must
    not fail a request."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            if fn.__qualname__ not in _warned:
                _warned.add(fn.__qualname__)
                log.warning("metrics: %s failed (%s: %s); the work goes on, this metric may be missing", fn.__qualname__,
                            type(exc).__name__, exc)

    return wrapper


def sample_interval_s() -> float:
    """Half this process's metrics report interval, between 0.5 and MAX_SAMPLE_S seconds."""
    try:
        import ray

        interval_s = ray._config.metrics_report_interval_ms() / 1000
    except Exception:  # a private Ray API: fall back to its default of 10 s
        interval_s = 10.0
    return min(MAX_SAMPLE_S, max(0.5, interval_s / 2))


class _Sampler:
    """One daemon thread per process that calls every registered gauge-setting function."""

    def __init__(self):
        self.fns: list[Callable[[], None]] = []
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def add(self, fn: Callable[[], None]) -> None:
        fn = _never_raises(fn)
        fn()
        with self.lock:
            self.fns.append(fn)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, args=(sample_interval_s(),), name="raytool-metrics", daemon=True)
                self.thread.start()

    def _run(self, every_s: float) -> None:
        while True:
            time.sleep(every_s)
            with self.lock:
                fns = list(self.fns)
            for fn in fns:
                fn()


_sampler = _Sampler()


# -- rollout server ---------------------------------------------------------------------------


class RolloutMetrics:
    """A RolloutServer's: requests in flight, generated tokens (count and recent tokens/s), request
    seconds, the policy version it holds; all tagged with `server`."""

    def __init__(self, server: str, in_flight: Callable[[], int], policy_version: Callable[[], int | None]):
        self.tags = {"server": server}
        self.window = RateWindow()
        self.tokens = _metric("counter", "raytool_rollout_generated_tokens", "Tokens generated by a rollout server.", ("server",))
        self.seconds = _metric("histogram", "raytool_rollout_request_seconds", "Seconds one generate request took in the engine.",
                               ("server",), GENERATE_BUCKETS)
        self.in_flight = in_flight
        self.policy_version = policy_version
        _sampler.add(self.sample)

    @_never_raises
    def request_done(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.tokens.inc(tokens, self.tags)
            self.window.add(tokens)
        self.seconds.observe(seconds, self.tags)

    def sample(self) -> None:
        _metric("gauge", "raytool_rollout_in_flight", "Generate requests a rollout server is working on.", ("server",)).set(
            self.in_flight(), self.tags)
        _metric("gauge", "raytool_rollout_tokens_per_second", f"Tokens generated per second over the last {TOKENS_WINDOW_S:g} s.",
                ("server",)).set(self.window.rate(), self.tags)
        version = self.policy_version()
        if version is not None:
            _metric("gauge", "raytool_rollout_policy_version", "Policy version of the weights a rollout server holds.",
                    ("server",)).set(version, self.tags)


# -- LLM manager ------------------------------------------------------------------------------


class ManagerMetrics:
    """The LLMManager's: retried requests and ejections (by server), healthy servers."""

    def __init__(self, healthy: Callable[[], int]):
        self.retries = _metric("counter", "raytool_llm_retries", "Generate requests retried on another server after a failure.",
                               ("server",))
        self.ejections = _metric("counter", "raytool_llm_ejections", "Rollout servers taken out of rotation.", ("server",))
        self.healthy = healthy
        _sampler.add(self.sample)

    @_never_raises
    def retried(self, server: str) -> None:
        self.retries.inc(1, {"server": server})

    @_never_raises
    def ejected(self, server: str) -> None:
        self.ejections.inc(1, {"server": server})

    def sample(self) -> None:
        _metric("gauge", "raytool_llm_servers_healthy", "Rollout servers in the LLM manager's rotation.").set(self.healthy())


# -- sandbox pool -----------------------------------------------------------------------------


class SandboxMetrics:
    """A SandboxPool's (`pool` tag): cells by ExecResult status, cell seconds (queue wait included),
    queue depth, running cells, breaker state, and the pool's rejections, retries, fast failures
    and breaker probes (PooledBackend.counts)."""

    def __init__(self, pool_name: str, pool):
        self.tags = {"pool": pool_name}
        self.pool = pool
        self.cells = _metric("counter", "raytool_sandbox_cells", "Code cells a sandbox pool finished, by ExecResult status.",
                             ("pool", "status"))
        self.seconds = _metric("histogram", "raytool_sandbox_cell_seconds", "Seconds from a cell's arrival at the pool to its result.",
                               ("pool",), SANDBOX_BUCKETS)
        self.events = _metric("counter", "raytool_sandbox_events", "Sandbox pool events: rejected (queue full), retried, "
                              "fast_failed (breaker open), probes.", ("pool", "event"))
        self.seen = {event: 0 for event in POOL_EVENTS}
        _sampler.add(self.sample)

    @_never_raises
    def cell_done(self, status: str, seconds: float) -> None:
        self.cells.inc(1, {**self.tags, "status": status})
        self.seconds.observe(seconds, self.tags)

    def sample(self) -> None:
        p = self.pool
        _metric("gauge", "raytool_sandbox_queue_depth", "Cells waiting for a slot in a sandbox pool.", ("pool",)).set(p.waiting, self.tags)
        _metric("gauge", "raytool_sandbox_running", "Cells running in a sandbox pool.", ("pool",)).set(p.running, self.tags)
        _metric("gauge", "raytool_sandbox_breaker_open", "1 while a sandbox pool's circuit breaker is open or half-open.",
                ("pool",)).set(float(p.breaker.state != "closed"), self.tags)
        for event in POOL_EVENTS:
            now = p.counts[event]
            if now > self.seen[event]:
                self.events.inc(now - self.seen[event], {**self.tags, "event": event})
                self.seen[event] = now


# -- reward worker ----------------------------------------------------------------------------


class RewardMetrics:
    def __init__(self, fn: str):
        self.tags = {"fn": fn}
        self.seconds = _metric("histogram", "raytool_reward_seconds", "Seconds to score one trajectory.", ("fn",), REWARD_BUCKETS)

    @_never_raises
    def scored(self, seconds: float) -> None:
        self.seconds.observe(seconds, self.tags)


# -- trainer / driver -------------------------------------------------------------------------

_step: dict = {}  # what the driver's last record_step said; the sampler re-sets it


@_never_raises
def record_step(step: int, step_s: float, train_s: float, sync_s: float, trainer_version: int, server_versions: dict[str, int],
                rollout_s: float | None = None) -> None:
    """Called by the driver once per training step: its timings, the trainer's policy version and
    each rollout server's lag behind it (`server_versions`: server -> the policy version it holds;
    a server left out, e.g. ejected, has its lag series dropped). Never raises."""
    first = not _step
    _step.update(step=step, step_s=step_s, train_s=train_s, sync_s=sync_s, rollout_s=rollout_s,
                 version=trainer_version, servers=dict(server_versions))
    if first:
        _sampler.add(_sample_step)
    else:
        _never_raises(_sample_step)()


def _sample_step() -> None:
    s = _step
    _metric("gauge", "raytool_trainer_step", "Training steps done.").set(s["step"])
    _metric("gauge", "raytool_trainer_step_seconds", "Seconds of the last training step (rollout, update, weight sync).").set(s["step_s"])
    _metric("gauge", "raytool_trainer_train_seconds", "Seconds of the last step's policy update.").set(s["train_s"])
    _metric("gauge", "raytool_trainer_weight_sync_seconds", "Seconds of the last weight sync to the rollout servers.").set(s["sync_s"])
    if s["rollout_s"] is not None:
        _metric("gauge", "raytool_trainer_rollout_seconds", "Seconds of the last step's rollout.").set(s["rollout_s"])
    _metric("gauge", "raytool_trainer_policy_version", "Policy version of the trainer's weights.").set(s["version"])
    lag = _metric("gauge", "raytool_policy_version_lag", "Trainer policy version minus the version a rollout server holds.",
                  ("server",))
    for server, version in s["servers"].items():
        lag.set(s["version"] - version, {"server": server})
