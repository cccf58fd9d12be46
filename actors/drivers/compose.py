"""Build the actor graph from a config: the public programmatic API.

    import ray
    from raytool.config import load_config
    from actors.drivers.compose import build

    ray.init()
    graph = build(load_config(overrides=["model.path=tiny-random"]))
    stats, groups = graph.rollout(prompt_rows)    # ray.get(groups[0].trajectories); or call any actor yourself:
    out = ray.get(graph.manager.generate.remote(ids, SamplingParams(max_tokens=8), "req-0"))
    graph.shutdown()
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import ray
from tqdm import tqdm

from actors.agent_worker import AgentLoopWorker
from actors.gateway import GatewayActor
from actors.common import RESTART_WAIT_S, actor_options, wait_until_alive
from actors.drivers.watchdog import Watchdog
from actors.llm_manager import LLMManager
from actors.reward_worker import RewardWorker
from actors.rollout_server import RolloutServer
from actors.sandbox_pool import SandboxPool
from actors.trainer import TrainerGroup
from raytool.config import RunConfig, sandbox_backend_options
from raytool.controlplane import SyncPlan, SyncResult
from raytool.engines import EngineOptions
from raytool.data.prompts import PromptRow, with_system_prompt
from raytool.distill import teacher_run
from raytool.tools.registry import row_tool_names
from raytool import placement
from raytool.device import torch_threads
from raytool.errors import ActorStartError, RaytoolError, one_line, start_failure
from raytool.models import resolve_model
from raytool.overload import AdmissionWindow
from raytool.resolve import resolve
from raytool.streaming import GroupFailed, GroupRefs, GroupRetries, TrajectoryStats
from raytool.weightsync import ServerSyncFailure, WeightSyncError, chain_culprits

log = logging.getLogger(__name__)

MANAGER_CALL_ATTEMPTS = 5  # the driver's calls to an LLM manager that keeps dying
ACK_GRACE_S = 30.0  # beyond a weight sync's own timeout, how long the driver waits for a server's ack


@dataclass
class Graph:
    cfg: RunConfig
    model_path: str
    servers: dict  # name -> RolloutServer
    manager: object  # LLMManager
    sandbox_pools: list  # SandboxPool actors; a trajectory's cells go to one of them by session
    reward_workers: list
    agent_workers: list
    trainer: TrainerGroup | None
    namespace: str = ""  # the Ray namespace its named actors live in
    watchdog: object = None  # the run's actors.drivers.watchdog.Watchdog, if one watches them
    gateway: object = None  # agent.gateway: the GatewayActor serving the OpenAI API over the manager
    gateway_url: str = ""
    teacher_servers: dict = field(default_factory=dict)  # distill.teacher: name -> RolloutServer of the teacher (never weight-synced)
    teacher_manager: object = None  # and their control plane (an LLMManager)
    _next_worker: itertools.cycle = field(init=False, repr=False)

    _group_worker: dict = field(init=False, repr=False, default_factory=dict)  # stats ref of a running group -> its agent worker

    def __post_init__(self):
        self._next_worker = itertools.cycle(self.agent_workers)

    def submit_group(self, row: PromptRow, group_id: str, n: int | None = None, sampling: dict | None = None, attempt: int = 0,
                     teach: bool = True):
        """Start one GRPO group (n samples of the row, rollout.n by default) on the next agent worker
        -> (its outputs' refs: GroupRefs, its stats' ref). `sampling`: rollout keys to override, e.g. {"temperature": 1.0};
        `attempt`: the group's earlier rollouts (a retry after an infrastructure failure goes to
        another worker where there is one); `teach`: with distill.teacher, have the teacher score its
        tokens (not for validation, which trains on nothing)."""
        worker = next(self._next_worker)
        messages = with_system_prompt(row.prompt, self.cfg.agent.system_prompt)
        extra = {"data_source": row.data_source, "extra_info": row.extra_info, "tools": row_tool_names(row.tools),
                 "ground_truth_json": row.ground_truth_json}
        trajectories, stats, sequences = worker.run_group.remote(messages, row.ground_truth, group_id, n or self.cfg.rollout.n, row.agent_name,
                                                                 extra, sampling, attempt, teach)
        self._group_worker[stats] = worker
        return GroupRefs(trajectories, sequences), stats

    def group_result(self, stats_ref) -> list[TrajectoryStats] | GroupFailed:
        """A finished group's stats, or GroupFailed with the cause when its agent worker died (or
        raised) instead of returning them. A worker that died is waited for while Ray restarts it,
        so the group's retry is not spent on a worker that refuses calls until it is back."""
        worker = self._group_worker.pop(stats_ref, None)
        try:
            return ray.get(stats_ref)
        except ray.exceptions.RayError as exc:
            if isinstance(exc, ray.exceptions.RayActorError) and worker is not None:
                wait_until_alive(worker)
            return GroupFailed(one_line(exc))

    def rollout(self, rows: list[PromptRow], prefix: str = "g", progress: str | None = None, n: int | None = None,
                sampling: dict | None = None, window: AdmissionWindow | None = None,
                retries: GroupRetries | None = None, teach: bool = True) -> tuple[list[TrajectoryStats], list]:
        """Roll out every prompt row n times (rollout.n by default); returns (per-trajectory stats,
        with the index of their group, and the GroupRefs of each row). The trajectories and what
        the trainer trains on of them stay in the object store until someone asks. `progress`: the label of a progress bar on stderr (None: no bar).
        A group hit by an infrastructure failure (its agent worker died, a sandbox or engine failed)
        is rolled out again with the same seeds, up to rollout.max_group_retries times; a group
        whose worker still dies is an error naming it, one whose infrastructure still fails is kept
        (the retry policy and its budget are the training stream's: raytool.streaming.GroupRetries).
        Groups start as the admission window has room (back-pressure from a slow stage), not all at once.
        `window`, `retries`: the caller's own, to read afterwards (benches); else the run's. `teach`: see submit_group."""
        n = n or self.cfg.rollout.n
        window = window or self.admission_window(n)
        retries = retries or GroupRetries(self.cfg.rollout.max_group_retries, self.cfg.rollout.retry_budget)
        retries.started += len(rows)
        refs: list = [None] * len(rows)
        stats: list = [None] * len(rows)
        attempts = [0] * len(rows)
        pending: dict = {}  # stats ref -> row index
        waiting = list(range(len(rows)))  # rows not yet started (back-pressure: raytool.overload.AdmissionWindow)

        def start(i: int) -> None:
            refs[i] = self.submit_group(rows[i], f"{prefix}{i}", n, sampling, attempt=attempts[i], teach=teach)
            pending[refs[i][1]] = i

        with tqdm(total=len(rows) * n, desc=progress, unit="traj", disable=progress is None, leave=False) as bar:
            while pending or waiting:
                for _ in range(window.admit(len(pending), len(waiting))):
                    start(waiting.pop(0))
                ready, _ = ray.wait(list(pending), num_returns=1)
                i = pending.pop(ready[0])
                result = self.group_result(ready[0])
                window.finished([] if isinstance(result, GroupFailed) else [s.stages for s in result], len(pending))
                verdict, cause = retries.verdict(attempts[i], result)
                if verdict == "retry":
                    retries.log_retry(f"{prefix}{i}", attempts[i], cause)
                    attempts[i] += 1
                    waiting.insert(0, i)
                    continue
                if isinstance(result, GroupFailed):
                    raise RaytoolError(f"group {prefix}{i} failed {attempts[i] + 1} times (rollout.max_group_retries={retries.max_retries}): {cause}")
                stats[i] = result
                bar.update(n)
        return [msgspec.structs.replace(x, group=g) for g, group in enumerate(stats) for x in group], [t for t, _ in refs]

    def admission_window(self, n: int | None = None) -> AdmissionWindow:
        """The groups of `n` samples (rollout.n) that may be in flight at once: at most what the agent
        workers run at once, fewer while a stage downstream holds groups up (raytool.overload)."""
        slots = len(self.agent_workers) * self.cfg.agent.max_concurrent_trajectories
        return AdmissionWindow(max(1, slots // (n or self.cfg.rollout.n)))

    def ask_manager(self, method: str, *args):
        """Call the LLM manager and wait for the answer; a manager that died is waited for while Ray
        restarts it (it rebuilds its state from the servers) and asked again, up to
        MANAGER_CALL_ATTEMPTS times (it may die again while it comes back)."""
        for attempt in range(MANAGER_CALL_ATTEMPTS):
            try:
                return ray.get(getattr(self.manager, method).remote(*args))
            except ray.exceptions.RayActorError:
                if attempt == MANAGER_CALL_ATTEMPTS - 1 or not wait_until_alive(self.manager):
                    raise

    def policy_version(self) -> int:
        """The version of the weights the servers should hold (the control plane's: the last sync's)."""
        return self.ask_manager("policy_version")

    def publish_weights(self, timeout_s: float | None = None) -> SyncResult:
        """The trainer's new weights, as the next policy version, to every healthy rollout server
        (and to recovered ones that wait for current weights): see `sync`."""
        return self.sync(self.ask_manager("plan_sync"), timeout_s)

    def resync_stale(self) -> None:
        """Load the current version (the trainer's weights) into the servers Ray restarted (fresh
        engines on the base weights) now, so they serve again within this step: with one server,
        requests wait for it instead of failing. Only while the trainer is not updating."""
        plan = self.ask_manager("plan_resync")
        if plan is not None:
            log.warning("rollout servers %s were restarted (base weights): weight sync v%d to them", sorted(plan.targets), plan.version)
            self.sync(plan)

    def sync_weights(self, version: int, timeout_s: float | None = None) -> SyncResult:
        """The trainer's weights as policy version `version` (a resumed run's) to every healthy server."""
        return self.sync(self.ask_manager("plan_sync", version), timeout_s)

    def sync(self, plan: SyncPlan, timeout_s: float | None = None) -> SyncResult:
        """Stream the trainer's weights to the plan's servers (the control plane's plan: version,
        attempt, targets); returns the version, bytes, seconds, acks and the servers that failed. A
        server that fails its sync is ejected by the control plane; the run goes on without it.

        The buckets travel down a relay chain of the servers' receivers, so one dead server also
        starves the servers after it. Those are synced again at once, in a chain without the
        servers that broke it (a dead actor, or an address a forwarder could not deliver to).
        `timeout_s`: the deadline of each wait (None: trainer.weight_sync_timeout_s)."""
        timeout_s = self.cfg.trainer.weight_sync_timeout_s if timeout_s is None else timeout_s
        current, failed = self._receivers(plan.targets)
        moved = {name: addresses for name, addresses in current.items() if addresses != plan.targets[name]}
        if moved:  # restarted since the control plane last heard of them (before serving a request, say): new ports
            self.ask_manager("set_addresses", moved)
        targets = current
        sent, acks, broken = self._send_and_ack(targets, plan.version, timeout_s, plan.attempt)
        culprits, collateral = chain_culprits(targets, broken)
        if culprits and collateral:
            log.warning("weight sync v%d: %s broke the chain; syncing %s again without them", plan.version, sorted(culprits), sorted(collateral))
            again = self.ask_manager("plan_sync", plan.version, sorted(collateral))
            sent_again, more_acks, broken_again = self._send_and_ack(again.targets, plan.version, timeout_s, again.attempt)
            sent = sent if sent["bytes"] else sent_again
            acks += more_acks
            broken = {name: broken[name] for name in culprits} | broken_again
        failed.update({name: f.reason for name, f in broken.items()})
        hung = sorted(name for name, f in broken.items() if f.hung)
        failed = self.ask_manager("synced", plan.version, [a.server for a in acks], failed, hung, sent.get("attestation"),
                                  {a.server: a.attestation for a in acks})
        return SyncResult(plan.version, sent, [a for a in acks if a.server not in failed], failed)

    def _send_and_ack(self, targets: dict, version: int, timeout_s: float, attempt: int) -> tuple[dict, list, dict]:
        """One pass: every target listens, the trainer sends -> (sender stats, acks, failed server -> ServerSyncFailure).
        `attempt`: the pass's number (a pass of a version after a failed one: receivers drop the first pass's leftovers)."""
        if not targets:  # every server is down or restarting: nothing to send to (they are synced once back)
            return {"bytes": 0, "buckets": 0, "seconds": 0.0}, [], {}
        receiving = {name: self.servers[name].receive_weights.remote(version, timeout_s, attempt) for name in targets}
        addresses = [address for name in targets for address in targets[name]]
        acks, broken = [], {}  # server -> ServerSyncFailure
        try:
            bucket_bytes = self.cfg.trainer.weight_sync_bucket_mb << 20
            sent, *_ = self.trainer.gather(self.trainer.send_weights(addresses, version, bucket_bytes, timeout_s, attempt))
        except ray.exceptions.RayTaskError as exc:  # a receiver did not take a bucket (or its ack never came)
            error = exc.cause if isinstance(exc.cause, WeightSyncError) else None
            named = [name for name in targets if error is not None and set(error.addresses) & set(targets[name])]
            if not named:
                raise
            sent = {"bytes": 0, "buckets": 0, "seconds": 0.0}
            # A receiver that did not ack may be stuck, or starved behind one that is (a collective's
            # broadcast tree): each is judged by its own answer below (an error, or no answer: hung).
            if error.kind != "no_ack" or self.cfg.trainer.weight_sync_backend != "collective":
                broken.update({name: ServerSyncFailure(one_line(exc), True, error) for name in named})
        for name, ref in receiving.items():
            try:
                acks.append(ray.get(ref, timeout=timeout_s + ACK_GRACE_S))
            except ray.exceptions.GetTimeoutError:  # hung in the load: handled like a death (the control plane restarts it, the next sync re-loads it)
                broken[name] = ServerSyncFailure(f"{name} did not ack weight sync v{version} within {timeout_s + ACK_GRACE_S:g}s: "
                                                 "restarted (hung in the load)", True, hung=True)
            except ray.exceptions.RayError as exc:
                cause = getattr(exc, "cause", None)
                broken.setdefault(name, ServerSyncFailure(one_line(exc), isinstance(exc, ray.exceptions.RayActorError),
                                                          cause if isinstance(cause, WeightSyncError) else None))
        return sent, acks, broken

    def _receivers(self, targets: dict, timeout_s: float = 10.0) -> tuple[dict, dict]:
        """-> (server -> the addresses its weight receivers listen on now, server -> why it is left
        out). Asked of the servers at each sync: a server that Ray restarted listens on new ports
        that the manager may not have heard of. A server that died after its last request still
        counts as healthy, and a sync to it would wait for Ray to restart it (an engine start)
        before failing: one that does not answer in time is left out of this sync and ejected."""
        calls = {self.servers[name].receivers.remote(): name for name in targets}
        done, late = ray.wait(list(calls), num_returns=len(calls), timeout=timeout_s)
        failed = {calls[ref]: f"no health answer within {timeout_s:g}s" for ref in late}
        current = {}
        for ref in done:
            try:
                current[calls[ref]] = list(ray.get(ref))
            except ray.exceptions.RayError as exc:
                failed[calls[ref]] = one_line(exc)
        return current, failed

    def check_alive(self) -> None:
        """Raise (one line) if the watchdog found an actor of the graph dead for good."""
        if self.watchdog is not None:
            self.watchdog.check()

    def ready_calls(self) -> dict:
        """Role name -> the call that answers once the actor has started: engines load, sandboxes
        fork their warm sessions, constructors run (the first that fails is named: a bad model
        path, an engine that cannot start, a bad reward fn ...)."""
        ask = {name: srv.ready for name, srv in {**self.servers, **self.teacher_servers}.items()}
        ask |= {f"sandbox-pool-{i}": pool.ready for i, pool in enumerate(self.sandbox_pools)}
        return ask | {name: actor.__ray_ready__ for name, actor in self.light_actors().items() if name not in ask}

    def light_actors(self) -> dict:
        """Role name -> handle of every actor but the trainer's: those the watchdog pings."""
        teacher = {**self.teacher_servers, "teacher-manager": self.teacher_manager} if self.teacher_manager is not None else {}
        return {**self.servers, "llm-manager": self.manager, **teacher, **{f"sandbox-pool-{i}": p for i, p in enumerate(self.sandbox_pools)},
                **{f"reward-worker-{i}": w for i, w in enumerate(self.reward_workers)},
                **{f"agent-worker-{i}": w for i, w in enumerate(self.agent_workers)}}

    def shutdown(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.trainer is not None:
            self.trainer.shutdown()
        # Let engines stop their own processes (vLLM's engine core), and the gateway its HTTP server, before the actors go.
        gateway = [self.gateway] if self.gateway is not None else []
        teacher = [*self.teacher_servers.values(), self.teacher_manager] if self.teacher_manager is not None else []
        stopping = [s.shutdown.remote() for s in [*gateway, *self.servers.values(), *self.sandbox_pools, self.manager, *teacher]]
        ray.wait(stopping, num_returns=len(stopping), timeout=30)
        for actor in [*gateway, *self.agent_workers, *self.reward_workers, *self.sandbox_pools,
                      self.manager, *self.servers.values(), *teacher]:
            ray.kill(actor)


def build(cfg: RunConfig, model_path: str | None = None, with_trainer: bool = True, namespace: str | None = None, watch: bool = False) -> Graph:
    """Start every actor of the run described by `cfg` (ray.init must have run), each named by its
    role (`rollout-server-0`, `llm-manager`, `trainer-0`, ...) in one namespace per run, so the
    dashboard shows who is who. A cluster that can never hold the run is an error before any actor
    starts; an actor that fails to start is reported by role and cause in one line. `watch`: a
    Watchdog (graph.watchdog; stopped by shutdown) heartbeats the actors from the moment they are
    created, so one stopped while the graph starts is killed and restarted instead of waited for."""
    model_path = model_path or resolve_model(cfg.model.path)
    cfg = resolve(cfg)  # a no-op for the resolved config of a run (raytool.resolve)
    wait_for_resources(cfg, skip={"trainer worker"} if not with_trainer else set())
    if with_trainer:
        check_memory(cfg, model_path)
    ns = namespace or cfg.cluster.namespace or run_namespace("raytool")
    log.info("actors in Ray namespace %s", ns)
    graph = start_actors(cfg, model_path, ns)
    actors = graph.light_actors()
    if watch:
        graph.watchdog = Watchdog(actors, cfg.cluster.heartbeat_s).start()
    ask = graph.ready_calls()
    trainer = None
    # Engines and trainer on shares of the same accelerators: vLLM sizes its KV cache from the memory
    # free while it starts, so the trainer loads only after the engines have (else the cache varies
    # run to run, or vLLM's memory check fails as the trainer grows beside it).
    after_engines = with_trainer and placement.shares_accelerators(cfg)
    try:
        # Otherwise the trainer loads its model while the engines start (most of an engine's start is
        # one process importing at a time); it is waited for after them, so a failure of theirs is the
        # one named (a trainer that cannot be placed stops the start here).
        trainer = TrainerGroup(cfg, model_path, namespace=ns, wait=False) if with_trainer and not after_engines else None
        results = wait_started({name: (actors[name], method) for name, method in ask.items()}, max(RESTART_WAIT_S, cfg.rollout.engine_start_timeout_s))
        if after_engines:
            trainer = TrainerGroup(cfg, model_path, namespace=ns, wait=False)
        ray.get(graph.manager.set_addresses.remote({name: results[name] for name in graph.servers}))
        if graph.teacher_manager is not None:
            ray.get(graph.teacher_manager.set_addresses.remote({name: results[name] for name in graph.teacher_servers}))
        # The OpenAI-compatible API over the manager, for agents outside raytool (actors.gateway), and
        # for a judge that is the run's own model (reward.judge.base_url self).
        if cfg.agent.gateway or cfg.reward.judges_itself:
            a = cfg.agent
            graph.gateway = GatewayActor.options(**role_options(cfg, ns)("gateway", cfg.cluster.light_actor_cpus), **light_restarts(cfg)).remote(
                model_path, "llm-manager", list(graph.servers), cfg, ns, a.gateway_host, a.gateway_port)
            graph.gateway_url = wait_started({"gateway": (graph.gateway, graph.gateway.start)})["gateway"]
        if trainer is not None:
            trainer.started()
            graph.cfg = trainer.cfg  # with the trainer's autos decided on its device
        graph.trainer = trainer
    except BaseException:  # nothing of a run that failed to start is left running
        if graph.watchdog is not None:
            graph.watchdog.stop()
        if trainer is not None:
            trainer.shutdown(close=False)
        for actor in [*actors.values(), *([graph.gateway] if graph.gateway is not None else [])]:
            ray.kill(actor)
        raise
    return graph


def role_options(cfg: RunConfig, ns: str):
    """-> options(role name, num_cpus, num_gpus=0, **extra): the Ray options of an actor of this run, named by its role in `ns`."""
    def options(name: str, num_cpus: float, num_gpus: float = 0.0, **extra) -> dict:
        return actor_options(num_cpus, num_gpus, cfg.cluster.accelerator, cfg.cluster.env_vars, name=name, namespace=ns, **extra)

    return options


def light_restarts(cfg: RunConfig) -> dict:
    """A dead LLM manager, agent worker, reward worker, sandbox pool or gateway is restarted by Ray;
    the calls it had in flight fail, and their callers retry once it is back (the stream rolls the
    group out again, the agent worker scores on the next reward worker, a trajectory whose sandbox or
    generate call failed is infra-failed and its group rolled out again)."""
    return {"max_restarts": cfg.cluster.max_actor_restarts, "max_task_retries": 0}


def start_actors(cfg: RunConfig, model_path: str, ns: str) -> Graph:
    """Create every actor of the run but the trainer's, named by role in namespace `ns` (they start
    in the background: `Graph.ready_calls` says when each is up)."""
    light, r, restarts = cfg.cluster.light_actor_cpus, cfg.rollout, light_restarts(cfg)
    options = role_options(cfg, ns)
    servers = rollout_servers(cfg, model_path, options)

    def control_plane(name: str, of: dict):
        return LLMManager.options(**options(name, light), **restarts).remote(
            list(of), namespace=ns, affinity_slack=r.affinity_slack, stall_timeout_s=r.stall_timeout_s, probe_interval_s=r.health_probe_interval_s,
            no_server_wait_s=r.engine_start_timeout_s
        )

    manager = control_plane("llm-manager", servers)
    # distill.teacher: the teacher's own servers and control plane, never weight-synced (raytool.distill)
    teacher_servers = rollout_servers(teacher_run(cfg), resolve_model(cfg.distill.teacher), options, "teacher-server") if cfg.distill.has_servers else {}
    teacher_manager = control_plane("teacher-manager", teacher_servers) if teacher_servers else None
    sandbox_pools = build_sandbox_pools(cfg, options)
    reward_workers = [RewardWorker.options(**options(f"reward-worker-{i}", light), **restarts).remote(cfg.reward, ns) for i in range(cfg.reward.num_workers)]
    agent_workers = [
        AgentLoopWorker.options(**options(f"agent-worker-{i}", light), **restarts).remote(
            model_path, "llm-manager", list(servers), [f"sandbox-pool-{i}" for i in range(len(sandbox_pools))],
            [f"reward-worker-{i}" for i in range(len(reward_workers))], cfg, namespace=ns, role=f"agent-worker-{i}",
            teacher=("teacher-manager", list(teacher_servers)) if teacher_servers else None)
        for i in range(cfg.agent.num_workers)
    ]
    return Graph(cfg, model_path, servers, manager, sandbox_pools, reward_workers, agent_workers, None, ns,
                 teacher_servers=teacher_servers, teacher_manager=teacher_manager)


def run_namespace(name: str) -> str:
    """A fresh Ray namespace for a run called `name`: its actors' names (`llm-manager`, ...) cannot
    collide with another run's, nor with those of a run just ended whose actors Ray is still killing."""
    return f"{name}-{uuid.uuid4().hex[:6]}"


def wait_started(calls: dict, restart_wait_s: float = RESTART_WAIT_S) -> dict:
    """{role name: (actor, its ready method)} -> {role name: result}; the first actor to fail raises
    one line naming its role and cause (the full remote traceback stays on the exception's
    __cause__). One whose process dies while starting is waited for (Ray restarts it) and asked
    again, until its restarts are used up."""
    pending = {method.remote(): name for name, (_, method) in calls.items()}
    results = {}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        name = pending.pop(done[0])
        try:
            results[name] = ray.get(done[0])
        except ray.exceptions.RayActorError as exc:
            actor, method = calls[name]
            if wait_until_alive(actor, restart_wait_s):
                log.warning("%s died while starting (%s); Ray restarted it, waiting for it again", name, one_line(exc))
                pending[method.remote()] = name
                continue
            raise ActorStartError(f"{name} failed to start: {start_failure(exc)}") from exc
        except ray.exceptions.RayError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, RaytoolError):  # already one line that names the part (a rollout server, a sandbox pool)
                raise cause from exc
            raise ActorStartError(f"{name} failed to start: {start_failure(exc)}") from exc
    return results


def wait_for_resources(cfg: RunConfig, skip: set[str] = frozenset(), only: set[str] | None = None) -> None:
    """Stop with one line naming the missing resource when the cluster can never hold the run's
    actors (those of roles in `only`, all by default, minus `skip`); on an autoscaling cluster
    (cluster.wait_for_resources_s > 0) wait that long for nodes first."""
    wanted = [d for d in placement.demands(cfg) if d.role not in skip and (only is None or d.role in only)]
    deadline = time.monotonic() + cfg.cluster.wait_for_resources_s
    while True:
        try:
            return placement.check(wanted, [node["Resources"] for node in ray.nodes() if node.get("Alive")])
        except placement.PlacementError as exc:
            if time.monotonic() >= deadline:
                raise
            log.info("waiting for the cluster to grow: %s", exc)
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))


