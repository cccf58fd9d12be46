"""A sandbox backend behind a concurrency limit, a bounded queue, retries and a circuit breaker.

`PooledBackend` is the logic of the `SandboxPool` actor (actors/sandbox_pool.py), kept here so it
is tested without Ray:
- at most `max_concurrency` cells run at once; at most `max_queue` wait for a slot, and a cell
  beyond that is refused at once (`infra_error`, "pool is full") instead of piling up in memory;
- a cell whose backend failed (`infra_error`) is run again up to `retries` times; failing code is
  never re-run;
- `breaker_failures` infrastructure failures in a row open the breaker: cells fail fast with a
  clear message for `breaker_reset_s`, then one probe cell decides whether the backend is back;
- a cell that continues a session this pool never ran (`continuing=True`: the caller ran earlier
  cells of it, on a pool process that has since died and been restarted) is not run on a fresh
  interpreter as if nothing happened: it fails as `infra_error` ("session lost"), counted, so the
  trajectory's group is rolled out again instead of training on a silently reset interpreter;
- metrics: queue depth, running cells, latency p50/p99 over a recent window, counts per status.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import random
import time
from collections import Counter

from raytool.overload import backoff_s, queued
from raytool.types import ExecResult

log = logging.getLogger(__name__)

PROBE_CODE = "print('ok')"
LATENCY_WINDOW = 2048  # recent cells the latency percentiles are computed over


def percentile(values, q: float) -> float:
    """The q-quantile (0..1) of `values` by nearest rank; 0.0 when empty."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class Breaker:
    """Opens after `failures` consecutive failures; after `reset_s` lets one probe decide."""

    def __init__(self, failures: int, reset_s: float):
        self.failures, self.reset_s = failures, reset_s
        self.consecutive = 0
        self.open_until: float | None = None
        self.last_failure = ""
        self.opened = 0  # times it opened, for the metrics

    @property
    def state(self) -> str:
        if self.open_until is None:
            return "closed"
        return "open" if time.monotonic() < self.open_until else "half-open"

    def record(self, ok: bool, why: str = "") -> None:
        if ok:
            self.consecutive, self.open_until = 0, None
            return
        self.consecutive += 1
        self.last_failure = why
        if self.consecutive >= self.failures or self.open_until is not None:
            if self.open_until is None or time.monotonic() >= self.open_until:
                self.opened += 1
                log.warning("sandbox pool: circuit breaker open after %d infrastructure failures (last: %s)", self.consecutive, why)
            self.open_until = time.monotonic() + self.reset_s


