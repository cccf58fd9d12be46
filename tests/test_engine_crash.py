"""The repeated-crash rule (raytool.engines.crash), without Ray: which engine deaths are restarted
and which stop the run, the crash record an engine's child process leaves, a poisoned scripted
engine driven through restarts the way a RolloutServer drives it, and the reaper that ends an
engine's processes when its server is killed."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import subprocess
import sys
import time

import pytest

from raytool.engines.crash import (
    CRASH_FILE_ENV, REPEAT_WINDOW_S, EngineCrash, EngineDeath, death, install_crash_recorder, read_crash, repeats, verdict,
)
from raytool.types import SamplingParams

OFFSET = EngineCrash("RuntimeError", "CPU Generator does not use offset", "Traceback ...", "VllmWorker-0 pid=1")


def _death(crash: EngineCrash | None, uptime_s: float = 5.0, in_flight: int = 3) -> EngineDeath:
    return EngineDeath(crash, uptime_s, [f"g{i}-0@t0" for i in range(in_flight)], in_flight)


@pytest.mark.parametrize("previous, current, stop", [
    (None, _death(OFFSET), False),  # a first death is always restarted
    (_death(OFFSET), _death(OFFSET), True),  # the same error with requests in flight both times
    (_death(OFFSET, in_flight=0), _death(OFFSET, uptime_s=30.0, in_flight=0), True),  # idle, but right after the restart
    (_death(OFFSET, in_flight=0), _death(OFFSET, uptime_s=REPEAT_WINDOW_S + 1, in_flight=0), False),  # idle and long after
    (_death(OFFSET), _death(EngineCrash("RuntimeError", "another message")), False),  # another error
    (_death(OFFSET), _death(EngineCrash("ValueError", OFFSET.message)), False),  # another type
    (_death(None), _death(None), False),  # killed twice (SIGKILL, the kernel's OOM killer): nothing known, restarted
    (_death(OFFSET), _death(None), False),
    (_death(EngineCrash("OutOfMemoryError", "CUDA out of memory")), _death(EngineCrash("OutOfMemoryError", "CUDA out of memory")), False),
    (_death(EngineCrash("RuntimeError", "CUDA error: out of memory")), _death(EngineCrash("RuntimeError", "CUDA error: out of memory")), False),
])
def test_only_the_same_known_error_again_with_work_in_flight_or_right_after_a_restart_stops(previous, current, stop):
    assert repeats(previous, current) is stop


def test_the_verdict_names_the_role_the_engines_error_where_it_was_raised_and_the_requests():
    line = verdict("rollout-server-0", _death(OFFSET, in_flight=26))
    assert "\n" not in line
    assert line.startswith("rollout-server-0: its engine died again right after a restart with the same error")
    assert "VllmWorker-0 pid=1: RuntimeError: CPU Generator does not use offset" in line
    assert "26 request(s) in flight, e.g. g0-0@t0, g1-0@t0, g2-0@t0;" in line and "run.log" in line


def test_a_child_process_records_the_first_exception_its_logger_reports(tmp_path, monkeypatch):
    path = tmp_path / "crash.json"
    monkeypatch.setenv(CRASH_FILE_ENV, str(path))
    logger = logging.getLogger("raytool-test-engine")
    install_crash_recorder("raytool-test-engine")
    install_crash_recorder("raytool-test-engine")  # once per logger
    try:
        assert read_crash(path) is None
        logger.error("no exception attached: not a crash")
        assert read_crash(path) is None
        for message in ("CPU Generator does not use offset", "a later report of the same failure"):
            try:
                raise RuntimeError(message)
            except RuntimeError:
                logger.exception("WorkerProc hit an exception.")
        crash = read_crash(path)
        assert (crash.type, crash.message) == ("RuntimeError", "CPU Generator does not use offset")  # the first, the cause
        assert "Traceback" in crash.traceback and "pid=" in crash.process
        assert len([h for h in logger.handlers if type(h).__name__ == "_CrashRecorder"]) == 1
    finally:
        logger.handlers.clear()
    path.write_bytes(b'{"type": "Runt')  # a process killed mid-write
    assert read_crash(path) is None and read_crash(None) is None and read_crash(tmp_path / "absent") is None


def test_a_poisoned_scripted_engine_is_restarted_once_then_stops_with_its_own_error(tiny_model_path):
    """The RolloutServer's loop without Ray: start an engine, send work, on a death record it and
    compare with the last; a restart builds a fresh engine that crashes the same way."""
    from raytool.engines.scripted import ScriptedEngine

    journal: dict[str, EngineDeath] = {}
    restarts = 0
    while True:
        engine = ScriptedEngine(tiny_model_path, delay_s=0.0, crash_with="RuntimeError: poisoned on purpose")
        assert not engine.dead() and engine.crash() is None
        with pytest.raises(RuntimeError, match="poisoned"):
            asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_tokens=4), "g0-1@t0"))
        assert engine.dead()
        now = death(engine.crash(), up_since=0.0, requests=["g0-1@t0"])
        if repeats(journal.get("rollout-server-0"), now):
            break
        journal["rollout-server-0"] = now
        restarts += 1
        assert restarts < 10, "a crash that repeats was restarted again and again"
    assert restarts == 1
    assert "RuntimeError: poisoned on purpose" in verdict("rollout-server-0", now)


def _server(conn) -> None:
    """A stand-in for a rollout server process: it starts a child (as AsyncLLM starts vLLM's engine
    core) and, as VLLMEngine does before that, the reaper for itself; then it waits to be killed."""
    from raytool.engines.vllm_engine import start_reaper

    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    watcher = start_reaper()
    conn.send((core.pid, watcher.pid))
    time.sleep(600)


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_killed_servers_engine_processes_are_ended_by_its_reaper():
    """SIGKILL a process that started a child and VLLMEngine's reaper (the engine core of a server
    Ray killed would otherwise keep running and keep its GPU memory): the child is ended within
    seconds, and the reaper exits after it."""
    import psutil

    ctx = multiprocessing.get_context("fork")  # pytest's imports are there already: no 4 s import of torch again
    ours, theirs = ctx.Pipe()
    server = ctx.Process(target=_server, args=(theirs,), daemon=True)
    server.start()
    core, watcher = ours.recv()
    try:
        deadline = time.monotonic() + 30
        while "raytool.reaper" not in " ".join(psutil.Process(watcher).cmdline()):  # empty for a moment after the exec
            assert time.monotonic() < deadline, "the reaper did not start"
            time.sleep(0.05)
        time.sleep(1.5)  # its first looks at the server's children (every 0.5 s): the child was there before it
        server.kill()
        server.join(10)
        deadline = time.monotonic() + 15  # a look (0.5 s), then SIGTERM ends a sleeping child at once
        while not (_gone(core) and _gone(watcher)):
            assert time.monotonic() < deadline, f"left running: child {not _gone(core)}, reaper {not _gone(watcher)}"
            time.sleep(0.1)
    finally:
        for pid in (core, watcher):
            if not _gone(pid):
                psutil.Process(pid).kill()
        ours.close()
