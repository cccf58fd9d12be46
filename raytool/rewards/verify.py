"""Answer equivalence with math-verify, run in a child process so no answer can stall the caller.

math-verify's own timeouts use SIGALRM, which works only on a process's main thread (a Ray actor's
methods may run elsewhere) and cannot interrupt C code anyway (`9^{9^{9^9}}` is one big-integer
power inside sympy). So the verifier keeps a small child process (`_child` below) that runs
math-verify on its own main thread and is sent one (gold, prediction) pair at a time over a pipe:
- at 0.8 x `timeout_s` the child's own timer interrupts Python-level work (deep nesting, long
  expressions) and it answers "timeout", staying up;
- at `timeout_s` the caller stops waiting: a child stuck in C code is killed and a spare child,
  started in advance, takes over at once (a new spare imports in the background, ~0.5-1 s).
A round trip costs well under a millisecond plus math-verify's own work (~1-2 ms for a fraction);
`raytool.rewards.math.judge` settles plain integers and exact matches without one.
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Literal

import msgspec

log = logging.getLogger(__name__)

Verdict = Literal["equal", "different", "unparsed", "timeout", "crashed"]

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
STARTUP_TIMEOUT_S = 120.0  # importing sympy on a loaded node can be slow; this is not the per-call limit
SOFT_FRACTION = 0.8  # the child's own timer, as a fraction of timeout_s


class _Child:
    """One verifier process and the part of its output not yet read."""

    def __init__(self):
        # It imports raytool from where this copy lives, whatever the caller's cwd and sys.path.
        code = (f"import sys; root = {_PACKAGE_ROOT!r}; sys.path.insert(0, root) if root not in sys.path else None; "
                "from raytool.rewards.verify import _child; _child()")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.buf = b""
        self.ready = False

    def read_line(self, deadline: float) -> bytes | None:
        """One line; None at the deadline; b"" when the process died."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return b""
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line

    def wait_ready(self) -> None:
        if self.ready:
            return
        line = self.read_line(time.monotonic() + STARTUP_TIMEOUT_S)
        if line != b"ready":
            self.kill()
            why = "did not start in time" if line is None else (line.decode(errors="replace") or "exited")
            raise RuntimeError(f"math-verify child process: {why} (is math-verify installed? pip install 'math-verify[antlr4_13_2]')")
        self.ready = True

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class MathVerifier:
    """`verdict(gold, pred)`: whether two answers (LaTeX or plain text) are mathematically equal.

    "unparsed": math-verify turned one side into no sympy expression (the caller falls back to an
    exact match); "timeout": not judged within `timeout_s`; "crashed": the child died on this
    answer (score both as wrong). Thread-safe (calls are serialized); never raises on an answer,
    only when no child can start at all.
    """

    def __init__(self, timeout_s: float = 5.0):
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        # Started on the first answer that needs math-verify: a run whose answers are all settled
        # by exact or integer comparison (raytool.rewards.math.judge) never pays for two sympy imports.
        self._child: _Child | None = None
        self._spare: _Child | None = None

    def _replace_child(self) -> None:
        self._child.kill()
        self._child, self._spare = self._spare, _Child()

    def verdict(self, gold: str, pred: str) -> Verdict:
        with self._lock:
            if self._child is None:
                self._child, self._spare = _Child(), _Child()
            elif self._child.proc.poll() is not None:  # died while idle (see _child): not this answer's fault
                self._replace_child()
            self._child.wait_ready()
            try:
                self._child.proc.stdin.write(msgspec.json.encode([gold, pred, SOFT_FRACTION * self.timeout_s]) + b"\n")
                line = self._child.read_line(time.monotonic() + self.timeout_s)
            except BrokenPipeError:
                line = b""
            if line in (b"equal", b"different", b"unparsed"):
                return line.decode()
            if line == b"timeout":
                log.warning("math-verify timed out on prediction %r (gold %r)", pred[:80], gold[:80])
                return "timeout"
            verdict: Verdict = "timeout" if line is None else "crashed"
            log.warning("math-verify %s on prediction %r (gold %r); replacing its process", verdict, pred[:80], gold[:80])
            self._replace_child()
            return verdict

    def close(self) -> None:
        with self._lock:
            self._kill_children()

    def _kill_children(self) -> None:
        for child in (self._child, self._spare):
            if child is not None:
                child.kill()
        self._child = self._spare = None

    def __del__(self):
        try:
            self._kill_children()
        except Exception:  # half-built, or interpreter shutdown
            pass


class _Deadline(BaseException):
    """Raised by the child's timer; a BaseException so that math-verify's `except Exception` lets it through."""


def _child() -> None:
    import signal

    # Die with the parent even in the middle of a computation that never returns (Linux; elsewhere the
    # child ends when it next reads end-of-file). The signal follows the spawning *thread*: a child
    # that dies that way is found dead before the next request and replaced.
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    # The protocol has stdout to itself: anything a library prints goes to stderr.
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
        from sympy import Basic, MatrixBase
    except Exception as exc:
        out.write(f"cannot import math-verify: {type(exc).__name__}: {exc}".replace("\n", " ").encode() + b"\n")
        return
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled": this process keeps its own
    targets = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]

    def parsed(answer: str) -> list:
        return parse("\\boxed{" + answer + "}", extraction_config=targets, parsing_timeout=None)

    def judge(gold: str, pred: str) -> bytes:
        g, p = parsed(gold), parsed(pred)
        if not any(isinstance(x, (Basic, MatrixBase)) for x in g) or not any(isinstance(x, (Basic, MatrixBase)) for x in p):
            return b"unparsed"
        return b"equal" if verify(g, p, timeout_seconds=None) else b"different"

    def alarm(signum, frame):
        raise _Deadline

    signal.signal(signal.SIGALRM, alarm)
    judge("\\frac{1}{2}", "x = 0.5")  # the parsers build their tables on first use: not on a timed call
    out.write(b"ready\n")
    for line in sys.stdin.buffer:
        gold, pred, soft_timeout_s = msgspec.json.decode(line)
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, soft_timeout_s)
                answer = judge(gold, pred)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _Deadline:
            answer = b"timeout"
        except Exception:  # math-verify catches its own; anything left means it could not compare
            answer = b"unparsed"
        out.write(answer + b"\n")