class PooledBackend:
    def __init__(self, backend, *, name: str = "sandbox", max_concurrency: int = 8, max_queue: int = 256, retries: int = 1,
                 timeout_s: float = 5.0, memory_mb: int = 1024, breaker_failures: int = 5, breaker_reset_s: float = 10.0,
                 retry_backoff_s: float = 0.2):
        self.backend = backend
        self.name = name
        self.slots = asyncio.Semaphore(max_concurrency)
        self.max_concurrency, self.max_queue = max_concurrency, max_queue
        self.retries, self.retry_backoff_s = retries, retry_backoff_s
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.breaker = Breaker(breaker_failures, breaker_reset_s)
        self._probe_lock = asyncio.Lock()
        self.waiting = 0
        self.running = 0
        self.status_counts: Counter = Counter()
        self.counts: Counter = Counter()  # rejected, retried, fast_failed, probes
        self.latencies: collections.deque = collections.deque(maxlen=LATENCY_WINDOW)
        self.sessions: set[str] = set()  # sessions this pool has run a cell of (and not closed)

    async def start(self) -> None:
        """Start the backend (the local one forks its warm sessions here)."""
        await self.backend.start()

    async def execute(self, code: str, session: str | None = None, continuing: bool = False) -> ExecResult:
        """Run one cell; `continuing`: the caller ran earlier cells of `session` (on this pool, it believes)."""
        start = time.monotonic()
        if session is not None and continuing and session not in self.sessions:
            self.counts["sessions_lost"] += 1
            return self._finish(start, ExecResult(status="infra_error", stderr=(
                f"{self.name}: session {session} is lost (the sandbox pool restarted since its last cell): its interpreter state is gone")))
        if session is not None:
            self.sessions.add(session)
        if not await self._breaker_allows():
            self.counts["fast_failed"] += 1
            return self._finish(start, ExecResult(status="infra_error", stderr=(
                f"{self.name}: the sandbox backend is down ({self.breaker.consecutive} infrastructure failures in a row; last: "
                f"{self.breaker.last_failure}); failing fast until a probe succeeds")))
        if self.waiting >= self.max_queue and self.slots.locked():
            self.counts["rejected"] += 1
            return self._finish(start, ExecResult(status="infra_error", stderr=(
                f"{self.name}: the sandbox pool is full ({self.running} cells running, {self.waiting} queued); try again later")))
        self.waiting += 1
        try:
            waited = await queued(self.slots)
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            for attempt in range(self.retries + 1):
                if attempt:
                    self.counts["retried"] += 1
                    await asyncio.sleep(backoff_s(attempt, self.retry_backoff_s))
                result = await self.backend.run(code, session=session, timeout_s=self.timeout_s, memory_mb=self.memory_mb)
                if result.status != "infra_error":
                    break
        finally:
            self.running -= 1
            self.slots.release()
        self.breaker.record(result.status != "infra_error", result.stderr.strip()[-300:])
        result.queue_s = waited
        return self._finish(start, result)

    async def _breaker_allows(self) -> bool:
        state = self.breaker.state
        if state == "closed":
            return True
        if state == "open":
            return False
        async with self._probe_lock:  # half-open: one probe at a time decides for everyone
            if self.breaker.state != "half-open":
                return self.breaker.state == "closed"
            self.counts["probes"] += 1
            try:
                await self.backend.start()
                probe = await self.backend.run(PROBE_CODE, session=None, timeout_s=self.timeout_s, memory_mb=self.memory_mb)
                ok, why = probe.status == "ok", probe.stderr.strip()[-300:]
            except Exception as exc:  # a backend that cannot even start is still down
                ok, why = False, f"{type(exc).__name__}: {exc}"
            self.breaker.record(ok, why)
            if ok:
                log.warning("%s: the sandbox backend answers again; circuit breaker closed", self.name)
            return ok

    def _finish(self, start: float, result: ExecResult) -> ExecResult:
        self.status_counts[result.status] += 1
        self.latencies.append(time.monotonic() - start)
        return result

    async def close_session(self, session: str) -> None:
        self.sessions.discard(session)
        await self.backend.close_session(session)

    async def aclose(self) -> None:
        await self.backend.aclose()

    def stats(self) -> dict:
        lat = list(self.latencies)
        out = {
            "queue_depth": self.waiting,
            "running": self.running,
            "latency_p50_s": percentile(lat, 0.5),
            "latency_p99_s": percentile(lat, 0.99),
            "breaker": self.breaker.state,
            "breaker_opened": self.breaker.opened,
            "status": dict(self.status_counts),
            **{k: self.counts[k] for k in ("rejected", "retried", "fast_failed", "probes", "sessions_lost")},
        }
        backend_stats = getattr(self.backend, "stats", None)
        if backend_stats is not None:
            out["backend"] = backend_stats()
        return out


class LognormalDelay:
    """Seconds drawn from a lognormal with the given median and 95th percentile (seeded): the long
    tail of a remote sandbox's latency, for benchmarks and chaos runs on the local backend."""

    def __init__(self, median_s: float, p95_s: float, seed: int = 0):
        self.mu = math.log(median_s)
        self.sigma = math.log(p95_s / median_s) / 1.6448536269514722  # the standard normal's 95th percentile
        self.rng = random.Random(seed)

    def sample(self) -> float:
        return self.rng.lognormvariate(self.mu, self.sigma)


class Delayed:
    """A backend whose every cell first waits a LognormalDelay, inside the pool's slot, as a remote
    sandbox's round trip holds its connection: so the latency is service time, and a pool with few
    slots and a long delay is a slow stage (`raytool bench load --slow-stage sandbox`)."""

    def __init__(self, backend, delay: LognormalDelay):
        self.backend, self.delay = backend, delay

    async def run(self, code: str, **kwargs) -> ExecResult:
        waited = self.delay.sample()
        await asyncio.sleep(waited)
        result = await self.backend.run(code, **kwargs)
        result.duration_s += waited
        return result

    def __getattr__(self, name: str):  # start, close_session, aclose: the backend's own
        return getattr(self.backend, name)
