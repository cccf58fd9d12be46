"""`raytool rehearse`'s Ray side: a local multi-node cluster (several raylets on this machine, each
declaring the recipe's node accelerators), the recipe's stages as separate `ray job submit`s to
its dashboard, and a sampler that watches where the stages' actors land and how much host memory
each trainer rank takes. What to run and how to judge it: raytool/rehearse.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import yaml

# The job API of the rehearsal's head takes token-authenticated callers only (as every cluster
# file starts Ray); Ray reads this when it is first imported.
os.environ["RAY_AUTH_MODE"] = "token"

import ray  # noqa: E402

from raytool import rehearse as rh  # noqa: E402
from raytool.config import load_config  # noqa: E402

log = logging.getLogger(__name__)

OBJECT_STORE_BYTES = 128 * 1024**2  # per simulated node: the tiny model's weights and batches fit many times
SAMPLE_S = 1.0  # how often the sampler reads the actors' placement and memory
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_token() -> None:
    """The token `ray job submit` presents and the head checks (~/.ray/auth_token), made once."""
    if (Path.home() / ".ray" / "auth_token").is_file() or os.environ.get("RAY_AUTH_TOKEN"):
        return
    subprocess.run([str(Path(sys.executable).parent / "ray"), "get-auth-token", "--generate"], check=True, capture_output=True)


class LocalCluster:
    """The simulated nodes as raylets on this machine (Ray's multi-node test cluster), the head
    serving the dashboard and its job API on a port of its own."""

    def __init__(self, nodes: list[rh.Node]):
        from ray.cluster_utils import Cluster

        # the jobs' entrypoints (`raytool ...`) run in a shell that inherits the raylets' environment
        venv = str(Path(sys.executable).parent)
        if venv not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = venv + os.pathsep + os.environ.get("PATH", "")
        self.dashboard_port = free_port()
        head, *others = nodes
        self.cluster = Cluster(initialize_head=True, head_node_args={
            **self._node_args(head), "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": self.dashboard_port,
            "dashboard_agent_listen_port": free_port()})
        for node in others:
            self.cluster.add_node(**self._node_args(node))
        self.address = self.cluster.address
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"

    @staticmethod
    def _node_args(node: rh.Node) -> dict:
        acc = dict(node.accelerators)
        gpus = acc.pop("GPU", 0)
        # Each node unpacks the jobs' working copies in a directory of its own, as on separate machines
        # (raylets of one machine share the session directory: two unpacking one package at once break
        # each other's imports).
        return {"num_cpus": node.cpus, "num_gpus": gpus, "resources": acc, "node_name": node.name,
                "object_store_memory": OBJECT_STORE_BYTES, "runtime_env_dir_name": f"runtime_resources_{node.name}"}

    def session_dir(self) -> Path:
        return Path(self.cluster.head_node.get_session_dir_path())

    def shutdown(self) -> None:
        self.cluster.shutdown()


class Sampler:
    """Reads, every SAMPLE_S while a stage runs, each live actor's node, Ray resources and its
    process's peak resident memory (VmHWM: the process's own high-water mark, so a sample between
    two reads misses nothing but the last second)."""

    def __init__(self, gcs_address: str):
        self.gcs_address = gcs_address
        self.seen: dict[str, rh.Seen] = {}
        self.pending: dict[str, str] = {}  # actors not placed yet -> their state
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._nodes = {n["NodeID"]: n.get("NodeName") or n["NodeManagerAddress"] for n in ray.nodes()}

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # the state API may time out under load: the next read catches up
                self.read()
            self._stop.wait(SAMPLE_S)

    def read(self) -> None:
        from ray.util.state import list_actors

        pending = {}
        for a in list_actors(address=self.gcs_address, detail=True, limit=10_000, timeout=10):
            if not a.name or rh.role_of(a.name) is None:
                continue
            if a.state != "ALIVE":
                if a.state in ("PENDING_CREATION", "DEPENDENCIES_UNREADY", "RESTARTING"):
                    pending[a.name] = a.state
                continue
            s = self.seen.setdefault(a.name, rh.Seen(a.name, self._nodes.get(a.node_id, str(a.node_id)), a.pid or 0, dict(a.required_resources or {})))
            s.pid = a.pid or s.pid
            s.peak_bytes = max(s.peak_bytes, peak_rss(s.pid))
        self.pending = pending


def peak_rss(pid: int) -> int:
    """A process's peak resident memory (VmHWM), 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


