"""SandboxPool: a sandbox backend behind limits, retries and a circuit breaker (raytool.sandbox.pool)."""

from __future__ import annotations

import time

import ray

from actors.metrics import SandboxMetrics
from raytool.errors import RaytoolError
from raytool.sandbox import make_backend
from raytool.sandbox.pool import Delayed, LognormalDelay, PooledBackend
from raytool.types import ExecResult


@ray.remote
class SandboxPool:
    def __init__(self, name: str, backend: str, backend_options: dict, added_latency: tuple[float, float] = (0.0, 0.0), seed: int = 0, **limits):
        """`added_latency`: (median, p95) seconds of a lognormal delay added to every cell, while it
        holds its slot (0: none)."""
        self.name = name
        backend_ = make_backend(backend, **backend_options)
        if added_latency[0] > 0:
            backend_ = Delayed(backend_, LognormalDelay(*added_latency, seed=seed))
        self.pool = PooledBackend(backend_, name=name, **limits)
        self.backend_name = backend
        self.metrics = SandboxMetrics(name, self.pool)

    async def ready(self) -> dict:
        """Start the backend (the local one forks its warm sessions); a failure is one line."""
        try:
            await self.pool.start()
        except Exception as exc:
            raise RaytoolError(f"raytool: sandbox pool {self.name} ({self.backend_name}) failed to start: {exc}") from None
        return self.pool.stats()

    async def execute(self, code: str, session: str | None = None, continuing: bool = False) -> ExecResult:
        start = time.perf_counter()
        result = await self.pool.execute(code, session, continuing)
        self.metrics.cell_done(result.status, time.perf_counter() - start)
        return result

    async def close_session(self, session: str) -> None:
        await self.pool.close_session(session)

    def stats(self) -> dict:
        return self.pool.stats()

    async def shutdown(self) -> None:
        await self.pool.aclose()
