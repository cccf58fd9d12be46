"""`raytool chaos`: a training run while its own actors' processes are killed (SIGKILL) or hung
(SIGSTOP) on a schedule, then the checks of `raytool.chaos.check_run` and what was left behind.

Faults reach processes on this machine (the kinds of `raytool.chaos.KINDS`; a trainer rank hit
re-forms the trainer group from the last checkpoint, so give the run `trainer.save_every`). The run
is the ordinary `actors.drivers.pipeline.run` with a known Ray namespace, so the injector finds exactly this
run's actors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import msgspec
import psutil
import ray

from actors.common import actors_left, live_actors
from raytool.chaos import KINDS, Schedule, check_run
from raytool.config import RunConfig

log = logging.getLogger(__name__)

UNLIMITED = 1 << 30  # trainer.max_failures of a chaos run


class Injector(threading.Thread):
    """Every `every_s` seconds, one fault per the schedule on a live process of the run's namespace.
    `steps_log` (metrics.jsonl): at most one fault per logged step, `every_s` after it; `max_faults`:
    then none."""

    def __init__(self, namespace: str, schedule: Schedule, every_s: float, steps_log: Path | None = None, max_faults: int | None = None):
        super().__init__(name="raytool-chaos", daemon=True)
        self.namespace, self.schedule, self.every_s = namespace, schedule, every_s
        self.steps_log, self.max_faults = steps_log, max_faults
        self.faults: list[dict] = []
        self.done = threading.Event()

    def _steps(self) -> int:
        return len(self.steps_log.read_text().splitlines()) if self.steps_log.is_file() else 0

    def _next_step(self) -> bool:
        """Wait for one more logged step than at the last fault -> False once the run is done."""
        seen = self.faults[-1]["steps"] if self.faults else -1
        while self._steps() <= seen:
            if self.done.wait(0.5):
                return False
        return True

    def run(self) -> None:
        self._wait_for_the_run()
        while self.max_faults is None or len(self.faults) < self.max_faults:
            if self.steps_log is not None and not self._next_step():
                return
            if self.done.wait(self.every_s):
                return
            kind, how = self.schedule.next()
            try:
                pid = self._victim(kind)
            except Exception as exc:  # the state API can be slow under load: try again at the next tick
                log.warning("chaos: no %s found this time: %s", kind, exc)
                pid = None
            if pid is None:
                self.schedule.hits[kind] -= 1  # not hit: it stays due
                continue
            os.kill(pid, signal.SIGSTOP if how == "stop" else signal.SIGKILL)
            self.faults.append({"t": time.time(), "kind": kind, "how": how, "pid": pid, "steps": self._steps() if self.steps_log else 0})
            log.warning("chaos: %s %s (pid %d)", "stopped" if how == "stop" else "killed", kind, pid)

    def _wait_for_the_run(self) -> None:
        """Faults start once the run's actors are all up (its trainer is the last to start): a
        fault while the actor graph is being built stops the run with that actor named instead."""
        while not self.done.wait(1.0):
            if not ray.is_initialized():
                continue
            with contextlib.suppress(Exception):  # the state API can lag while the cluster starts
                if live_actors(self.namespace, "TrainerWorker"):
                    return

    def _victim(self, kind: str) -> int | None:
        alive = live_actors(self.namespace, KINDS[kind])
        pids = sorted(a.pid for a in alive)
        if not pids:
            return None
        pid = self.schedule.rng.choice(pids)
        if kind != "engine":
            return pid
        cores = [c for c in psutil.Process(pid).children(recursive=True) if "EngineCore" in c.name()]  # VLLM::EngineCore
        return cores[0].pid if cores else None


def run_chaos(cfg: RunConfig, run_dir: str | Path | None, kinds: list[str], every_s: float, hang: bool, seed: int,
              per_step: bool = False, max_faults: int | None = None) -> dict:
    """Train per `cfg` under faults -> the report: faults by kind, the checks, steps, wall time.
    `per_step`: at most one fault per step (`every_s` after it is logged); `max_faults`: then stop."""
    from actors.drivers.pipeline import run
    from actors.drivers.session import default_run_dir
    from raytool.engines.vllm_engine import unlink_orphaned_segments

    namespace = f"raytool-chaos-{uuid.uuid4().hex[:6]}"
    # The faults are the schedule's own: no restart budget runs out under them (a real run stops in
    # one line when one does: actors.drivers.watchdog, trainer.max_failures).
    cfg = msgspec.structs.replace(cfg, cluster=msgspec.structs.replace(cfg.cluster, namespace=namespace, max_actor_restarts=-1),
                                  rollout=msgspec.structs.replace(cfg.rollout, max_restarts=-1),
                                  trainer=msgspec.structs.replace(cfg.trainer, max_failures=UNLIMITED))
    run_dir = Path(run_dir) if run_dir else default_run_dir()
    injector = Injector(namespace, Schedule(kinds, hang, seed), every_s, run_dir / "metrics.jsonl" if per_step else None, max_faults)
    injector.start()
    start = time.monotonic()
    error = None
    try:
        run(cfg, run_dir)
    except Exception as exc:  # the run itself failing is the finding: reported, with the checks
        error = f"{type(exc).__name__}: {exc}"
    finally:
        injector.done.set()
        injector.join(timeout=30)
    wall = time.monotonic() - start
    report = {"faults": len(injector.faults), "fault_log": injector.faults, "by_kind": {k: sum(f["kind"] == k for f in injector.faults) for k in kinds},
              "stopped": sum(f["how"] == "stop" for f in injector.faults), "wall_s": round(wall, 1), "run_error": error,
              **check_run(run_dir, cfg.trainer.total_steps)}
    report["actors_left"] = len(actors_left(namespace))
    report["shm_segments_left"] = len(unlink_orphaned_segments(min_age_s=5))
    report["ok"] = (error is None and report["every_step_logged"] and report["versions_monotone"] and report["ledger_reconciles"]
                    and report["actors_left"] == 0)
    report["run_dir"] = str(run_dir)
    return report


def table(report: dict) -> str:
    rows = [("faults injected", f"{report['faults']} ({report['stopped']} stopped, the rest killed)"),
            ("at steps", ", ".join(f"{f['kind']}@{f['steps']}" for f in report.get("fault_log", []))),
            *((f"  {kind}", str(n)) for kind, n in report["by_kind"].items()),
            ("steps done", str(report["steps"])), ("wall time", f"{report['wall_s']:.0f} s"),
            ("groups retried / failed", f"{report['groups_retried']} / {report['groups_failed']}"),
            ("every step logged", str(report["every_step_logged"])), ("versions monotone", str(report["versions_monotone"])),
            ("ledger reconciles", str(report["ledger_reconciles"]) + (f" ({report['ledger']})" if report.get("ledger") else "")),
            ("trajectories lost", str(report.get("lost", "unknown"))), ("actors left", str(report["actors_left"])),
            ("shm segments left (removed)", str(report["shm_segments_left"])), ("run error", str(report["run_error"])),
            ("ok", str(report["ok"]))]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
