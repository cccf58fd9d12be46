"""The E2B backend against a fake `AsyncSandbox` with the SDK's signatures, types and exceptions.

The fake runs cells for real (one namespace per sandbox, the trailing expression's value reported
as the main result, like the code-interpreter's Jupyter kernel) and raises what the SDK raises for
a killed sandbox, a cell past its timeout and a rejected key. It uses the installed SDK's Execution,
Logs, Result, ExecutionError, OutputMessage and exception classes; without the SDK, stand-ins of the
same shape, so these tests run either way.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import io
import itertools
import logging
import traceback as tb

import pytest

from raytool.errors import RaytoolError
from raytool.sandbox.e2b import E2BBackend

try:
    from e2b import AuthenticationException, NotFoundException, RateLimitException, SandboxException, TimeoutException
    from e2b_code_interpreter.exceptions import format_execution_timeout_error, format_sandbox_killed_error
    from e2b_code_interpreter.models import Execution, ExecutionError, Logs, OutputMessage, Result

    REAL_SDK = True
except ImportError:
    REAL_SDK = False

    class SandboxException(Exception):
        pass

    class TimeoutException(SandboxException):
        pass

    class NotFoundException(SandboxException):
        pass

    class RateLimitException(SandboxException):
        pass

    class AuthenticationException(Exception):  # not a SandboxException, as in the SDK
        pass

    def format_execution_timeout_error():
        return TimeoutException("Execution timed out — the 'timeout' option can be used to increase this timeout")

    def format_sandbox_killed_error():
        return TimeoutException("The sandbox was killed while the request was in progress.")

    class Logs:
        def __init__(self, stdout=None, stderr=None):
            self.stdout, self.stderr = stdout or [], stderr or []

    class Result:
        def __init__(self, text=None, is_main_result=False, **formats):
            self.text, self.is_main_result = text, is_main_result

    class ExecutionError:
        def __init__(self, name, value, traceback):
            self.name, self.value, self.traceback = name, value, traceback

    class Execution:
        def __init__(self, results=None, logs=None, error=None, execution_count=None):
            self.results, self.logs, self.error, self.execution_count = results or [], logs or Logs(), error, execution_count

    class OutputMessage:
        def __init__(self, line, timestamp, error=False):
            self.line, self.timestamp, self.error = line, timestamp, error

        def __str__(self):
            return self.line


KEY = "e2b_0123456789abcdef0123456789abcdef01234567"


class FakeSandbox:
    """`e2b_code_interpreter.AsyncSandbox` as far as the backend uses it."""

    created: list[FakeSandbox] = []
    create_calls: list[dict] = []
    create_error: Exception | None = None
    _ids = itertools.count()

    def __init__(self, api_key: str):
        self.sandbox_id = f"fake-{next(self._ids)}"
        self.namespace: dict = {}
        self.alive = True
        self.kill_calls = 0
        self.execution_count = 0
        self.run_error: Exception | None = None  # raised by the next run_code, as a failing request would

    @classmethod
    async def create(cls, template=None, timeout=None, metadata=None, envs=None, secure=None, allow_internet_access=None,
                     mcp=None, network=None, iam=None, lifecycle=None, volume_mounts=None, logger=None,
                     idempotency_key=None, **opts):
        cls.create_calls.append(dict(template=template, timeout=timeout, metadata=metadata, envs=envs, **opts))
        await asyncio.sleep(0.01)  # a real create is a round trip: concurrent callers interleave here
        if cls.create_error is not None:
            raise cls.create_error
        sandbox = cls(opts.get("api_key"))
        cls.created.append(sandbox)
        return sandbox

    async def kill(self, **opts) -> bool:
        self.kill_calls += 1
        was_alive, self.alive = self.alive, False
        return was_alive

    async def is_running(self, request_timeout=None) -> bool:
        return self.alive

    async def run_code(self, code, language=None, context=None, on_stdout=None, on_stderr=None, on_result=None,
                       on_error=None, envs=None, timeout=None, request_timeout=None):
        if self.run_error is not None:
            error, self.run_error = self.run_error, None
            raise error
        if not self.alive:
            # What run_code raises when the proxy answers 502 for a sandbox that no longer exists.
            raise TimeoutException("The sandbox was not found: This error is likely due to sandbox timeout.")
        if code.startswith("#sleep "):  # a cell that runs for N seconds, printing first
            if on_stdout:
                on_stdout(OutputMessage("started\n", 0, False))
            seconds = float(code.split()[1])
            await asyncio.sleep(min(seconds, timeout))
            if seconds > timeout:
                raise format_execution_timeout_error()
        return self._exec(code)

    def _exec(self, code: str):
        """Like the Jupyter kernel: run the cell, the value of a trailing expression is Out[n]."""
        self.execution_count += 1
        out, err = io.StringIO(), io.StringIO()
        results, error = [], None
        try:
            tree = ast.parse(code)
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                exec(compile(tree, "<cell>", "exec"), self.namespace)
                if last is not None:
                    value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), self.namespace)
                    if value is not None:
                        results.append(Result(text=repr(value), is_main_result=True))
        except BaseException as exc:  # the kernel reports every exception of the cell
            error = ExecutionError(type(exc).__name__, str(exc), "".join(tb.format_exception(exc)))
        logs = Logs(stdout=[out.getvalue()] if out.getvalue() else [], stderr=[err.getvalue()] if err.getvalue() else [])
        return Execution(results=results, logs=logs, error=error, execution_count=self.execution_count)


@pytest.fixture
def sandboxes(monkeypatch):
    monkeypatch.setenv("E2B_API_KEY", KEY)
    monkeypatch.setattr(FakeSandbox, "created", [])
    monkeypatch.setattr(FakeSandbox, "create_calls", [])
    monkeypatch.setattr(FakeSandbox, "create_error", None)
    return FakeSandbox


def backend(**kw) -> E2BBackend:
    return E2BBackend(sandbox_cls=FakeSandbox, **kw)


def run(be: E2BBackend, code: str, session: str | None = "s1", timeout_s: float = 5.0):
    return asyncio.run(be.run(code, session=session, timeout_s=timeout_s, memory_mb=512))


def test_state_persists_within_a_session_and_not_across(sandboxes):
    be = backend()

    async def go():
        await be.run("x = 41", session="a", timeout_s=5, memory_mb=512)
        same = await be.run("print(x + 1)", session="a", timeout_s=5, memory_mb=512)
        other = await be.run("print(x)", session="b", timeout_s=5, memory_mb=512)
        alone = await be.run("print(x)", session=None, timeout_s=5, memory_mb=512)
        return same, other, alone

    same, other, alone = asyncio.run(go())
    assert same.status == "ok" and same.stdout == "42\n" and same.exit_code == 0
    assert other.status == "error" and "NameError: name 'x' is not defined" in other.stderr
    assert alone.status == "error" and "NameError" in alone.stderr
    # two sessions, one throwaway sandbox for the sessionless cell, which is killed right after it
    assert len(sandboxes.created) == 3
    assert [s.alive for s in sandboxes.created] == [True, True, False]


def test_trailing_expression_value_follows_printed_output(sandboxes):
    r = run(backend(), "print('sum:')\nsum(range(10))")
    assert r.status == "ok" and r.stdout == "sum:\n45\n"
    assert run(backend(), "'a' * 3").stdout == "'aaa'\n"
    assert run(backend(), "y = 3").stdout == ""  # an assignment has no value to show


def test_error_shows_stderr_and_traceback(sandboxes):
    r = run(backend(), "import sys\nprint('before')\nsys.stderr.write('warned\\n')\n1 / 0")
    assert r.status == "error" and r.exit_code == 1
    assert r.stdout == "before\n"
    assert r.stderr.startswith("warned\n")
    assert "Traceback" in r.stderr and r.stderr.rstrip().endswith("ZeroDivisionError: division by zero")


def test_memory_error_is_oom(sandboxes):
    r = run(backend(), "raise MemoryError('cannot allocate')")
    assert r.status == "oom" and "MemoryError: cannot allocate" in r.stderr


def test_kernel_restart_reports_lost_state(sandboxes):
    be = backend()
    run(be, "x = 1")
    sandbox = sandboxes.created[0]
    restarted = Execution(error=ExecutionError("ContextRestarting", "Context was restarted", ""))

    async def dies(*args, **kwargs):
        return restarted

    sandbox.run_code = dies
    r = run(be, "big = [0] * 10**12")
    assert r.status == "killed" and "ContextRestarting: Context was restarted" in r.stderr and "lost" in r.stderr


def test_timeout_keeps_what_was_printed_and_the_session(sandboxes):
    be = backend()

    async def go():
        await be.run("x = 7", session="s", timeout_s=5, memory_mb=512)
        slow = await be.run("#sleep 10", session="s", timeout_s=0.05, memory_mb=512)
        after = await be.run("x", session="s", timeout_s=5, memory_mb=512)
        return slow, after

    slow, after = asyncio.run(go())
    assert slow.status == "timeout" and slow.stdout == "started\n" and slow.exit_code is None
    assert slow.duration_s < 2
    assert after.status == "ok" and after.stdout == "7\n"  # the interrupted kernel kept its state
    assert len(sandboxes.created) == 1


def test_hung_request_is_cut_off_as_timeout(sandboxes):
    be = backend(request_timeout_s=0.05)
    run(be, "pass")

    async def hangs(*args, **kwargs):
        await asyncio.sleep(60)

    sandboxes.created[0].run_code = hangs
    r = run(be, "pass", timeout_s=0.05)
    assert r.status == "timeout" and r.duration_s < 2


def test_killed_sandbox_reports_lost_state_then_starts_fresh(sandboxes):
    be = backend()

    async def go():
        await be.run("x = 1", session="s", timeout_s=5, memory_mb=512)
        await sandboxes.created[0].kill()  # what the service does when the sandbox's lifetime ends
        lost = await be.run("print(x)", session="s", timeout_s=5, memory_mb=512)
        fresh = await be.run("print(x)", session="s", timeout_s=5, memory_mb=512)
        again = await be.run("x = 2\nx", session="s", timeout_s=5, memory_mb=512)
        return lost, fresh, again

    lost, fresh, again = asyncio.run(go())
    assert lost.status == "killed" and "sandbox lost" in lost.stderr and "earlier cells are lost" in lost.stderr
    assert fresh.status == "error" and "NameError" in fresh.stderr  # a new, empty sandbox
    assert again.stdout == "2\n"
    assert len(sandboxes.created) == 2


def test_not_found_and_killed_mid_request_are_killed(sandboxes):
    for error in (NotFoundException("404: sandbox not found"), format_sandbox_killed_error()):
        be = backend()
        run(be, "pass")
        sandbox = sandboxes.created[-1]
        sandbox.alive = False
        sandbox.run_error = error
        assert run(be, "pass").status == "killed"
        assert run(be, "pass").status == "ok" and sandboxes.created[-1] is not sandbox


def test_network_failure_with_a_running_sandbox_is_infra_error_and_keeps_state(sandboxes):
    be = backend()
    run(be, "x = 5")
    sandboxes.created[0].run_error = SandboxException("500 Internal Server Error: upstream reset")
    r = run(be, "x")
    assert r.status == "infra_error" and "500 Internal Server Error" in r.stderr and r.stderr.count("\n") == 1
    assert run(be, "x").stdout == "5\n"  # same sandbox, state intact
    assert len(sandboxes.created) == 1


@pytest.mark.parametrize("error, hint", [
    (AuthenticationException("401: Unauthorized, please check your credentials."), "E2B_API_KEY"),
    (RateLimitException("429: Rate limit exceeded, please try again later."), "max_concurrency"),
    (ConnectionError("connection refused"), "connection refused"),
])
def test_failure_to_start_is_infra_error_and_retried_next_cell(sandboxes, error, hint):
    be = backend(domain="ap-shanghai.tencentags.com")
    sandboxes.create_error = error
    r = run(be, "print(1)")
    assert r.status == "infra_error" and hint in r.stderr and "ap-shanghai.tencentags.com" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    sandboxes.create_error = None
    assert run(be, "print(1)").stdout == "1\n"


def test_close_session_kills_its_sandbox(sandboxes):
    be = backend()

    async def go():
        await be.run("x = 1", session="a", timeout_s=5, memory_mb=512)
        await be.run("x = 1", session="b", timeout_s=5, memory_mb=512)
        await be.close_session("a")
        await be.close_session("never-used")  # nothing to kill, no error
        return await be.run("print(x)", session="a", timeout_s=5, memory_mb=512)

    reopened = asyncio.run(go())
    a, b, a2 = sandboxes.created
    assert a.kill_calls == 1 and not a.alive and b.alive
    assert reopened.status == "error" and a2.alive  # a closed session starts over in a new sandbox


def test_aclose_kills_every_sandbox(sandboxes):
    be = backend()

    async def go():
        for session in ("a", "b", "c"):
            await be.run("pass", session=session, timeout_s=5, memory_mb=512)
        await be.aclose()

    asyncio.run(go())
    assert len(sandboxes.created) == 3 and all(s.kill_calls == 1 and not s.alive for s in sandboxes.created)


def test_concurrent_first_cells_of_a_session_start_one_sandbox(sandboxes):
    be = backend()

    async def go():
        return await asyncio.gather(*(be.run(f"v{i} = {i}", session="s", timeout_s=5, memory_mb=512) for i in range(8)))

    results = asyncio.run(go())
    assert all(r.status == "ok" for r in results)
    assert len(sandboxes.created) == 1
    assert sorted(k for k in sandboxes.created[0].namespace if k.startswith("v")) == [f"v{i}" for i in range(8)]


def test_output_is_truncated(sandboxes):
    r = run(backend(max_output_bytes=100), "print('x' * 10000)")
    assert r.truncated and r.stdout == "x" * 100
    r = run(backend(max_output_bytes=5), "print('ééé')")  # never cut inside a character
    assert r.truncated and r.stdout == "éé"


def test_domain_template_and_timeouts_reach_create(sandboxes):
    be = backend(domain="ap-shanghai.tencentags.com", template="my-template", sandbox_timeout_s=900, request_timeout_s=12.5)
    run(be, "pass")
    (call,) = sandboxes.create_calls
    assert call["template"] == "my-template" and call["domain"] == "ap-shanghai.tencentags.com"
    assert call["timeout"] == 900 and call["request_timeout"] == 12.5 and call["api_key"] == KEY


def test_key_comes_from_the_named_variable(sandboxes, monkeypatch):
    monkeypatch.setenv("AGS_KEY", "ags-key-not-e2b-shaped")
    run(backend(api_key_env="AGS_KEY"), "pass")
    assert sandboxes.create_calls[-1]["api_key"] == "ags-key-not-e2b-shaped"


def test_missing_key_names_the_variable(monkeypatch):
    monkeypatch.delenv("MY_E2B_KEY", raising=False)
    with pytest.raises(RaytoolError, match=r"MY_E2B_KEY is not set.*e2b_api_key_env"):
        E2BBackend(api_key_env="MY_E2B_KEY", sandbox_cls=FakeSandbox)
    monkeypatch.setenv("MY_E2B_KEY", "  ")
    with pytest.raises(RaytoolError, match="MY_E2B_KEY"):
        E2BBackend(api_key_env="MY_E2B_KEY", sandbox_cls=FakeSandbox)


def test_api_key_never_leaks(sandboxes, caplog):
    caplog.set_level(logging.DEBUG)
    be = backend(domain="ap-shanghai.tencentags.com")
    results = []

    async def go():
        await be.start()
        results.append(await be.run("x = 1", session="s", timeout_s=5, memory_mb=512))
        # A service echoing the key back in its error (some proxies do) must not carry it further.
        sandboxes.created[0].run_error = SandboxException(f"400 Bad Request: invalid header X-API-KEY={KEY}")
        results.append(await be.run("x", session="s", timeout_s=5, memory_mb=512))
        sandboxes.created[0].alive = False
        results.append(await be.run("x", session="s", timeout_s=5, memory_mb=512))
        sandboxes.create_error = AuthenticationException(f"401: Unauthorized - key {KEY} is not valid")
        results.append(await be.run("x", session="t", timeout_s=5, memory_mb=512))
        results.append(await be.run("x", session=None, timeout_s=5, memory_mb=512))
        await be.close_session("s")
        await be.aclose()

    asyncio.run(go())
    assert [r.status for r in results] == ["ok", "infra_error", "killed", "infra_error", "infra_error"]
    assert "<redacted>" in results[1].stderr and "<redacted>" in results[3].stderr
    for r in results:
        assert KEY not in repr(r) and KEY not in r.stdout + r.stderr
    assert KEY not in repr(be) and KEY not in str(be) and KEY not in str(vars(be))
    assert caplog.records and not [rec for rec in caplog.records if KEY in rec.getMessage()]


def test_missing_sdk_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setenv("E2B_API_KEY", KEY)
    monkeypatch.setitem(sys.modules, "e2b_code_interpreter", None)  # import now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'raytool\[e2b\]'"):
        E2BBackend()


@pytest.mark.skipif(not REAL_SDK, reason="needs e2b-code-interpreter installed")
def test_fake_matches_the_sdk_signatures():
    import inspect

    from e2b_code_interpreter import AsyncSandbox

    for name in ("create", "run_code", "kill", "is_running"):
        real = inspect.signature(getattr(AsyncSandbox, name))
        fake = inspect.signature(getattr(FakeSandbox, name))
        missing = [p for p in fake.parameters if p not in real.parameters and p not in ("opts", "self", "cls")]
        assert not missing, f"{name}: the fake takes {missing}, the SDK does not"
    create = inspect.signature(AsyncSandbox.create).parameters
    assert {"template", "timeout"} <= set(create) and create["opts"].kind is inspect.Parameter.VAR_KEYWORD
    run_code = inspect.signature(AsyncSandbox.run_code).parameters
    assert {"on_stdout", "on_stderr", "timeout", "request_timeout"} <= set(run_code)
