"""The local sandbox: each code cell runs in its own Python process, walled in.

Isolation per cell: a fresh process in its own session (the whole process group is killed on
timeout), a fresh empty working directory, an empty environment, `-I` (no user site, no cwd on
sys.path), rlimits on address space, CPU seconds, file size and core dumps, and, where the kernel
allows it (root or user namespaces), new network and PID namespaces (`unshare --net --pid`): no
network but a loopback that is down, and every process the cell starts dies with it, even one that
left the cell's session. Not yet walled off: the file system (read/write as the worker's user) and
other processes' signals (the PID namespace hides them; without it they are reachable).

Cells are stateless in this version: a session name is accepted and every cell starts clean.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from raytool.types import ExecResult

log = logging.getLogger(__name__)


_NAMESPACES = ["unshare", "--net", "--pid", "--fork", "--kill-child", "--"]


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run([*_NAMESPACES, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class LocalBackend:
    def __init__(self, *, max_output_bytes: int = 8192, isolate_network: bool = True, python: str | None = None):
        self.max_output_bytes = max_output_bytes
        self.python = python or sys.executable
        self.ns_prefix: list[str] = []
        if isolate_network:
            if _namespaces_work():
                self.ns_prefix = list(_NAMESPACES)
            else:
                log.warning("local sandbox: `unshare --net --pid` is not permitted here; cells keep network access")

    def _limits(self, timeout_s: float, memory_mb: int):
        cpu_s = math.ceil(timeout_s) + 1

        def apply() -> None:  # runs in the child between fork and exec
            resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        return apply

    def _cut(self, data: bytes) -> tuple[str, bool]:
        if len(data) <= self.max_output_bytes:
            return data.decode("utf-8", "replace"), False
        return data[: self.max_output_bytes].decode("utf-8", "replace"), True

    async def run(self, code: str, *, session: str | None = None, timeout_s: float = 5.0, memory_mb: int = 1024) -> ExecResult:
        workdir = tempfile.mkdtemp(prefix="raytool-cell-")
        start = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.ns_prefix, self.python, "-I", "-",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=workdir,
                env={"PATH": "/usr/bin:/bin", "HOME": workdir, "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8"},
                start_new_session=True,
                preexec_fn=self._limits(timeout_s, memory_mb),
            )
        except OSError as exc:
            shutil.rmtree(workdir, ignore_errors=True)
            return ExecResult(status="infra_error", stderr=f"could not start the cell's process: {exc}")
        timed_out = False
        stdout = stderr = b""
        try:
            stdout, stderr = await asyncio.wait_for(proc.communicate(code.encode()), timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            # Whatever happened (done, timed out, cancelled), nothing the cell started survives it.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if timed_out:
                try:  # what it printed before the kill; a grandchild holding the pipes can't stall us
                    stdout, stderr = await asyncio.wait_for(proc.communicate(), 2.0)
                except asyncio.TimeoutError:
                    proc.kill()
            shutil.rmtree(workdir, ignore_errors=True)
        duration = time.monotonic() - start
        out, cut_out = self._cut(stdout)
        err, cut_err = self._cut(stderr)
        code_ = proc.returncode
        if timed_out or code_ == -signal.SIGXCPU:
            status = "timeout"
        elif code_ == 0:
            status = "ok"
        elif "MemoryError" in err:
            status = "oom"
        elif code_ is not None and code_ < 0:
            status = "killed"
        else:
            status = "error"
        return ExecResult(status=status, stdout=out, stderr=err, exit_code=code_, duration_s=duration, truncated=cut_out or cut_err)

    async def close_session(self, session: str) -> None:
        # Cells keep no state between them in this backend, so a session holds nothing to release.
        return None
