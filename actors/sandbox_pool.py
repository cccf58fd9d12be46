"""SandboxPool: a code-execution backend behind a concurrency limit, with retries on infra errors."""

from __future__ import annotations

import asyncio
from collections import Counter

import ray

from raytool.sandbox import make_backend
from raytool.types import ExecResult


@ray.remote
class SandboxPool:
    def __init__(self, backend: str, backend_options: dict, max_concurrency: int, timeout_s: float, memory_mb: int, retries: int = 1):
        self.backend = make_backend(backend, **backend_options)
        self.slots = asyncio.Semaphore(max_concurrency)
        self.timeout_s, self.memory_mb, self.retries = timeout_s, memory_mb, retries
        self.status_counts: Counter = Counter()

    async def execute(self, code: str, session: str | None = None) -> ExecResult:
        async with self.slots:
            for _ in range(self.retries + 1):
                result = await self.backend.run(code, session=session, timeout_s=self.timeout_s, memory_mb=self.memory_mb)
                if result.status != "infra_error":
                    break
        self.status_counts[result.status] += 1
        return result

    async def close_session(self, session: str) -> None:
        await self.backend.close_session(session)

    def stats(self) -> dict:
        return dict(self.status_counts)
