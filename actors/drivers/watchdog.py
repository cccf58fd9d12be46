"""Heartbeats: a hung actor process (stopped, deadlocked, its node gone quiet) is found and handled
like a kill, so that no call waits on it forever.

The driver pings every light actor and rollout server (`__ray_call__` asking its process id,
answered by the actor's event loop even while it works) every `cluster.heartbeat_s`; an actor that
Ray reports alive, that was running before the ping went out (`actors.common.Liveness`) and that
has not answered by the next beat is killed with a restart, and its callers' failure handling
takes over (groups rolled out again, scoring retried, a server re-synced). A hang is therefore
found within twice the interval (three times for a process that has not answered yet). Trainer
ranks are watched where the driver waits on them (`actors.trainer.TrainerGroup.gather`, the same
deadline): a rank that hangs or dies re-forms the trainer group from its last checkpoint.

An actor that died for good (Ray used up its restarts) is remembered with its cause; `check()`,
which the driver calls while it waits, then stops the run in one line naming the actor and the
config key of its restart budget, instead of leaving requests to wait for a server that never
comes back. A rollout server whose engine crashed again as before (`actors.deaths`) stops the run
at the next `check()`, with the engine's own error, and its traceback goes to the driver's log.
"""

from __future__ import annotations

import logging
import threading

import ray
from ray.util.state import get_actor

from actors import deaths
from actors.common import Liveness, alive_pid, process_id
from raytool.errors import RaytoolError

log = logging.getLogger(__name__)


class ActorLostError(RaytoolError):
    """An actor of the run is dead for good: Ray used up its restarts."""


def restart_key(name: str) -> str:
    return "rollout.max_restarts" if name.startswith("rollout-server") else "cluster.max_actor_restarts"


class Watchdog:
    def __init__(self, actors: dict, interval_s: float):
        self.actors = actors  # role name -> actor handle
        self.interval_s = interval_s
        self.killed: list[str] = []  # role names, in the order they were found hung
        self.lost: dict[str, str] = {}  # role name -> the line that ends the run: why it is dead for good
        self._killed_pids: set[int] = set()  # a stopped process can take Ray a few seconds to kill: once is enough
        self.liveness = Liveness()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raytool-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        if self.interval_s > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
            except Exception as exc:  # the watchdog must not end the run; it says what went wrong
                log.warning("watchdog: a heartbeat round failed: %s", exc)

    def beat(self) -> list[str]:
        """One round: ping every actor, wait one interval, kill those alive but silent -> their names."""
        pings = {actor.__ray_call__.remote(process_id): name for name, actor in self.actors.items()}
        answered, late = ray.wait(list(pings), num_returns=len(pings), timeout=self.interval_s)
        for ref in answered:
            try:
                self.liveness.answered(pings[ref], ray.get(ref))
            except ray.exceptions.ActorDiedError:  # restarting answers ActorUnavailableError: only a death can be final
                self._note_if_lost(pings[ref])
            except ray.exceptions.RayActorError:
                continue  # being restarted (ActorUnavailableError): nothing to do until it is back
        hung = []
        for ref in late:
            name = pings[ref]
            pid = alive_pid(self.actors[name])
            if pid in self._killed_pids or not self.liveness.hung(name, pid):
                continue
            log.warning("watchdog: %s (pid %d) did not answer a heartbeat within cluster.heartbeat_s=%gs (a hung process, or one "
                        "that just died); killing it so that Ray restarts it", name, pid, self.interval_s)
            ray.kill(self.actors[name], no_restart=False)
            self._killed_pids.add(pid)
            self.killed.append(name)
            hung.append(name)
        self._stop.wait(max(0.0, self.interval_s - 0.01) if not late else 0.0)
        return hung

    def check(self) -> None:
        """Raise ActorLostError for the first actor found dead for good, or rollout server stopped
        for a crash that repeats."""
        for name, actor in self.actors.items():
            if name.startswith("rollout-server") and name not in self.lost:
                self._note_if_stopped(name, actor._actor_id.hex())
        for line in list(self.lost.values()):  # the watchdog's thread adds to it
            raise ActorLostError(line)

    def _note_if_stopped(self, name: str, actor_id: str) -> bool:
        """A server that exited for good because its engine crashed again as before: its line, and
        the engine's traceback into this (the driver's) log."""
        line = deaths.stopped(actor_id)
        if line is None:
            return False
        last = deaths.last_death(actor_id)
        self.lost[name] = line
        log.error("%s\n%s", line, last.crash.traceback if last is not None and last.crash is not None else "")
        return True

    def _note_if_lost(self, name: str) -> None:
        actor_id = self.actors[name]._actor_id.hex()
        if name in self.lost or self._note_if_stopped(name, actor_id):
            return
        state = get_actor(actor_id, address=ray.get_runtime_context().gcs_address, timeout=10)
        if state is not None and state.state == "DEAD":
            context = (state.death_cause or {}).get("actor_died_error_context", {})
            cause = (context.get("error_message") or "unknown").splitlines()[0][:300]
            self.lost[name] = (f"{name} is dead for good: Ray used up its restarts ({restart_key(name)}); last cause: {cause} "
                               f"(restarted {state.num_restarts} times)")
            log.error("watchdog: %s", self.lost[name])
