"""Code execution backends behind one protocol (`SandboxBackend`)."""

from __future__ import annotations

from typing import Protocol

from raytool.types import ExecResult


class SandboxBackend(Protocol):
    async def run(
        self, code: str, *, session: str | None = None, timeout_s: float, memory_mb: int
    ) -> ExecResult: ...

    async def close_session(self, session: str) -> None: ...


def make_backend(name: str, **options) -> SandboxBackend:
    if name == "local":
        from raytool.sandbox.local import LocalBackend

        return LocalBackend(**options)
    raise ValueError(f"unknown sandbox backend '{name}'; expected one of ['local']")
