"""The local sandbox: a walled-in fork-server that runs cells in per-trajectory sessions.

`LocalBackend` starts one zygote (`raytool/sandbox/_zygote.py`): a warm interpreter with math,
numpy and sympy preloaded that has entered network, mount, IPC and UTS namespaces once and pivoted
into a read-only view of what Python needs. Each session is forked from it into its own PID and
mount namespace with a private size-limited tmpfs at /sandbox (its working directory), runs as a
uid of its own with rlimits on address space, CPU, processes, file size and open files, and dies
completely (every process in its namespace) when the backend ends it. See the zygote's docstring
for the process tree and what happens where the kernel refuses a namespace.

Why namespaces by hand rather than `bubblewrap`: bwrap sets isolation up per exec, so every cell
would pay an exec and a fresh interpreter (~30 ms, more with numpy); a fork-server must enter
isolation once and fork from inside it, which bwrap cannot do for us.

Sessions: `run(code, session="traj-1")` keeps one live interpreter per session, so `x = 41` then
`x + 1` prints 42; `session=None` runs in a fresh interpreter that is thrown away after the cell.
Warm sessions are forked ahead of time, so a cell does not wait for a fork. A session whose
interpreter died (timeout, crash, memory) is reported on that cell, and the next cell on the same
session starts a new interpreter with a note saying the earlier state is gone. Idle sessions
expire after `idle_session_s`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field

from raytool.types import ExecResult

log = logging.getLogger(__name__)

ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_zygote.py")
DEFAULT_PRELOAD = ["math", "cmath", "itertools", "functools", "fractions", "decimal", "collections", "statistics", "re", "numpy", "sympy"]
# What a cell's environment holds: nothing of the host's.
CELL_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/sandbox",
    "TMPDIR": "/sandbox",
    "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
}
UID_RANGE = (1 << 20, 1 << 30)  # sessions run as random uids no account on the host uses
_logged_notes: set[str] = set()


class SandboxDown(RuntimeError):
    """The fork-server is not running (it failed to start or died)."""


class _Capture:
    """A cell's stdout or stderr: a non-blocking pipe read as it fills, kept up to a byte cap.

    Past the cap the middle is dropped: the first half and the last half of the cap are kept (an
    error's last line matters as much as the first output), with a marker saying how much is gone.
    """

    def __init__(self, fd: int, cap: int):
        self.fd, self.cap = fd, cap
        self.head_cap = cap // 2
        self.head, self.tail = bytearray(), bytearray()
        self.dropped = 0
        self.closed = False
        os.set_blocking(fd, False)
        asyncio.get_running_loop().add_reader(fd, self.read)

    def read(self) -> None:
        """Drain what is in the pipe now (called by the loop, and once more when a cell ends)."""
        while not self.closed:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return
            if not data:
                self.close()
                return
            room = self.head_cap - len(self.head)
            if room > 0:
                self.head += data[:room]
                data = data[room:]
            self.tail += data
            excess = len(self.tail) - (self.cap - self.head_cap)
            if excess > 0:
                del self.tail[:excess]
                self.dropped += excess

    def take(self) -> tuple[str, bool]:
        self.read()
        middle = f"\n[... {self.dropped} bytes cut ...]\n".encode() if self.dropped else b""
        tail = self.tail[len(middle):]  # the marker takes its room from the tail: the whole stays within the cap
        text = (bytes(self.head) + middle + bytes(tail)).decode("utf-8", "replace")
        cut = self.dropped > 0
        self.head, self.tail, self.dropped = bytearray(), bytearray(), 0
        return text, cut

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().remove_reader(self.fd)
            os.close(self.fd)


@dataclass
class _Session:
    pid: int  # the session supervisor's pid on the host
    memory_mb: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    out: _Capture
    err: _Capture
    exited: asyncio.Future
    workdir: str | None = None  # only without a mount namespace: a host temp dir
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)


def _describe_exit(code: int | None) -> tuple[str, str]:
    """(status, message) for an interpreter that died; `code` is 128+signal or an exit code."""
    if code is None:
        return "killed", "the interpreter died"
    if code > 128:
        sig = code - 128
        if sig == signal.SIGXCPU:
            return "timeout", "the cell used up its CPU time"
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
        hint = " (a segmentation fault, e.g. recursion too deep for the C stack)" if sig == signal.SIGSEGV else ""
        return "killed", f"the interpreter was killed by {name}{hint}"
    return "error", f"the interpreter exited with code {code}"


class LocalBackend:
    def __init__(
        self,
        *,
        max_output_bytes: int = 8192,
        isolate: bool = True,
        python: str | None = None,
        preload: list[str] | None = None,
        max_processes: int = 64,
        max_open_files: int = 256,
        disk_mb: int = 64,
        idle_session_s: float = 600.0,
        warm_sessions: int = 2,
        memory_mb: int = 1024,
        start_timeout_s: float = 60.0,
        force_userns: bool = False,
    ):
        self.max_output_bytes = max_output_bytes
        self.isolate = isolate
        self.python = python or sys.executable
        self.preload = DEFAULT_PRELOAD if preload is None else list(preload)
        self.limits = {"max_processes": max_processes, "max_open_files": max_open_files, "disk_mb": disk_mb}
        self.idle_session_s = idle_session_s
        self.warm_target = warm_sessions
        self.default_memory_mb = memory_mb
        self.start_timeout_s = start_timeout_s
        self.force_userns = force_userns  # isolate in a user namespace even as root (what non-root hosts get)
        self.caps: dict = {}
        self.sessions: dict[str, _Session] = {}
        self.lost: dict[str, str] = {}  # session -> why its interpreter died (reported on its next cell)
        self.counts = {"spawned": 0, "expired": 0, "zygote_starts": 0}
        self._proc: asyncio.subprocess.Process | None = None
        self._cmd: socket.socket | None = None
        self._root: str | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._exits: dict[int, asyncio.Future] = {}
        self._warm: list[_Session] = []
        self._ids = itertools.count()
        self._starting: asyncio.Task | None = None
        self._refilling = False
        self._closing = False
        self._naming: dict[str, asyncio.Lock] = {}  # session -> lock held while its interpreter is found or made
        self._tasks: set[asyncio.Task] = set()

    # -- the zygote --------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the fork-server (idempotent) and fork the warm sessions."""
        if self._proc is not None and self._proc.returncode is None:
            return
        if self._starting is None or self._starting.done():
            self._starting = asyncio.ensure_future(self._start_zygote())
        await asyncio.shield(self._starting)

    async def _start_zygote(self) -> None:
        self._root = tempfile.mkdtemp(prefix="raytool-sandbox-")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cfg = {"cmd_fd": theirs.fileno(), "parent_pid": os.getpid(), "root": self._root, "isolate": self.isolate, "preload": self.preload,
               "force_userns": self.force_userns}
        env = {k: v for k, v in CELL_ENV.items() if k != "HOME"} | {"HOME": self._root}
        self._proc = await asyncio.create_subprocess_exec(
            self.python, "-I", ZYGOTE, json.dumps(cfg),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            pass_fds=[theirs.fileno()], env=env, cwd=self._root,
        )
        theirs.close()
        self._cmd = ours
        self.counts["zygote_starts"] += 1
        hello: asyncio.Future = asyncio.get_running_loop().create_future()
        self._spawn_task(self._read_events(self._proc, hello))
        self._spawn_task(self._log_stderr(self._proc))
        try:
            msg = await asyncio.wait_for(hello, self.start_timeout_s)
        except (asyncio.TimeoutError, SandboxDown) as exc:
            await self._stop_zygote()
            raise SandboxDown(f"local sandbox: the fork-server did not start within {self.start_timeout_s:.0f} s ({exc or 'no hello'})") from None
        self.caps = msg["caps"]
        for note in msg["notes"]:
            if note not in _logged_notes:  # once per process, however many backends start
                _logged_notes.add(note)
                log.warning("local sandbox: %s", note)
        self._spawn_task(self._housekeeping())

    async def _read_events(self, proc, hello: asyncio.Future) -> None:
        while line := await proc.stdout.readline():
            msg = json.loads(line)
            event = msg["event"]
            if event == "hello":
                hello.set_result(msg)
            elif event == "spawned":
                fut = self._pending.pop(msg["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(msg["pid"])
            elif event == "exit":
                fut = self._exits.pop(msg["pid"], None)
                if fut is not None and not fut.done():
                    fut.set_result(msg["code"])
        # The zygote is gone: every session and every waiter learns it now.
        if proc is self._proc:
            self._proc = None
        down = SandboxDown("local sandbox: the fork-server died")
        for fut in [hello, *self._pending.values()]:
            if not fut.done():
                fut.set_exception(down)
        for fut in self._exits.values():
            if not fut.done():
                fut.set_result(None)
        self._pending.clear()

    async def _log_stderr(self, proc) -> None:
        while line := await proc.stderr.readline():
            log.warning("local sandbox fork-server: %s", line.decode(errors="replace").rstrip())

    async def _stop_zygote(self) -> None:
        proc, self._proc = self._proc, None
        if self._cmd is not None:
            self._cmd.close()  # EOF: the zygote kills every session and exits
            self._cmd = None
        if proc is not None and proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def _spawn_task(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- sessions ----------------------------------------------------------------------------

    async def _fork_session(self, memory_mb: int) -> _Session:
        await self.start()
        ctrl_ours, ctrl_theirs = socket.socketpair()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        req = next(self._ids)
        spawned = asyncio.get_running_loop().create_future()
        self._pending[req] = spawned
        uid = random.randrange(*UID_RANGE)
        workdir = None if self.caps.get("mountns") else tempfile.mkdtemp(prefix="raytool-cell-", dir=self._cell_parent())
        spec = {"op": "spawn", "id": req, "uid": uid, "env": CELL_ENV | ({"HOME": workdir, "TMPDIR": workdir} if workdir else {}),
                "workdir": workdir, "limits": self.limits | {"memory_mb": memory_mb}}
        try:
            socket.send_fds(self._cmd, [json.dumps(spec).encode()], [ctrl_theirs.fileno(), out_w, err_w])
        except (OSError, AttributeError) as exc:
            self._pending.pop(req, None)
            raise SandboxDown(f"local sandbox: the fork-server is not reachable ({exc})") from None
        finally:
            for fd in (ctrl_theirs.fileno(), out_w, err_w):
                os.close(fd)
            ctrl_theirs.detach()
        pid = await asyncio.wait_for(spawned, self.start_timeout_s)
        exited = asyncio.get_running_loop().create_future()
        self._exits[pid] = exited
        reader, writer = await asyncio.open_unix_connection(sock=ctrl_ours, limit=1 << 20)
        s = _Session(pid, memory_mb, reader, writer, _Capture(out_r, self.max_output_bytes), _Capture(err_r, self.max_output_bytes), exited, workdir)
        self.counts["spawned"] += 1
        try:
            line = await asyncio.wait_for(reader.readline(), self.start_timeout_s)
        except asyncio.TimeoutError:
            line = b""
        if not line.startswith(b"{\"ready\""):
            err, _ = s.err.take()
            await self._end(s)
            raise SandboxDown(f"local sandbox: a session failed to start: {err.strip()[-400:] or 'no reason given'}")
        return s

    def _cell_parent(self) -> str:
        """Where cells' working dirs go without a mount namespace: a dir every uid can pass through
        (a session's own uid must reach its cwd), the temp dir if it is one, else /tmp."""
        path = os.path.realpath(tempfile.gettempdir())
        probe = path
        while True:
            if not os.stat(probe).st_mode & 0o001:
                return "/tmp"
            if probe == "/":
                return path
            probe = os.path.dirname(probe)

    async def _session_for(self, name: str | None, memory_mb: int) -> tuple[_Session, str]:
        """The live session to run in, and a note if an earlier interpreter of it died."""
        if name is None:
            return await self._new_session(None, memory_mb)
        # Concurrent first cells of one session (a turn's parallel tool calls) must share one interpreter.
        async with self._naming.setdefault(name, asyncio.Lock()):
            if name in self.sessions:
                return self.sessions[name], ""
            return await self._new_session(name, memory_mb)

    async def _new_session(self, name: str | None, memory_mb: int) -> tuple[_Session, str]:
        s = None
        while self._warm and s is None:
            cand = self._warm.pop()
            if cand.memory_mb == memory_mb and not cand.exited.done():
                s = cand
            else:
                await self._end(cand)
        self._refill()
        if s is None:
            s = await self._fork_session(memory_mb)
        note = ""
        if name is not None:
            self.sessions[name] = s
            if name in self.lost:
                note = f"[sandbox] note: this session's earlier interpreter died ({self.lost.pop(name)}); variables from before are gone.\n"
        return s, note

    def _refill(self) -> None:
        if self.warm_target > 0 and not self._refilling and not self._closing:
            self._refilling = True
            self._spawn_task(self._refill_warm())

    async def _refill_warm(self) -> None:
        """Fork the missing warm sessions, all at once (forks run in the zygote's processes)."""
        try:
            while (missing := self.warm_target - len(self._warm)) > 0 and self._proc is not None and not self._closing:
                forks = await asyncio.gather(*[self._fork_session(self.default_memory_mb) for _ in range(missing)], return_exceptions=True)
                self._warm.extend(s for s in forks if isinstance(s, _Session))
                failed = [f for f in forks if not isinstance(f, _Session)]
                if failed and not self._closing:
                    log.warning("local sandbox: could not fork a warm session: %s", failed[0])
                    break
        finally:
            self._refilling = False

    async def _end(self, s: _Session) -> None:
        """Kill a session's whole namespace and release what the backend held for it."""
        if not s.exited.done() and self._cmd is not None:
            try:
                self._cmd.send(json.dumps({"op": "kill", "pid": s.pid}).encode())
            except OSError:
                pass
        s.writer.close()
        s.out.close()
        s.err.close()
        if s.workdir:
            shutil.rmtree(s.workdir, ignore_errors=True)

    async def _housekeeping(self) -> None:
        while self._proc is not None:
            await asyncio.sleep(min(30.0, max(1.0, self.idle_session_s / 4)))
            now = time.monotonic()
            for name, s in list(self.sessions.items()):
                if now - s.last_used > self.idle_session_s and not s.lock.locked():
                    self.counts["expired"] += 1
                    await self.close_session(name)

    # -- the backend protocol ----------------------------------------------------------------

    async def run(self, code: str, *, session: str | None = None, timeout_s: float = 5.0, memory_mb: int | None = None) -> ExecResult:
        memory_mb = memory_mb or self.default_memory_mb
        start = time.monotonic()
        try:
            s, note = await self._session_for(session, memory_mb)
        except (SandboxDown, asyncio.TimeoutError) as exc:
            return ExecResult(status="infra_error", stderr=str(exc) or "local sandbox: a session did not start in time", duration_s=time.monotonic() - start)
        async with s.lock:
            s.last_used = time.monotonic()
            result = await self._run_cell(s, code, timeout_s)
        if note:
            result.stderr = note + result.stderr
        result.duration_s = time.monotonic() - start
        if session is None:
            await self._end(s)
        elif result.status in ("timeout", "killed") or (result.status == "error" and s.exited.done()):
            # The interpreter is gone: report it now, and on the session's next cell.
            self.lost[session] = result.status if result.status != "error" else "it exited"
            self.sessions.pop(session, None)
            await self._end(s)
        return result

    async def _run_cell(self, s: _Session, code: str, timeout_s: float) -> ExecResult:
        try:
            s.writer.write((json.dumps({"code": code, "cpu_s": timeout_s}) + "\n").encode())
            await s.writer.drain()
            line = await asyncio.wait_for(s.reader.readline(), timeout_s)
        except asyncio.TimeoutError:
            out, cut_out = s.out.take()
            err, cut_err = s.err.take()
            await self._end(s)
            return ExecResult(status="timeout", stdout=out, stderr=err + f"\n[sandbox] the cell ran past its {timeout_s:g} s limit and was killed.",
                              truncated=cut_out or cut_err)
        except (ConnectionError, OSError):
            line = b""
        if line:
            try:
                reply = json.loads(line)
                ok = reply.get("done") is True
            except (ValueError, AttributeError):
                ok = False
            if not ok:  # only the cell itself can have written this
                out, cut_out = s.out.take()
                err, cut_err = s.err.take()
                await self._end(s)
                return ExecResult(status="error", stdout=out, stderr=err + "\n[sandbox] the cell wrote to the sandbox's control channel; its session was ended.",
                                  truncated=cut_out or cut_err)
            out, cut_out = s.out.take()
            err, cut_err = s.err.take()
            error = reply.get("error")
            status = "ok" if error is None else "oom" if error == "MemoryError" else "error"
            return ExecResult(status=status, stdout=out, stderr=err, exit_code=reply.get("exit_code") if error else 0, truncated=cut_out or cut_err)
        # EOF: the interpreter died mid-cell. Its exit code comes from the zygote.
        try:
            code_ = await asyncio.wait_for(asyncio.shield(s.exited), 5.0)
        except asyncio.TimeoutError:
            code_ = None
        out, cut_out = s.out.take()
        err, cut_err = s.err.take()
        await self._end(s)
        status, why = _describe_exit(code_)
        if not s.exited.done():
            s.exited.set_result(code_)
        return ExecResult(status=status, stdout=out, stderr=err + f"\n[sandbox] {why}.", exit_code=code_, truncated=cut_out or cut_err)

    async def close_session(self, session: str) -> None:
        self.lost.pop(session, None)
        self._naming.pop(session, None)
        s = self.sessions.pop(session, None)
        if s is not None:
            async with s.lock:
                await self._end(s)

    async def aclose(self) -> None:
        """Stop the background work (a warm-session refill), end every session and stop the
        fork-server. The background tasks are awaited, not only cancelled: a loop closed right
        after would otherwise destroy them pending (and asyncio logs an error in whatever runs next)."""
        self._closing = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for name in list(self.sessions):
            await self.close_session(name)
        for s in self._warm:
            await self._end(s)
        self._warm.clear()
        await self._stop_zygote()

    def stats(self) -> dict:
        return {"sessions": len(self.sessions), "warm": len(self._warm), **self.counts, "isolation": dict(self.caps)}
