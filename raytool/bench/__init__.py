"""Benchmarks behind `raytool bench NAME`: each takes the resolved RunConfig, returns (table text, result dict).

Register a function that imports its heavy modules inside, so that `raytool bench router` (and the
CLI's start) never imports Ray or torch.
"""

from __future__ import annotations

from collections.abc import Callable

from raytool.config import RunConfig

Bench = Callable[[RunConfig], tuple[str, dict]]


def _router(cfg: RunConfig) -> tuple[str, dict]:
    from raytool.bench.router_sim import bench

    return bench(cfg)


def _rollout(cfg: RunConfig) -> tuple[str, dict]:
    from actors.bench_rollout import bench  # lazy, like the CLI's train: the Ray layer

    return bench(cfg)


def _pipeline(cfg: RunConfig) -> tuple[str, dict]:
    from actors.bench_pipeline import bench  # lazy: the Ray layer

    return bench(cfg)


def _load(cfg: RunConfig) -> tuple[str, dict]:
    from actors.bench_load import bench  # lazy: the Ray layer

    return bench(cfg)


def _scale(cfg: RunConfig) -> tuple[str, dict]:
    from actors.bench_scale import bench  # lazy: the Ray layer

    return bench(cfg)


def _gateway(cfg: RunConfig) -> tuple[str, dict]:
    from raytool.bench.gateway import bench

    return bench(cfg)


def _sandbox(cfg: RunConfig) -> tuple[str, dict]:
    from raytool.bench.sandbox import bench

    return bench(cfg)


def _weight_sync(cfg: RunConfig) -> tuple[str, dict]:
    from raytool.bench.weight_sync import bench

    return bench(cfg)


def _trainer(cfg: RunConfig) -> tuple[str, dict]:
    from raytool.bench.trainer import bench

    return bench(cfg)


def _engine(cfg: RunConfig) -> tuple[str, dict]:
    from raytool.bench.engine import bench

    return bench(cfg)


BENCHES: dict[str, Bench] = {"engine": _engine, "gateway": _gateway, "load": _load, "pipeline": _pipeline, "router": _router, "rollout": _rollout, "scale": _scale, "sandbox": _sandbox, "trainer": _trainer, "weight-sync": _weight_sync}
