"""The E2B backend: cells run in E2B code-interpreter sandboxes (also Tencent AGS and other E2B-compatible services).

Each session gets its own sandbox, a Jupyter kernel that keeps variables, imports and files between
the session's cells; it is created on the session's first cell and killed by `close_session`. A
cell without a session runs in a throwaway sandbox killed right after it, so it sees no state of any
other cell (the same promise the local backend makes); a trajectory that runs several cells should
pass a session, which saves one sandbox start per cell.

What the model sees is what a notebook shows: stdout is what the cell printed followed by the value
of its trailing expression; stderr is what it wrote to stderr followed by the traceback of its error.

The service is reached with the `e2b-code-interpreter` SDK (`pip install 'raytool[e2b]'`), imported
only when this backend is built. `domain` picks the service (None: E2B's own, or `E2B_DOMAIN`; Tencent
AGS: e.g. `ap-shanghai.tencentags.com`), `template` the sandbox image. The API key is read from the
environment variable named by `api_key_env` and is kept out of every repr, log record, result and
error message.

Memory: `memory_mb` cannot be set per cell on E2B; the sandbox's RAM and CPUs are fixed by its template
(E2B: the template's build settings; AGS: the sandbox tool configured in its console). A cell that
runs out of it reports `oom` (a MemoryError) or `killed` (the kernel died and restarted).
`sandbox_timeout_s` is a sandbox's lifetime from its creation: a session that outlives it finds its
sandbox gone, which reports `killed` once and continues in a new sandbox.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from raytool.errors import RaytoolError, one_line
from raytool.sandbox.output import cap_output
from raytool.types import ExecResult, ExecStatus

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'raytool[e2b]'"

# Error names the code-interpreter server reports that are not the cell's own exception.
_KERNEL_RESTARTED = "ContextRestarting"  # the kernel died (OOM killer, segfault, os._exit) and restarted
_SERVER_FAILURES = ("UnexpectedEndOfExecution", "WebSocketError")  # the server lost its kernel connection


class _Secret:
    """A string that never shows itself: not in repr/str, f-strings, log records or traceback locals."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "<secret>"

    __str__ = __repr__


def _exception_names(exc: BaseException) -> set[str]:
    # The SDK's exception classes are matched by name along the MRO, not imported: the SDK is an
    # optional extra, a test's fake SDK defines its own classes, and SDK versions move classes
    # between modules (e2b.exceptions vs e2b) while keeping their names.
    return {cls.__name__ for cls in type(exc).__mro__}


