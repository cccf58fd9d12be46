"""The local sandbox: notebook cells, sessions, limits and crash reporting (one fork-server per module).

Hostile code lives in tests/sandbox_security/; these tests check the behaviour a user relies on.
"""

import asyncio
import os
import tempfile

import pytest

from raytool.sandbox.local import LocalBackend, _describe_exit


@pytest.fixture(scope="module")
def sandbox():
    loop = asyncio.new_event_loop()
    backend = LocalBackend(max_output_bytes=200, warm_sessions=1, idle_session_s=0.5)
    loop.run_until_complete(backend.start())

    def run(code, **kw):
        kw.setdefault("timeout_s", 5.0)
        return loop.run_until_complete(backend.run(code, **kw))

    run.backend, run.loop = backend, loop
    yield run
    loop.run_until_complete(backend.aclose())
    loop.close()


def test_ok_error_and_exit_codes(sandbox):
    ok = sandbox("print(sum(range(10)))")
    assert (ok.status, ok.stdout, ok.exit_code) == ("ok", "45\n", 0)
    err = sandbox("raise ValueError('boom')")
    assert err.status == "error" and err.stderr.rstrip().endswith("ValueError: boom") and '<cell-1>", line 1' in err.stderr
    assert sandbox("import sys; sys.exit(3)").exit_code == 3
    assert sandbox("import sys; sys.exit(0)").status == "ok"
    syntax = sandbox("def f(:\n  pass")
    assert syntax.status == "error" and "SyntaxError" in syntax.stderr


def test_trailing_expression_is_shown_like_a_notebook(sandbox):
    assert sandbox("x = 6\nx * 7").stdout == "42\n"
    assert sandbox("'a' + 'b'").stdout == "'ab'\n"  # the repr, as a notebook shows it
    assert sandbox("None").stdout == ""
    assert sandbox("x = 6\nprint(x)").stdout == "6\n"  # a call that returns None prints nothing extra
    assert sandbox("for i in range(2):\n    i").stdout == ""  # the last statement is not an expression
    assert sandbox("'''a\nb'''").stdout == "'a\\nb'\n"


def test_session_state_persists_and_never_leaks(sandbox):
    assert sandbox("x = 41", session="s1").status == "ok"
    assert sandbox("x + 1", session="s1").stdout == "42\n"
    assert sandbox("open('f.txt', 'w').write('mine')", session="s1").status == "ok"
    other = sandbox("import os\nprint(os.path.exists('f.txt'))\nx", session="s2")
    assert other.stdout == "False\n" and "NameError" in other.stderr
    assert sandbox("open('f.txt').read()", session="s1").stdout == "'mine'\n"
    loop, backend = sandbox.loop, sandbox.backend
    loop.run_until_complete(backend.close_session("s1"))
    again = sandbox("x", session="s1")
    assert "NameError" in again.stderr and "earlier interpreter" not in again.stderr  # closed on purpose: nothing to report
    loop.run_until_complete(backend.close_session("s1"))
    loop.run_until_complete(backend.close_session("s2"))


def test_concurrent_first_cells_of_a_session_share_one_interpreter(sandbox):
    async def both():
        return await asyncio.gather(*[sandbox.backend.run(code, session="par", timeout_s=5) for code in ("a = 1", "import os; os.getpid()")])

    spawned = sandbox.backend.counts["spawned"]
    first, second = sandbox.loop.run_until_complete(both())
    assert first.status == second.status == "ok"
    assert sandbox("a", session="par").stdout == "1\n"  # the same interpreter ran both
    assert sandbox.backend.counts["spawned"] - spawned <= 2  # one for the session, at most one warm refill
    sandbox.loop.run_until_complete(sandbox.backend.close_session("par"))


def test_a_crashed_session_is_reported_not_silently_reset(sandbox):
    sandbox("x = 1", session="c")
    crash = sandbox("import os; os._exit(7)", session="c")
    assert crash.status == "error" and "exited with code 7" in crash.stderr
    after = sandbox("print('fresh')\nx", session="c")
    assert after.stdout == "fresh\n" and "earlier interpreter died" in after.stderr and "NameError" in after.stderr
    slow = sandbox("import time; time.sleep(30)", session="c", timeout_s=0.5)
    assert slow.status == "timeout" and slow.duration_s < 3
    assert "timeout" in sandbox("1", session="c").stderr
    sandbox.loop.run_until_complete(sandbox.backend.close_session("c"))


def test_limits_output_memory_and_time(sandbox):
    out = sandbox("print('a' * 5000 + 'b' * 5000)")
    assert out.truncated and out.status == "ok"
    marker = "\n[... 9801 bytes cut ...]\n"  # head and tail kept, the middle marked, all within the cap
    assert out.stdout == "a" * 100 + marker + "b" * (99 - len(marker)) + "\n" and len(out.stdout) == 200
    assert sandbox("x = bytearray(1 << 31)", memory_mb=256).status == "oom"
    assert sandbox("while True: pass", timeout_s=0.5).status == "timeout"