def check_memory(cfg: RunConfig, model_path: str, with_servers: bool = True) -> None:
    """`raytool plan`'s check against the cluster Ray reports, before any actor starts: one line
    naming the config key when the run cannot fit. Accelerator memory is known only from the
    driver's own accelerator (Ray does not report it); host memory is the smallest node's memory
    and object store as Ray counts them. with_servers=False: the trainer alone (`raytool sft`)."""
    from raytool.planner import DEFAULT_LINK_GBIT, GiB, Cluster, plan

    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    gpus = max((int(node.get(cfg.cluster.accelerator, 0)) for node in nodes), default=0)
    here = Cluster.this_machine()
    host = min((node.get("memory", 0.0) + node.get("object_store_memory", 0.0) for node in nodes), default=0.0) / GiB
    cluster = Cluster(len(nodes), gpus, here.gpu_memory_gb if gpus and here.gpus_per_node else 0.0, host, cfg.cluster.link_gbit or DEFAULT_LINK_GBIT)
    try:
        result = plan(cfg, cluster, model_path, with_servers)
    except FileNotFoundError as exc:
        log.info("memory not planned: %s", exc)
        return
    if result.sync_warning and len(nodes) > 1:
        log.warning("%s", result.sync_warning)
    if result.problems:
        raise RaytoolError(f"the run does not fit ({'; '.join(result.problems)}); `raytool plan` shows each part")