def _with_newline(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"


class E2BBackend:
    """A `SandboxBackend` on E2B's code-interpreter sandboxes; see the module docstring.

    `request_timeout_s` bounds each API call (create, kill) and the connect of each cell's request;
    the cell itself runs up to its `timeout_s`. `sandbox_cls` replaces the SDK's `AsyncSandbox`
    (tests pass a fake with the same `create` / `run_code` / `kill` / `is_running`).
    """

    def __init__(
        self,
        *,
        domain: str | None = None,
        api_key_env: str = "E2B_API_KEY",
        template: str = "code-interpreter-v1",
        sandbox_timeout_s: int = 300,
        request_timeout_s: float = 30.0,
        max_output_bytes: int = 8192,
        sandbox_cls: Any = None,
    ):
        key = os.environ.get(api_key_env, "")
        if not key.strip():
            raise RaytoolError(
                f"sandbox backend e2b: the environment variable {api_key_env} is not set (or empty); "
                f"export {api_key_env}=<your E2B or Tencent AGS API key> where the sandbox pool runs "
                "(for a Ray job: runtime_env env_vars), or name another variable with sandbox.e2b_api_key_env"
            )
        if sandbox_timeout_s <= 0 or request_timeout_s <= 0:
            raise ValueError(f"e2b sandbox_timeout_s and request_timeout_s must be positive, got {sandbox_timeout_s} and {request_timeout_s}")
        self._api_key = _Secret(key.strip())
        self.api_key_env = api_key_env
        self.domain = domain
        self.template = template
        self.sandbox_timeout_s = sandbox_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_output_bytes = max_output_bytes
        self._sandbox_cls = sandbox_cls if sandbox_cls is not None else _load_sdk()
        self._sandboxes: dict[str, Any] = {}  # session -> its live sandbox
        self._locks: dict[str, asyncio.Lock] = {}  # session -> lock held while its sandbox is made or killed

    def __repr__(self) -> str:
        return (
            f"E2BBackend(domain={self.domain!r}, template={self.template!r}, api_key_env={self.api_key_env!r}, "
            f"live_sessions={len(self._sandboxes)})"
        )

    async def start(self) -> None:
        """Nothing to start: the key was checked at construction and sandboxes start with their sessions."""
        log.info("e2b backend: domain %s, template %s, API key from $%s", self.domain or "(SDK default)", self.template, self.api_key_env)

    async def run(self, code: str, *, session: str | None = None, timeout_s: float = 5.0, memory_mb: int = 1024) -> ExecResult:
        # memory_mb is accepted for the protocol only: the template decides a sandbox's memory.
        start = time.monotonic()
        if session is None:
            status, stdout, stderr = await self._run_throwaway(code, timeout_s)
        else:
            status, stdout, stderr = await self._run_in_session(code, session, timeout_s)
        stdout, cut_out = cap_output(self._scrub(stdout), self.max_output_bytes)
        stderr, cut_err = cap_output(self._scrub(stderr), self.max_output_bytes)
        # A notebook has no exit code; 0 / 1 are what `python file.py` would have returned.
        exit_code = {"ok": 0, "error": 1, "oom": 1}.get(status)
        return ExecResult(
            status=status, stdout=stdout, stderr=stderr, exit_code=exit_code,
            duration_s=time.monotonic() - start, truncated=cut_out or cut_err,
        )

    async def close_session(self, session: str) -> None:
        async with self._lock(session):
            sandbox = self._sandboxes.pop(session, None)
            self._locks.pop(session, None)
            if sandbox is not None:
                await self._kill(sandbox, f"session {session!r}")

    async def aclose(self) -> None:
        """Kill every live sandbox (each would otherwise bill until its `sandbox_timeout_s`)."""
        sandboxes = list(self._sandboxes.items())
        self._sandboxes.clear()
        self._locks.clear()
        await asyncio.gather(*(self._kill(sandbox, f"session {session!r}") for session, sandbox in sandboxes))

    # -- sandboxes -------------------------------------------------------------------------------

    def _lock(self, session: str) -> asyncio.Lock:
        return self._locks.setdefault(session, asyncio.Lock())

    async def _create(self) -> Any:
        return await self._sandbox_cls.create(
            template=self.template,
            timeout=self.sandbox_timeout_s,
            api_key=self._api_key.reveal(),
            domain=self.domain,
            request_timeout=self.request_timeout_s,
        )

    async def _kill(self, sandbox: Any, owner: str) -> None:
        try:
            await sandbox.kill(request_timeout=self.request_timeout_s)
        except Exception as exc:  # a failed kill must not fail the trajectory
            # The service still ends it when its lifetime runs out; say so, since it bills until then.
            log.warning(
                "e2b: could not kill sandbox %s of %s (it ends by itself after %d s): %s",
                getattr(sandbox, "sandbox_id", "?"), owner, self.sandbox_timeout_s, self._scrub(one_line(exc)),
            )

    def _start_failure(self, exc: Exception) -> tuple[ExecStatus, str, str]:
        names = _exception_names(exc)
        hint = ""
        if "AuthenticationException" in names:
            hint = f" (check the API key in ${self.api_key_env} and that it belongs to this domain)"
        elif "RateLimitException" in names:
            hint = " (the service's rate or concurrency limit: lower sandbox.max_concurrency)"
        where = f"template {self.template!r}, domain {self.domain or '(SDK default)'}"
        message = self._scrub(f"could not start an E2B sandbox ({where}): {one_line(exc)}{hint}")
        log.warning("e2b: %s", message)
        return "infra_error", "", message + "\n"

    async def _run_throwaway(self, code: str, timeout_s: float) -> tuple[ExecStatus, str, str]:
        try:
            sandbox = await self._create()
        except Exception as exc:  # every failure to start is the service's, reported as infra_error
            return self._start_failure(exc)
        try:
            status, stdout, stderr, _ = await self._execute(sandbox, code, timeout_s)
            return status, stdout, stderr
        finally:
            await self._kill(sandbox, "a sessionless cell")

    async def _run_in_session(self, code: str, session: str, timeout_s: float) -> tuple[ExecStatus, str, str]:
        # Under the session's lock, so concurrent first cells of one session start one sandbox.
        async with self._lock(session):
            sandbox = self._sandboxes.get(session)
            if sandbox is None:
                try:
                    sandbox = await self._create()
                except Exception as exc:  # as in _run_throwaway; the next cell tries again
                    return self._start_failure(exc)
                self._sandboxes[session] = sandbox
                log.info("e2b: sandbox %s started for session %r", getattr(sandbox, "sandbox_id", "?"), session)
        status, stdout, stderr, lost = await self._execute(sandbox, code, timeout_s)
        if lost:
            if self._sandboxes.get(session) is sandbox:
                del self._sandboxes[session]
            stderr += "The sandbox of this session is gone; variables and files from its earlier cells are lost. The next cell starts in a new sandbox.\n"
        return status, stdout, stderr

    # -- one cell --------------------------------------------------------------------------------

    async def _execute(self, sandbox: Any, code: str, timeout_s: float) -> tuple[ExecStatus, str, str, bool]:
        """Run one cell: (status, stdout, stderr, whether the sandbox is gone)."""
        # Collected as they stream, so a cell cut off by its timeout still shows what it printed.
        printed: list[str] = []
        written: list[str] = []
        try:
            execution = await asyncio.wait_for(
                sandbox.run_code(
                    code,
                    on_stdout=lambda message: printed.append(str(message)),
                    on_stderr=lambda message: written.append(str(message)),
                    timeout=timeout_s,
                    request_timeout=self.request_timeout_s,
                ),
                # The SDK enforces `timeout` itself; this outer bound only catches a hung connection.
                timeout_s + self.request_timeout_s,
            )
        except asyncio.TimeoutError:
            return "timeout", "".join(printed), "".join(written), False
        except Exception as exc:  # classified below; nothing is dropped silently
            return await self._cell_failure(sandbox, exc, "".join(printed), "".join(written))
        return self._to_result(execution) + (False,)

    def _to_result(self, execution: Any) -> tuple[ExecStatus, str, str]:
        stdout = "".join(execution.logs.stdout)
        main = next((r for r in execution.results if getattr(r, "is_main_result", False)), None)
        if main is not None and main.text is not None:
            stdout = _with_newline(stdout) + _with_newline(main.text)  # like a notebook's Out[n]
        stderr = "".join(execution.logs.stderr)
        error = execution.error
        if error is None:
            return "ok", stdout, stderr
        name, value = error.name or "", error.value or ""
        headline = f"{name}: {value}" if value else name
        traceback = error.traceback or ""
        if headline not in traceback:  # the server sends an empty traceback for its own errors
            traceback = _with_newline(traceback) + headline
        stderr = _with_newline(stderr) + _with_newline(traceback)
        if name == "MemoryError":
            return "oom", stdout, stderr
        if name == _KERNEL_RESTARTED:
            return "killed", stdout, stderr + "The Python kernel died (out of memory or a crash) and restarted; variables from earlier cells are lost.\n"
        if name in _SERVER_FAILURES:
            return "infra_error", stdout, stderr
        return "error", stdout, stderr

    async def _cell_failure(self, sandbox: Any, exc: Exception, stdout: str, stderr: str) -> tuple[ExecStatus, str, str, bool]:
        names = _exception_names(exc)
        what = self._scrub(one_line(exc))
        if "TimeoutException" in names and str(exc).startswith("Execution timed out"):
            # The SDK's own execution deadline; the server interrupts the kernel and keeps its state.
            return "timeout", stdout, stderr, False
        if "NotFoundException" in names or "SandboxNotRunningException" in names:
            gone = True
        else:
            # A 502, a dropped connection, a request timeout: only the sandbox can say whether it
            # is gone (then its state is lost) or the network failed (then it is still there).
            gone = await self._is_gone(sandbox)
        sandbox_id = getattr(sandbox, "sandbox_id", "?")
        if gone:
            log.warning("e2b: sandbox %s is gone (killed or past its %d s lifetime): %s", sandbox_id, self.sandbox_timeout_s, what)
            return "killed", stdout, _with_newline(stderr) + f"sandbox lost: {what}\n", True
        log.warning("e2b: cell in sandbox %s failed: %s", sandbox_id, what)
        return "infra_error", stdout, _with_newline(stderr) + f"E2B request failed: {what}\n", False

    async def _is_gone(self, sandbox: Any) -> bool:
        try:
            return not await sandbox.is_running(request_timeout=self.request_timeout_s)
        except Exception as exc:  # unknown state: keep the sandbox, report infra_error
            log.debug("e2b: could not ask sandbox %s whether it runs: %s", getattr(sandbox, "sandbox_id", "?"), self._scrub(one_line(exc)))
            return False

    def _scrub(self, text: str) -> str:
        # Defence in depth: SDK and service messages are not ours to audit.
        return text.replace(self._api_key.reveal(), "<redacted>")


def _load_sdk() -> Any:
    try:
        from e2b_code_interpreter import AsyncSandbox
    except ImportError as exc:
        raise ImportError(f"the e2b sandbox backend needs the E2B SDK (e2b-code-interpreter): {INSTALL_HINT}") from exc
    return AsyncSandbox
