"""An engine's own cause of death, and the rule that tells a crash that repeats from a transient one.

vLLM runs the model in child processes: when one raises, the rollout server sees only
`EngineDeadError("EngineCore encountered an issue. See stack trace (above) ...")`, and the cause is a
traceback in a child's stderr. `install_crash_recorder()` runs in those children (the worker
extension imports it) and writes the first exception vLLM logs there to a file the server named in
`CRASH_FILE_ENV`; `read_crash()` gives it back as an `EngineCrash`.

The rule (`repeats`): a server is restarted after a death, unless its engine died of the same
exception (type and message) as at its previous death, with requests in flight both times or within
`REPEAT_WINDOW_S` of its restart: then a restart only replays the crash (the same requests come back
to it), and the run stops in one line instead. A death with no known exception (a killed process,
the kernel's OOM killer) or an out-of-memory error is transient and always restarted.
"""

from __future__ import annotations

import logging
import os
import time
import traceback as tb

import msgspec

CRASH_FILE_ENV = "RAYTOOL_ENGINE_CRASH_FILE"
REPEAT_WINDOW_S = 120.0  # a death this soon after the engine came up again is "right after a restart"
TRANSIENT_TYPES = frozenset({"OutOfMemoryError", "MemoryError"})  # may pass once memory frees up: restarted


class EngineCrash(msgspec.Struct, frozen=True):
    """The exception that killed an engine, as raised in the process that ran it."""

    type: str  # its class name, e.g. "RuntimeError"
    message: str
    traceback: str = ""
    process: str = ""  # where it was raised, e.g. "vLLM Worker pid=123"

    def one_line(self) -> str:
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"{self.type}: {first[:400]}" if first else self.type

    @classmethod
    def of(cls, exc: BaseException, process: str = "") -> "EngineCrash":
        return cls(type(exc).__name__, str(exc), "".join(tb.format_exception(exc)), process)


class EngineDeath(msgspec.Struct, frozen=True):
    """One death of a server's engine."""

    crash: EngineCrash | None  # None: no exception known (the process was killed)
    uptime_s: float  # since the engine came up (at the server's start or restart)
    requests: list[str] = []  # ids of the requests in flight at the death (the first few)
    in_flight: int = 0  # how many were in flight
    at: float = 0.0  # wall-clock time


def repeats(previous: EngineDeath | None, current: EngineDeath) -> bool:
    """Whether `current` replays `previous`: the same known, non-transient exception, with requests in
    flight at both deaths or right after the restart. Then restarting again would only crash again."""
    if previous is None or previous.crash is None or current.crash is None:
        return False
    if current.crash.type in TRANSIENT_TYPES or "out of memory" in current.crash.message.lower():
        return False
    same = (previous.crash.type, previous.crash.message) == (current.crash.type, current.crash.message)
    return same and ((previous.in_flight > 0 and current.in_flight > 0) or current.uptime_s <= REPEAT_WINDOW_S)


def verdict(role: str, death: EngineDeath) -> str:
    """The one line that ends the run for a crash that repeats."""
    requests = ""
    if death.in_flight:
        shown = ", ".join(death.requests[:3])
        requests = f"; {death.in_flight} request(s) in flight, e.g. {shown}" if shown else f"; {death.in_flight} request(s) in flight"
    where = f" in {death.crash.process}" if death.crash.process else ""
    return (f"{role}: its engine died again right after a restart with the same error{where}: {death.crash.one_line()}"
            f"{requests}; not restarted again (a restart replays it); full traceback in run.log")


def read_crash(path: str | os.PathLike | None) -> EngineCrash | None:
    """The crash an engine's child process recorded at `path` (None: none recorded)."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    if not data:
        return None
    try:
        return msgspec.json.decode(data, type=EngineCrash)
    except msgspec.DecodeError:  # a child killed mid-write: the cause is not known
        return None


class _CrashRecorder(logging.Handler):
    """Writes the first record logged with an exception at ERROR or above to `path` (once a process)."""

    def __init__(self, path: str):
        super().__init__(logging.ERROR)
        self.path = path
        self._done = False

    def emit(self, record: logging.LogRecord) -> None:  # under the handler's own lock (Handler.handle)
        if self._done or not record.exc_info or record.exc_info[1] is None:
            return
        self._done = True
        crash = EngineCrash.of(record.exc_info[1], f"{record.processName} pid={record.process}")
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(msgspec.json.encode(crash))
        try:
            os.link(tmp, self.path)  # the first process to record wins; a later one (the engine core
        except FileExistsError:  # reporting the worker's failure again) does not overwrite the cause
            pass
        finally:
            os.unlink(tmp)


def install_crash_recorder(logger_name: str = "vllm") -> None:
    """In an engine's child process: record the first exception `logger_name` logs to the file the
    parent named in CRASH_FILE_ENV (nothing when it named none)."""
    path = os.environ.get(CRASH_FILE_ENV)
    logger = logging.getLogger(logger_name)
    if path and not any(isinstance(h, _CrashRecorder) for h in logger.handlers):
        logger.addHandler(_CrashRecorder(path))


def death(crash: EngineCrash | None, up_since: float, requests: list[str]) -> EngineDeath:
    """An EngineDeath now, for an engine up since `up_since` (time.monotonic) with `requests` in flight."""
    return EngineDeath(crash, time.monotonic() - up_since, requests[:8], len(requests), time.time())