def test_cells_see_no_host_environment_files_or_network(sandbox):
    os.environ["RAYTOOL_TEST_SECRET"] = "s3cret"  # set after the fork-server started: still must not show
    r = sandbox("import os; print(sorted(os.environ)); print(os.getcwd())")
    assert "RAYTOOL_TEST_SECRET" not in r.stdout and "HOME" in r.stdout
    caps = sandbox.backend.caps
    if not caps.get("netns"):
        pytest.skip("the kernel refused namespaces here (the backend logged why)")
    net = sandbox("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)")
    assert net.status == "error" and ("unreachable" in net.stderr.lower() or "refused" in net.stderr.lower())
    if caps.get("mountns"):
        assert r.stdout.splitlines()[-1] == "/sandbox"
        assert "Read-only file system" in sandbox("open('/usr/x', 'w')").stderr
        assert not sandbox("import os; print(os.path.exists(os.path.expanduser('~root/.ray')))").stdout.startswith("True")


def test_idle_sessions_expire(sandbox):
    backend, loop = sandbox.backend, sandbox.loop
    sandbox("y = 1", session="idle")
    assert "idle" in backend.sessions
    # housekeeping runs every max(1, idle/4) s; idle_session_s is 0.5 in this fixture
    loop.run_until_complete(asyncio.sleep(2.2))
    assert "idle" not in backend.sessions and backend.counts["expired"] >= 1


def test_exit_codes_are_described_for_people():
    assert _describe_exit(128 + 9) == ("killed", "the interpreter was killed by SIGKILL")
    assert _describe_exit(128 + 24)[0] == "timeout"  # SIGXCPU: its CPU time ran out
    assert "C stack" in _describe_exit(128 + 11)[1]
    assert _describe_exit(3) == ("error", "the interpreter exited with code 3")


def test_user_namespace_isolation_as_non_root_hosts_get_it():
    """As root, ask for what a non-root host gets: isolation inside a user namespace. A cell is
    root of nothing there: it cannot remount its read-only view writable."""

    async def go():
        backend = LocalBackend(warm_sessions=0, force_userns=True)
        await backend.start()
        try:
            if not backend.caps.get("userns") or not backend.caps.get("mountns"):
                pytest.skip(f"the kernel refused a user namespace here: {backend.caps}")
            remount = await backend.run(
                "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                "print(libc.mount(None, b'/usr', None, 32 | 4096, None), ctypes.get_errno())", timeout_s=5)
            write = await backend.run("open('/usr/x', 'w')", timeout_s=5)
            net = await backend.run("import socket; socket.create_connection(('127.0.0.1', 22), timeout=1)", timeout_s=5)
            await backend.run("x = 41", session="u", timeout_s=5)
            state = await backend.run("x + 1", session="u", timeout_s=5)
            procs = await backend.run("import os; print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))", timeout_s=5)
            return remount, write, net, state, procs, backend.caps
        finally:
            await backend.aclose()

    remount, write, net, state, procs, caps = asyncio.run(go())
    assert remount.stdout == "-1 1\n"  # EPERM
    assert "Read-only file system" in write.stderr
    assert net.status == "error"
    assert state.stdout == "42\n"
    if caps["proc"]:
        assert procs.stdout == "[1, 2]\n"  # the session's reaper and interpreter, nothing of the host


def test_without_namespaces_cells_still_run_under_their_own_uid(tmp_path, monkeypatch):
    """isolate=false (what a kernel that refuses namespaces gives): rlimits, an empty environment,
    a working dir of its own, even when the temp dir is private to us (mode 0700)."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(private))

    async def go():
        backend = LocalBackend(isolate=False, warm_sessions=0)
        await backend.start()
        try:
            r = await backend.run("import os; print(os.getuid() != 0, os.getcwd().startswith('/tmp/raytool-cell-'), len(os.environ) < 12)", timeout_s=5)
            t = await backend.run("while True: pass", timeout_s=0.5)
            return r, t, backend.caps
        finally:
            await backend.aclose()

    r, t, caps = asyncio.run(go())
    assert caps["mountns"] is False and r.status == "ok"
    assert r.stdout == f"{caps['setuid']} True True\n"
    assert t.status == "timeout"


def test_aclose_leaves_nothing_of_the_backend_pending_on_its_loop():
    """A refill still forking when the backend closes is awaited to its end, so a loop closed
    right after holds no pending task (asyncio would log "Task was destroyed but it is pending!"
    into whatever test runs next)."""
    loop = asyncio.new_event_loop()
    backend = LocalBackend(warm_sessions=1)

    async def main():
        await backend.start()
        backend._spawn_task(asyncio.sleep(3600))  # background work still running at close, as a refill would be
        await backend.aclose()
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    try:
        assert loop.run_until_complete(main()) == []
    finally:
        loop.close()
