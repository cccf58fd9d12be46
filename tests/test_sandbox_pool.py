"""PooledBackend (the SandboxPool actor's logic): limits, back-pressure, retries, circuit breaker."""

import asyncio

from raytool.sandbox.pool import PooledBackend, percentile
from raytool.types import ExecResult


class FakeBackend:
    """Answers from a script of statuses; records every call; `hold` keeps cells running."""

    def __init__(self, statuses=(), hold: asyncio.Event | None = None):
        self.statuses = list(statuses)
        self.calls: list[tuple[str, str | None]] = []
        self.hold = hold
        self.running = self.max_running = 0
        self.starts = 0

    async def start(self):
        self.starts += 1

    async def run(self, code, *, session=None, timeout_s, memory_mb):
        self.calls.append((code, session))
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            if self.hold is not None:
                await self.hold.wait()
            status = self.statuses.pop(0) if self.statuses else "ok"
            return ExecResult(status=status, stderr="backend down" if status == "infra_error" else "")
        finally:
            self.running -= 1

    async def close_session(self, session):
        self.calls.append(("close", session))

    async def aclose(self):
        pass


def test_retries_only_infrastructure_failures():
    async def go():
        backend = FakeBackend(["infra_error", "ok", "error"])
        pool = PooledBackend(backend, retries=2, retry_backoff_s=0)
        assert (await pool.execute("a", "s")).status == "ok"
        assert (await pool.execute("b", "s")).status == "error"  # failing code is not re-run
        assert [c for c, _ in backend.calls] == ["a", "a", "b"]
        assert pool.stats()["retried"] == 1 and pool.stats()["status"] == {"ok": 1, "error": 1}

    asyncio.run(go())


def test_concurrency_limit_and_bounded_queue():
    async def go():
        hold = asyncio.Event()
        backend = FakeBackend(hold=hold)
        pool = PooledBackend(backend, max_concurrency=2, max_queue=3)
        tasks = [asyncio.ensure_future(pool.execute(f"c{i}", None)) for i in range(5)]
        await asyncio.sleep(0.01)
        assert pool.stats()["running"] == 2 and pool.stats()["queue_depth"] == 3
        refused = await pool.execute("one too many", None)  # back-pressure: refused at once, not queued
        assert refused.status == "infra_error" and "pool is full" in refused.stderr
        hold.set()
        results = await asyncio.gather(*tasks)
        assert [r.status for r in results] == ["ok"] * 5 and backend.max_running == 2
        assert pool.stats()["rejected"] == 1 and pool.stats()["queue_depth"] == 0

    asyncio.run(go())


def test_circuit_breaker_fails_fast_then_probes_the_backend_back():
    async def go():
        backend = FakeBackend(["infra_error"] * 3)
        pool = PooledBackend(backend, retries=0, breaker_failures=3, breaker_reset_s=0.2)
        for _ in range(3):
            assert (await pool.execute("x", None)).status == "infra_error"
        assert pool.stats()["breaker"] == "open"
        fast = await pool.execute("x", None)
        assert fast.status == "infra_error" and "failing fast" in fast.stderr and "backend down" in fast.stderr
        assert len(backend.calls) == 3  # the backend was not called while open
        await asyncio.sleep(0.25)
        assert (await pool.execute("y", None)).status == "ok"  # half-open: a probe succeeded, the cell ran
        assert backend.calls[-2:] == [("print('ok')", None), ("y", None)]
        stats = pool.stats()
        assert stats["breaker"] == "closed" and stats["probes"] == 1 and stats["fast_failed"] == 1 and stats["breaker_opened"] == 1

    asyncio.run(go())


def test_a_failed_probe_keeps_the_breaker_open():
    async def go():
        backend = FakeBackend(["infra_error", "infra_error"])
        pool = PooledBackend(backend, retries=0, breaker_failures=1, breaker_reset_s=0.05)
        await pool.execute("x", None)
        await asyncio.sleep(0.06)
        assert (await pool.execute("y", None)).status == "infra_error"  # the probe failed
        assert pool.stats()["breaker"] == "open" and ("y", None) not in backend.calls

    asyncio.run(go())


def test_latency_percentiles():
    assert percentile([], 0.5) == 0.0
    assert percentile([3, 1, 2], 0.5) == 2
    assert percentile(range(100), 0.99) == 98


def test_a_session_continued_on_a_restarted_pool_fails_as_lost_not_on_a_fresh_interpreter():
    """The pool process that held a trajectory's interpreter died and Ray started a new one: the
    trajectory's next cell is refused as an infrastructure failure (so its group is rolled out
    again), not run in an empty interpreter as if its variables had never existed."""
    from raytool.sandbox.local import LocalBackend

    async def go():
        first = PooledBackend(LocalBackend(warm_sessions=0), name="sandbox-pool-0")
        try:
            assert (await first.execute("x = 6 * 7", "t0@a.0")).status == "ok"
            assert (await first.execute("print(x)", "t0@a.0", continuing=True)).stdout == "42\n"
        finally:
            await first.aclose()
        restarted = PooledBackend(LocalBackend(warm_sessions=0), name="sandbox-pool-0")
        try:
            lost = await restarted.execute("print(x)", "t0@a.0", continuing=True)
            assert lost.status == "infra_error" and "session t0@a.0 is lost" in lost.stderr
            assert restarted.stats()["sessions_lost"] == 1
            fresh = await restarted.execute("print(1)", "t0@a.1")  # the group's next attempt: a new session
            assert fresh.status == "ok" and fresh.stdout == "1\n"
            await restarted.close_session("t0@a.1")
            assert "t0@a.1" not in restarted.sessions
        finally:
            await restarted.aclose()

    asyncio.run(go())
