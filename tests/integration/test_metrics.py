"""Custom metrics on the head's Prometheus endpoint: the real actors (a local SandboxPool running
code, a RewardWorker scoring, an HF-engine RolloutServer behind the LLMManager) and the driver's
record_step, scraped from http://127.0.0.1:<metrics export port>/metrics with plausible values.

The actors export every second (RAY_metrics_report_interval_ms in their environment); this test's
own process, the driver, keeps Ray's default of 10 s.
"""

from __future__ import annotations

import os
import time
import urllib.request

import pytest

from raytool.types import SamplingParams

pytestmark = pytest.mark.integration

RUN = f"metrics-test-{os.getpid()}"
POOL, SERVER = "metrics-pool", "metrics-rollout"


def _actor_options() -> dict:
    from actors.common import ACTOR_ENV

    env = {**ACTOR_ENV, "RAY_metrics_report_interval_ms": "1000", "RAYTOOL_RUN": RUN}
    return {"num_cpus": 0, "runtime_env": {"env_vars": env}}


def _scrape(port: int) -> list:
    """Every raytool sample on the endpoint: (name without Ray's `ray_` prefix, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return [(s.name.removeprefix("ray_"), s.labels, s.value)
            for family in text_string_to_metric_families(text) if family.name.startswith("ray_raytool_") for s in family.samples]


def _value(samples: list, name: str, **labels) -> float | None:
    """The sum over the series of `name` with these labels; None when there is none."""
    values = [v for n, lab, v in samples if n == name and all(lab.get(k) == want for k, want in labels.items())]
    return sum(values) if values else None


def _wait_for(port: int, expected: dict, timeout_s: float = 60.0) -> list:
    """Scrape until every (name, labels) in `expected` has the value its predicate accepts."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = _scrape(port)
        got = {key: _value(samples, key[0], **dict(key[1])) for key in expected}
        wrong = {key: v for key, v in got.items() if v is None or not expected[key](v)}
        if not wrong:
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"metrics not as expected after {timeout_s:g}s (got): {wrong}")
        time.sleep(1.0)


def _key(name: str, **labels) -> tuple:
    return name, tuple(sorted(labels.items()))


def _equals(x: float):
    return lambda v: v == pytest.approx(x)


def test_actor_metrics_reach_the_heads_prometheus_endpoint(ray_cluster, tiny_model_path):
    import ray

    from actors.llm_manager import LLMManager
    from actors.reward_worker import RewardWorker
    from actors.rollout_server import RolloutServer
    from raytool.engines import EngineOptions
    from actors.sandbox_pool import SandboxPool
    from raytool.config import RewardConfig, SandboxConfig, sandbox_backend_options

    options = _actor_options()
    pool = SandboxPool.options(**options, max_concurrency=16).remote(
        POOL, "local", sandbox_backend_options(SandboxConfig(warm_sessions=1)), timeout_s=1.0)
    reward = RewardWorker.options(**options).remote(RewardConfig(fn="boxed_match"))
    server = RolloutServer.options(**options).remote(SERVER, tiny_model_path, "hf", EngineOptions(dtype="float32", max_batch_size=8))
    manager = LLMManager.options(**options).remote({SERVER: server})
    actors = [pool, reward, manager, server]
    try:
        ray.get([pool.ready.remote(), server.ready.remote()])
        cells = ["print(6 * 7)", "x = 1", "print('ok')", "1 / 0", "while True: pass"]
        statuses = [r.status for r in ray.get([pool.execute.remote(code) for code in cells])]
        assert statuses == ["ok", "ok", "ok", "error", "timeout"]
        scores = ray.get([reward.score.remote({"response": f"so \\boxed{{{a}}}"}, "4", {}, 30.0) for a in (4, 4, 5)])
        assert [s for s, _, _ in scores] == [1.0, 1.0, 0.0]
        outs = ray.get([manager.generate.remote([1, 2, 3, 4], SamplingParams(max_tokens=8, seed=i), f"m-{i}") for i in range(3)])
        tokens = sum(len(o.token_ids) for o in outs)
        assert tokens > 0

        pool_tags, server_tags = {"pool": POOL, "run": RUN}, {"server": SERVER, "run": RUN}
        samples = _wait_for(ray_cluster.metrics_port, {
            _key("raytool_sandbox_cells_total", status="ok", **pool_tags): _equals(3),
            _key("raytool_sandbox_cells_total", status="error", **pool_tags): _equals(1),
            _key("raytool_sandbox_cells_total", status="timeout", **pool_tags): _equals(1),
            _key("raytool_sandbox_cell_seconds_count", **pool_tags): _equals(5),
            _key("raytool_sandbox_cell_seconds_bucket", le="0.5", **pool_tags): lambda v: v <= 4,  # the timeout took >= 1 s
            _key("raytool_sandbox_queue_depth", **pool_tags): _equals(0),
            _key("raytool_sandbox_running", **pool_tags): _equals(0),
            _key("raytool_sandbox_breaker_open", **pool_tags): _equals(0),
            _key("raytool_reward_seconds_count", fn="boxed_match", run=RUN): _equals(3),
            _key("raytool_rollout_generated_tokens_total", **server_tags): _equals(tokens),
            _key("raytool_rollout_request_seconds_count", **server_tags): _equals(3),
            _key("raytool_rollout_tokens_per_second", **server_tags): lambda v: v > 0,
            _key("raytool_rollout_in_flight", **server_tags): _equals(0),
            _key("raytool_rollout_policy_version", **server_tags): _equals(0),
            _key("raytool_llm_servers_healthy", run=RUN): _equals(1),
        })
        assert _value(samples, "raytool_sandbox_cell_seconds_sum", **pool_tags) >= 1.0
        assert _value(samples, "raytool_llm_retries_total", run=RUN) is None  # nothing failed
    finally:
        ray.get(server.shutdown.remote())
        ray.get(pool.shutdown.remote())
        for actor in actors:
            ray.kill(actor)


def test_the_drivers_step_metrics_reach_the_endpoint(ray_cluster):
    """record_step from the driver process (this one), as actors/drivers/pipeline.py calls it."""
    from actors.metrics import record_step

    record_step(step=7, step_s=12.5, train_s=6.0, sync_s=0.25, trainer_version=5,
                server_versions={f"{RUN}-a": 5, f"{RUN}-b": 3}, rollout_s=6.0)
    _wait_for(ray_cluster.metrics_port, {
        _key("raytool_trainer_step"): _equals(7),
        _key("raytool_trainer_step_seconds"): _equals(12.5),
        _key("raytool_trainer_weight_sync_seconds"): _equals(0.25),
        _key("raytool_trainer_policy_version"): _equals(5),
        _key("raytool_policy_version_lag", server=f"{RUN}-a"): _equals(0),
        _key("raytool_policy_version_lag", server=f"{RUN}-b"): _equals(2),
    })