def rollout_servers(cfg: RunConfig, model_path: str, options, role: str = "rollout-server") -> dict:
    """The run's rollout.num_servers RolloutServer actors of `model_path`, by name (a dead one is
    restarted by Ray, rollout.max_restarts); the teacher's are built from `teacher_run(cfg)`."""
    r = cfg.rollout
    return {
        f"{role}-{i}": RolloutServer.options(
            **options(f"{role}-{i}", r.num_cpus, r.num_gpus), max_restarts=r.max_restarts, max_task_retries=0,
        ).remote(f"{role}-{i}", model_path, r.engine, engine_options(cfg, seed=cfg.trainer.seed + i),
                 torch_threads(cfg.cluster.torch_threads, r.num_cpus, r.num_gpus))
        for i in range(r.num_servers)
    }


def build_sandbox_pools(cfg: RunConfig, options=None) -> list:
    """`sandbox.num_pools` SandboxPool actors, each asking for `sandbox.pool_resources` (e.g. a
    custom resource that only CPU nodes offer) and accepting enough calls to fill its queue.
    `options(name, num_cpus, **extra)`: the Ray options of a named actor of this run (None: unnamed)."""
    s = cfg.sandbox
    if options is None:
        def options(name: str, num_cpus: float, **extra) -> dict:
            return actor_options(num_cpus, 0.0, cfg.cluster.accelerator, cfg.cluster.env_vars, **extra)

    limits = {"max_concurrency": s.max_concurrency, "max_queue": s.max_queue, "retries": s.retries, "timeout_s": s.timeout_s,
              "memory_mb": s.memory_mb, "breaker_failures": s.breaker_failures, "breaker_reset_s": s.breaker_reset_s}
    return [
        SandboxPool.options(**options(f"sandbox-pool-{i}", cfg.cluster.light_actor_cpus, resources=dict(s.pool_resources)),
                            max_concurrency=s.max_concurrency + s.max_queue + 16, max_restarts=cfg.cluster.max_actor_restarts, max_task_retries=0).remote(
            f"sandbox-pool-{i}", s.backend, sandbox_backend_options(s), added_latency=(s.added_latency_median_s, s.added_latency_p95_s),
            seed=cfg.trainer.seed + i, **limits
        )
        for i in range(s.num_pools)
    ]


def engine_options(cfg: RunConfig, seed: int) -> EngineOptions:
    """What a RolloutServer passes to its engine (each engine takes the options that apply to it)."""
    r = cfg.rollout
    return EngineOptions(
        dtype=cfg.model.dtype, max_batch_size=r.max_batch_size, seed=seed, tensor_parallel_size=r.tensor_parallel_size,
        gpu_memory_utilization=r.gpu_memory_utilization, max_model_len=r.max_model_len, cpu_kv_cache_gb=r.cpu_kv_cache_gb,
        cpu_preload=r.cpu_preload, enforce_eager=r.enforce_eager, partial_rollout=cfg.async_.partial_rollout,
        start_timeout_s=r.engine_start_timeout_s, delay_s=r.scripted_delay_s, crash_with=r.scripted_crash, seeded_requests=r.seed is not None,
        record_routes=cfg.trainer.router_replay == "r3",
        priority_scheduling=cfg.reward.judges_itself,  # the judge's calls do not wait behind the rollouts
    )
