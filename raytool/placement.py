"""What a run asks of the cluster, and whether the cluster can ever give it (no Ray here).

Ray leaves an actor or placement group that asks for more than the cluster has pending forever,
silently. The driver checks the run's demands against the nodes first and stops with one line
that names the missing resource and the config keys that asked for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from raytool.config import RunConfig
from raytool.distill import teacher_run
from raytool.errors import RaytoolError


class PlacementError(RaytoolError):
    pass


@dataclass(frozen=True)
class Demand:
    role: str  # "rollout server", "trainer worker", ...
    count: int
    bundle: dict[str, float]  # what one of them reserves, e.g. {"CPU": 1, "GPU": 1}
    keys: str  # the config keys that set it


def accelerator_request(accelerator: str, count: float) -> dict[str, float]:
    """The Ray resources of `count` accelerators: num_gpus counts GPUs, an NPU is a custom resource."""
    return {accelerator: count} if count else {}


def shares_accelerators(cfg: RunConfig) -> bool:
    """Whether rollout servers and trainer workers ask for fractions of accelerators, so that Ray may
    put both on one device (the one-GPU LoRA recipe: 0.4 for the engine, 0.6 for the trainer)."""
    r, t = cfg.rollout, cfg.trainer
    return bool(r.num_gpus and t.num_gpus and (r.num_gpus % 1 or t.num_gpus % 1))


def agent_workers(cfg: RunConfig) -> int:
    """agent.num_workers, auto: enough workers that the trajectories they keep in flight fill every
    rollout server (a 4-server, 256-sequence run with one 256-trajectory worker ran them at a quarter)."""
    a, r = cfg.agent, cfg.rollout
    if a.num_workers != "auto":
        return a.num_workers
    return max(1, math.ceil(r.num_servers * r.max_batch_size / a.max_concurrent_trajectories))


def demands(cfg: RunConfig) -> list[Demand]:
    """Every actor the run starts, by role, with what each reserves."""
    r, t, s, c = cfg.rollout, cfg.trainer, cfg.sandbox, cfg.cluster
    light = {"CPU": c.light_actor_cpus}
    acc = c.accelerator
    out = [
        Demand("rollout server", r.num_servers, {"CPU": r.num_cpus, **accelerator_request(acc, r.num_gpus)},
               "rollout.num_servers, rollout.num_cpus, rollout.num_gpus"),
        Demand("trainer worker", t.num_workers, {"CPU": t.num_cpus, **accelerator_request(acc, t.num_gpus)},
               "trainer.num_workers, trainer.num_cpus, trainer.num_gpus"),
        Demand("llm manager", 1, light, "cluster.light_actor_cpus"),
        Demand("teacher server", cfg.distill.num_servers if cfg.distill.has_servers else 0, {"CPU": r.num_cpus, **accelerator_request(acc, teacher_run(cfg).rollout.num_gpus)},
               "distill.num_servers, distill.num_gpus, rollout.num_cpus"),
        Demand("teacher manager", 1 if cfg.distill.has_servers else 0, light, "distill.teacher, cluster.light_actor_cpus"),
        Demand("sandbox pool", s.num_pools, {**light, **s.pool_resources}, "sandbox.num_pools, sandbox.pool_resources, cluster.light_actor_cpus"),
        Demand("reward worker", cfg.reward.num_workers, light, "reward.num_workers, cluster.light_actor_cpus"),
        Demand("agent worker", agent_workers(cfg), light, "agent.num_workers, cluster.light_actor_cpus"),
    ]
    return [Demand(d.role, d.count, {k: v for k, v in d.bundle.items() if v}, d.keys) for d in out if d.count]


def _fmt(x: float) -> str:
    return f"{x:g}"


def shortfall(wanted: list[Demand], nodes: list[dict[str, float]]) -> str | None:
    """Why `wanted` can never be placed on `nodes` (each node's total resources), or None.

    Two checks that need no bin packing: every single actor must fit on some node, and the
    cluster's totals must cover the sum of all demands."""
    for d in wanted:
        fits = [node for node in nodes if all(node.get(k, 0.0) >= v for k, v in d.bundle.items())]
        if not fits:
            missing = sorted(k for k, v in d.bundle.items() if max((node.get(k, 0.0) for node in nodes), default=0.0) < v)
            most = ", ".join(f"{_fmt(max((node.get(k, 0.0) for node in nodes), default=0.0))} {k}" for k in missing)
            return (f"no node can hold one {d.role}, which asks for {_describe(d.bundle)}: the largest node has {most} "
                    f"(missing resource {', '.join(missing)}; config keys {d.keys}){_hint(missing, nodes)}")
    totals: dict[str, float] = {}
    for node in nodes:
        for k, v in node.items():
            totals[k] = totals.get(k, 0.0) + v
    needed: dict[str, float] = {}
    for d in wanted:
        for k, v in d.bundle.items():
            needed[k] = needed.get(k, 0.0) + v * d.count
    for k in sorted(needed):
        if needed[k] > totals.get(k, 0.0) + 1e-9:
            parts = ", ".join(f"{d.count} {d.role}{'s' if d.count > 1 else ''} x {_fmt(d.bundle[k])}" for d in wanted if d.bundle.get(k))
            keys = "; ".join(d.keys for d in wanted if d.bundle.get(k))
            return (f"the run needs {_fmt(needed[k])} {k} ({parts}) but the cluster has {_fmt(totals.get(k, 0.0))} "
                    f"(missing resource {k}; config keys {keys}){_hint([k], nodes)}")
    return None


def _describe(bundle: dict[str, float]) -> str:
    return ", ".join(f"{_fmt(v)} {k}" for k, v in sorted(bundle.items())) or "nothing"


def _hint(missing: list[str], nodes: list[dict[str, float]]) -> str:
    """Point at the accelerator the cluster does have when the run asked for the other one."""
    has = {k for node in nodes for k, v in node.items() if v}
    for wanted, other in (("GPU", "NPU"), ("NPU", "GPU")):
        if wanted in missing and wanted not in has and other in has:
            return f"; this cluster has {other}s: set cluster.accelerator={other}"
    return ""


def check(wanted: list[Demand], nodes: list[dict[str, float]]) -> None:
    """Raise PlacementError naming the missing resource if `wanted` cannot be placed on `nodes`."""
    reason = shortfall(wanted, nodes)
    if reason:
        raise PlacementError(f"cannot place the run's actors: {reason}")


def bundle(cfg: RunConfig, role: str) -> dict[str, float]:
    """What one actor of `role` reserves ({} when it reserves nothing)."""
    return next((d.bundle for d in demands(cfg) if d.role == role), {})
