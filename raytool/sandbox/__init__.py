"""Code execution backends behind one protocol (`SandboxBackend`): local, sandbox_fusion, e2b."""

from __future__ import annotations

from typing import Protocol

from raytool.types import ExecResult

BACKENDS = ["local", "sandbox_fusion", "e2b"]


class SandboxBackend(Protocol):
    async def start(self) -> None: ...

    async def run(
        self, code: str, *, session: str | None = None, timeout_s: float, memory_mb: int
    ) -> ExecResult: ...

    async def close_session(self, session: str) -> None: ...

    async def aclose(self) -> None: ...


def make_backend(name: str, **options) -> SandboxBackend:
    if name == "local":
        from raytool.sandbox.local import LocalBackend

        return LocalBackend(**options)
    if name == "sandbox_fusion":
        from raytool.sandbox.sandbox_fusion import SandboxFusionBackend

        return SandboxFusionBackend(**options)
    if name == "e2b":
        from raytool.sandbox.e2b import E2BBackend

        return E2BBackend(**options)
    raise ValueError(f"unknown sandbox backend '{name}'; expected one of {BACKENDS}")
