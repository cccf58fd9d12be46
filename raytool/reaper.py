"""The reaper: a small process that outlives a driver and kills the local Ray instance it started.

`ray.init()` without an address starts a private Ray instance as the driver's children (GCS,
raylet, dashboard, and the raylet's agents and workers). When the driver exits normally it stops
them; when it is killed (`kill -9`, the OOM killer, a lost SSH session) the GCS and raylet go, but
the raylet's DashboardAgent and RuntimeEnvAgent were found still running 98 s later. So a driver
that starts a local instance (`actors.drivers.pipeline.connect`) also starts `python -m raytool.reaper
PID`: it notes the driver's descendants every `POLL_S`, and once the driver is gone it ends every
one of them still running (SIGTERM, then SIGKILL after `TERM_WAIT_S`). A process is matched by pid
and start time, so a pid the system reused is never touched. Plain Python (psutil), no Ray.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

POLL_S = 0.5
TERM_WAIT_S = 5.0


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def watch(driver_pid: int, poll_s: float = POLL_S) -> list[int]:
    """Block until `driver_pid` is gone, then end the descendants it had -> the pids ended."""
    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        return []
    seen: dict[int, psutil.Process] = {}
    while _alive(driver):
        try:
            for child in driver.children(recursive=True):
                if child.pid != os.getpid():
                    seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            break
        time.sleep(poll_s)
    left = [p for p in seen.values() if _alive(p)]  # psutil.Process checks the start time: a reused pid is not ours
    for p in left:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, still = psutil.wait_procs(left, timeout=TERM_WAIT_S)
    for p in still:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in left]


def start_for(driver_pid: int) -> subprocess.Popen:
    """Start a reaper for `driver_pid`, detached from the driver's session and streams (it must
    neither die with the driver's process group nor hold a pipe someone reads the driver's output from)."""
    return subprocess.Popen([sys.executable, "-m", "raytool.reaper", str(driver_pid)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)


if __name__ == "__main__":
    watch(int(sys.argv[1]))
