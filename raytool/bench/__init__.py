"""Benchmarks behind `raytool bench NAME`: each takes the resolved RunConfig, returns (table text, result dict).

Each is registered by the name of its function (`BENCHES`), imported only when it runs, so that
`raytool bench router` (and the CLI's start) never imports Ray or torch.
"""

from __future__ import annotations

from collections.abc import Callable

from raytool.config import RunConfig
from raytool.entry import entry

Bench = Callable[[RunConfig], tuple[str, dict]]


# name -> its "module:function" (raytool.entry), which takes the resolved RunConfig.
BENCHES: dict[str, str] = {
    "engine": "raytool.bench.engine:bench",
    "gateway": "raytool.bench.gateway:bench",
    "load": "actors.benches.load:bench",
    "pipeline": "actors.benches.pipeline:bench",
    "router": "raytool.bench.router_sim:bench",
    "rollout": "actors.benches.rollout:bench",
    "scale": "actors.benches.scale:bench",
    "sandbox": "raytool.bench.sandbox:bench",
    "tinker": "raytool.bench.tinker:bench",
    "trainer": "raytool.bench.trainer:bench",
    "trl": "actors.benches.trl:bench",
    "weight-sync": "raytool.bench.weight_sync:bench",
}


def run_bench(name: str, cfg: RunConfig, *args) -> tuple[str, dict]:
    """Bench `name` on `cfg` (and its own extra arguments) -> (table text, result dict)."""
    bench: Bench = entry(BENCHES[name])
    return bench(cfg, *args)
