"""What every actor is started with: quiet library logging, offline hub, and sized resources; and
how a caller waits for an actor Ray is restarting."""

from __future__ import annotations

import asyncio
import os
import time

import ray

ACTOR_ENV = {
    "HF_HUB_OFFLINE": "1",  # weights never come from a hub at run time
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # no weight-loading bars from every actor in the driver log
    "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),  # no per-sync INFO lines from vLLM
    # vLLM logs to stdout by default, and Ray forwards actors' stdout to the driver's: the engine's
    # shutdown warnings would land after a command's last-line JSON (`raytool eval/bench --json`).
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
}


# Ascend collectives: HCCL's default 120 s connect timeout is shorter than a large model's load on
# a busy node; cluster.env_vars overrides it (and adds HCCL_IF_IP / HCCL_SOCKET_IFNAME for your network).
# Ascend actors. VLLM_ASCEND_ENABLE_NZ=0: vllm-ascend may otherwise keep linear weights in the
# FRACTAL_NZ layout, into which a weight sync's plain tensors would be written unconverted (verl
# requires the same for RL weight updates); raytool.config refuses another value in cluster.env_vars.
NPU_ENV = {"HCCL_CONNECT_TIMEOUT": "1800", "VLLM_ASCEND_ENABLE_NZ": "0"}


def actor_options(num_cpus: float = 0.0, num_gpus: float = 0.0, accelerator: str = "GPU", env: dict | None = None, **extra) -> dict:
    """Ray options for an actor: explicit resources (Ray's default of 1 CPU starves a 2-core machine).
    `num_gpus` counts `accelerator`s: Ray's GPUs, or the custom NPU resource of Ascend nodes (Ray then
    sets ASCEND_RT_VISIBLE_DEVICES to the NPUs it assigned). `env`: more environment variables."""
    resources = dict(extra.pop("resources", None) or {})
    env_vars = {**ACTOR_ENV, **(NPU_ENV if accelerator == "NPU" and num_gpus else {}), **(env or {})}
    options = {"num_cpus": num_cpus, "runtime_env": {"env_vars": env_vars}, **extra}
    if num_gpus and accelerator == "GPU":
        options["num_gpus"] = num_gpus
    elif num_gpus:
        resources[accelerator] = resources.get(accelerator, 0.0) + num_gpus
    if resources:
        options["resources"] = resources
    return options


# How long a caller waits for an actor Ray restarts after its process died (a light actor's
# constructor: a tokenizer load, a sandbox pool's warm sessions).
RESTART_WAIT_S = 120.0
_RESTARTING = (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError)


def wait_until_alive(actor, timeout_s: float = RESTART_WAIT_S) -> bool:
    """Block until `actor` answers again -> True; False once it is dead for good (its restarts used
    up) or `timeout_s` ran out. While Ray restarts an actor, calls to it fail at once
    (ActorUnavailableError) instead of waiting, so a retry sent without this would be spent at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
            return True
        except ray.exceptions.ActorDiedError:
            return False
        except _RESTARTING:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


async def until_alive(actor, timeout_s: float = RESTART_WAIT_S) -> bool:
    """`wait_until_alive` for callers inside an asyncio actor (the event loop keeps running)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await asyncio.wait_for(actor.__ray_ready__.remote(), max(0.1, deadline - time.monotonic()))
            return True
        except ray.exceptions.ActorDiedError:
            return False
        except (ray.exceptions.ActorUnavailableError, asyncio.TimeoutError):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.2)


def named(actors, namespace: str | None):
    """Actor handles from `actors`: a handle, a name, or a list of either (names are looked up in
    `namespace`). Actors that other actors' constructors need are passed by name: Ray keeps a
    constructor argument holding the handle of an actor still being created in the object store,
    where a restart of the receiving actor may not find it again (ray-project/ray#53727)."""
    if isinstance(actors, list):
        return [named(a, namespace) for a in actors]
    return ray.get_actor(actors, namespace=namespace) if isinstance(actors, str) else actors


def alive_pid(actor) -> int | None:
    """Its process id while Ray holds it as running; None while it is being created or restarted
    (a constructor such as an engine start may legitimately keep it silent) or is dead."""
    from ray.util.state import get_actor

    # The state API's own guess of the cluster is the last one any `ray start` on this machine
    # wrote down, not necessarily ours: name ours.
    state = get_actor(actor._actor_id.hex(), address=ray.get_runtime_context().gcs_address, timeout=10)
    return state.pid if state is not None and state.state == "ALIVE" else None


def live_actors(namespace: str, class_name: str | None = None, timeout: int = 10) -> list:
    """The state API's records of `namespace`'s live actors (of one class, if named), asked of the
    cluster this process is connected to: without an address Ray would pick one machine-wide
    (/tmp/ray/ray_current_cluster, the last one started here)."""
    from ray.util.state import list_actors

    filters = [("state", "=", "ALIVE"), ("ray_namespace", "=", namespace)] + ([("class_name", "=", class_name)] if class_name else [])
    return list_actors(filters=filters, address=ray.get_runtime_context().gcs_address, limit=10_000, timeout=timeout)


def actors_left(namespace: str, wait_s: float = 30.0) -> list[str]:
    """The classes of `namespace`'s actors still alive after a run's shutdown or failed start
    (ray.kill is asynchronous: they get up to `wait_s` to go)."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = live_actors(namespace)
        if not alive or time.monotonic() > deadline:
            return [a.class_name for a in alive]
        time.sleep(0.5)


def process_id(_actor) -> int:
    """What a heartbeat asks an actor (`actor.__ray_call__.remote(process_id)`): its process id."""
    return os.getpid()


class Liveness:
    """Which late heartbeat means a hung process. A ping sent while the actor is still being created
    waits behind its constructor, and Ray may report it running just as that ping's interval ends:
    late, but never silent for a whole interval. So a late actor is hung only when the process Ray
    holds as running (its pid) was known to run before the ping went out: it answered an earlier
    ping, or it was running and late in the previous round."""

    def __init__(self):
        self._answered: dict[str, int] = {}  # role -> the pid that answered a heartbeat
        self._late: dict[str, int] = {}  # role -> the pid found running but late last round

    def answered(self, name: str, pid: int) -> None:
        self._answered[name] = pid
        self._late.pop(name, None)

    def hung(self, name: str, pid: int | None) -> bool:
        """`name`'s ping was late and Ray holds process `pid` as running (None: not running)."""
        if pid is None:
            self._late.pop(name, None)
            return False
        if pid in (self._answered.get(name), self._late.get(name)):
            return True
        self._late[name] = pid  # it started during this round: one more interval to answer
        return False
