"""A reward fn for the fault tests that fails on a script, counted across processes with files in
$RAYTOOL_FAULT_DIR: its 1st call kills the reward worker's own process (SIGKILL; Ray restarts it),
its 2nd raises, its 5th holds for a few seconds (writing `holding`, so a test can kill the agent
workers while groups are in flight); every other call scores the answer's length parity."""

import os
import signal
import time
from pathlib import Path


def _call_number() -> int:
    directory = Path(os.environ["RAYTOOL_FAULT_DIR"])
    n = 1
    while True:
        try:
            (directory / f"call-{n}").touch(exist_ok=False)  # atomic: each call gets its own number
            return n
        except FileExistsError:
            n += 1


def score(view: dict, ground_truth: str, extra: dict) -> float:
    n = _call_number()
    if n == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if n == 2:
        raise ValueError("scripted failure of the reward fn")
    if n == 5:
        (Path(os.environ["RAYTOOL_FAULT_DIR"]) / "holding").touch()
        time.sleep(4)
    return float(len(view["response"]) % 2)