class SandboxServer:
    """`raytool sandbox serve` on a free local port (the recipe's SandboxFusion service)."""

    def __init__(self, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/run_code"
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([str(Path(sys.executable).parent / "raytool"), "sandbox", "serve", "--port", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        self.log_path = log_path

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise rh.RehearsalError(f"the local sandbox server exited ({self.proc.returncode}): see {self.log_path}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/ping", timeout=2):
                    return
            time.sleep(0.5)
        raise rh.RehearsalError(f"the local sandbox server did not answer within {timeout_s:g} s: see {self.log_path}")

    def stop(self) -> None:
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
        self._log.close()


def runtime_env() -> dict:
    """cluster_configs/runtime_env.yaml, as `ray job submit --runtime-env` run from the repository root reads it."""
    env = yaml.safe_load((rh.REPO / "cluster_configs" / "runtime_env.yaml").read_text())
    env["working_dir"] = str((rh.REPO / env.get("working_dir", ".")).resolve())
    return env


def submit(client, stage: rh.Stage, timeout_s: float, sampler: Sampler, log_path: Path) -> tuple[str, float, str]:
    """One stage as a job -> (its final status, seconds, its log). A job still running after
    `timeout_s` is stopped and reported as such, with the actors it waited for."""
    start = time.monotonic()
    job = client.submit_job(entrypoint=stage.entrypoint(), runtime_env=runtime_env(), submission_id=f"rehearse-{stage.name}-{int(time.time())}")
    status = "PENDING"
    while (status := str(client.get_job_status(job)).rsplit(".", 1)[-1]) not in TERMINAL:
        if time.monotonic() - start > timeout_s:
            client.stop_job(job)
            waiting = ", ".join(f"{name} {state}" for name, state in sorted(sampler.pending.items())) or "no actor pending"
            status = f"TIMEOUT after {timeout_s:g} s ({waiting})"
            break
        time.sleep(1.0)
    logs = client.get_job_logs(job)
    log_path.write_text(logs)
    return status, time.monotonic() - start, logs


def rehearse(recipe: str, overrides: list[str], workdir: Path | None = None, only: list[str] | None = None,
             stage_timeout_s: float = 900.0) -> tuple[rh.Rehearsal, list[rh.Check], dict[str, float]]:
    """Rehearse `recipe` (with the user's `overrides`): plan the swaps, prepare the shared storage,
    start the cluster and the sandbox server, submit each stage (those in `only`, all by default)
    and judge it -> (the rehearsal, its checks, seconds per part)."""
    t0 = time.monotonic()
    recipe_path = str(Path(recipe).resolve())
    raw = rh.recipe_keys(recipe_path)
    with contextlib.chdir(rh.REPO):  # the recipe's relative paths (tool YAMLs) are the job's working copy's: this checkout's
        cfg = load_config(recipe_path, overrides)
    rh.check_rehearsable(recipe, raw, cfg)  # before anything starts
    workdir = Path(workdir or rh.REPO / "runs" / f"rehearse-{Path(recipe).stem}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    sandbox = SandboxServer(workdir / "logs" / "sandbox.log")
    cluster = None
    timings: dict[str, float] = {}
    try:
        with contextlib.chdir(rh.REPO):
            r = rh.plan_rehearsal(recipe, cfg, raw, rh.Host.this_machine(), workdir / "shared", sandbox.url,
                                  rh.count_conversations(cfg, workdir / "scratch"), extra=overrides)
            rh.prepare_data(r)
            rh.build_tiny_model(r, cfg.model.path)
            eff = load_config(recipe_path, [*overrides, *(o.arg() for o in r.overrides)])
        log.info("rehearsal of %s: %d simulated nodes, %d overrides; work directory %s", recipe, len(r.nodes), len(r.overrides), workdir)
        sandbox.wait_ready()
        ensure_token()
        timings["prepare"] = time.monotonic() - t0
        t = time.monotonic()
        cluster = LocalCluster(r.nodes)
        ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)
        timings["cluster start"] = time.monotonic() - t
        checks = [rh.Check("cluster", True, f"{len(r.nodes)} raylets up in {timings['cluster start']:.0f} s, dashboard {cluster.dashboard}")]
        checks += run_stages(r, eff, cluster, workdir, only, stage_timeout_s, timings)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        sandbox.stop()
    timings["total"] = time.monotonic() - t0
    return r, checks, timings


def run_stages(r: rh.Rehearsal, cfg, cluster: LocalCluster, workdir: Path, only: list[str] | None,
               timeout_s: float, timings: dict[str, float]) -> list[rh.Check]:
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(cluster.dashboard)
    checks: list[rh.Check] = []
    failed = None
    for stage in r.stages:
        if only and stage.name not in only:
            continue
        if failed is not None:
            checks.append(rh.Check(f"job ({stage.name})", None, f"not run: stage {failed} failed"))
            continue
        log.info("stage %s: %s", stage.name, stage.entrypoint())
        before = metrics_lines(Path(stage.run_dir))
        with Sampler(cluster.address) as sampler:
            status, seconds, logs = submit(client, stage, timeout_s, sampler, workdir / "logs" / f"{stage.name}.log")
        timings[stage.name] = seconds
        ok = status == "SUCCEEDED"
        checks.append(rh.Check(f"job ({stage.name})", ok, f"{seconds:.0f} s" if ok else f"{status}: {last_error(logs)}"))
        checks += stage_checks(r, cfg, stage, list(sampler.seen.values()), ok, before, logs)
        checks.append(working_copy_check(stage.name, cluster.session_dir()))
        if stage.name == "grpo" and ok:
            checks.append(sandbox_check(r, cfg))
        if not ok:
            failed = stage.name
    return checks


def last_error(logs: str) -> str:
    """The line of a failed job's log that says why: raytool's one line, else the last non-empty line."""
    lines = [line.strip() for line in logs.splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("raytool:")]
    return (said or lines or ["(no output)"])[-1][:400]


def metrics_lines(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def stage_checks(r: rh.Rehearsal, cfg, stage: rh.Stage, seen: list[rh.Seen], ok: bool, before: list[dict], logs: str) -> list[rh.Check]:
    from raytool.planner import Cluster, plan
    from raytool.placement import agent_workers

    with_servers = stage.name != "sft"
    nodes = [n for n in r.nodes if n.accelerators]
    acc = cfg.cluster.accelerator
    on_cluster = plan(cfg, Cluster(len(nodes), int(cfg.cluster.gpus_per_node), 0.0, rh.Host.this_machine().memory_gib), with_servers=with_servers)
    on_cpu = plan(cfg, Cluster(1, 0, 0.0, rh.Host.this_machine().memory_gib), with_servers=with_servers)  # where the ranks really run: host memory
    expected = {"trainer worker": cfg.trainer.num_workers}
    if with_servers:
        wanted = {"rollout server": cfg.rollout.num_servers, "llm manager": 1, "sandbox pool": cfg.sandbox.num_pools,
                  "reward worker": cfg.reward.num_workers, "agent worker": agent_workers(cfg)}
        expected |= wanted
    if ok or seen:
        checks = [rh.check_placement(stage.name, seen, expected, r.nodes, on_cluster.accelerators, acc),
                  rh.check_trainer_memory(stage.name, seen, on_cpu.roles[0].host_total, max(on_cpu.loading, on_cpu.export))]
    else:
        checks = [rh.Check(f"placement ({stage.name})", None, "the stage failed before any actor started")]
    if stage.name == "sft":
        root = Path(r.export).parent.parent
        step = rh.latest_step(root)
        if step is not None and step != r.sft_steps:
            rh.use_export(r, step)
        checks.append(rh.check_sft_rows(logs))
        checks.append(rh.check_checkpoints("sft", root, [step or r.sft_steps], r.shared, export=True))
    elif stage.name == "grpo":
        checks.append(rh.check_export_read(r, Path(stage.run_dir), ok))
        checks.append(rh.check_checkpoints("grpo", Path(r.rl_checkpoints), [1, rh.STEPS], r.shared, export=cfg.trainer.save_final))
    else:
        checks.append(rh.check_resume(Path(stage.run_dir), before, metrics_lines(Path(stage.run_dir)), logs, ok))
    return checks


def working_copy_check(stage: str, session: Path) -> rh.Check:
    """Files a stage wrote into its job's working copy, which this checkout does not hold (lost
    with the copy on a cluster: the next job, on the head or another node, gets a fresh one)."""
    written = []
    for copy in session.glob("runtime_resources_*/working_dir_files/*"):
        for path in copy.rglob("*"):
            rel = path.relative_to(copy)
            if path.is_file() and "__pycache__" not in rel.parts and not (rh.REPO / rel).exists():
                written.append(str(rel))
    if written:
        return rh.Check(f"working copy ({stage})", False, f"{len(written)} files written into the job's working copy, lost on a cluster: "
                        + ", ".join(sorted(written)[:5]))
    return rh.Check(f"working copy ({stage})", True, "nothing written into the job's working copy")


def sandbox_check(r: rh.Rehearsal, cfg) -> rh.Check:
    """The GRPO job's sandbox pools reached the recipe's sandbox service: each pool's start waits
    for its `GET /v1/ping` and stops the job when it does not answer (SandboxFusionBackend.start),
    so a job that ran says they did. (A random model calls no tool: no cell runs.)"""
    from raytool.resolve import with_tool_sandbox_settings

    with contextlib.chdir(rh.REPO):
        backend = with_tool_sandbox_settings(cfg).sandbox.backend
    if backend != "sandbox_fusion":
        return rh.Check("sandbox service (grpo)", None, f"the recipe's sandbox is {backend}: no service to reach")
    return rh.Check("sandbox service (grpo)", True, f"{cfg.sandbox.num_pools} sandbox pools started against it, each after its "
                                                     f"GET /v1/ping ({r.sandbox})")