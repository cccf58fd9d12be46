"""Engines that crash (the shared Ray cluster): a real vLLM engine that dies of the same exception
as at its previous death is stopped for good with that exception, and a deliberately poisoned
engine ends a training run in one line within a minute. (The seeded asynchronous run whose engine
crashed is tests/integration/test_async.py's partial-rollout test.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest


pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def test_a_vllm_engine_that_dies_of_the_same_error_as_before_is_not_restarted(ray_cluster, tiny_model_path):
    """vLLM's own crash, captured: a server whose engine keeps chunked prefill (seeded_requests=False)
    gets seeded prompts longer than one step takes together, and dies of 'CPU Generator does not use
    offset' in its worker. Its journal says it died of that before (as after a first crash and a
    restart: the scripted run below walks the restart itself), so it exits for good, though its
    budget allows restarts, and the watchdog's check raises that error in one line.
    (If a vLLM release stops rewinding CPU generators, this test fails: drop the workaround then.)"""
    import ray
    from ray.util.state import get_actor

    from actors import deaths
    from actors.common import actor_options
    from actors.rollout_server import RolloutServer
    from raytool.engines import EngineOptions
    from actors.drivers.watchdog import ActorLostError, Watchdog
    from raytool.engines.crash import EngineCrash, EngineDeath
    from raytool.types import SamplingParams

    server = RolloutServer.options(**actor_options(0), max_restarts=5, max_task_retries=0).remote(
        "rollout-server-0", tiny_model_path, "vllm",
        EngineOptions(dtype="float32", max_batch_size=64, cpu_kv_cache_gb=1, enforce_eager=True, seeded_requests=False))
    actor_id = server._actor_id.hex()
    deaths.record_death(actor_id, EngineDeath(EngineCrash("RuntimeError", "CPU Generator does not use offset"), 30.0, ["g0-0@t0"], 1))
    watchdog = Watchdog({"rollout-server-0": server}, interval_s=0)
    ray.get(server.ready.remote(), timeout=300)
    watchdog.check()  # alive: nothing to say
    prompts = [[1] + [(i * 7 + j) % 5000 + 10 for j in range(300)] for i in range(16)]  # 16 x 301 tokens > a 2,048-token step
    refs = [server.generate.remote(p, SamplingParams(max_tokens=8, seed=i), f"g{i}-0@t0") for i, p in enumerate(prompts)]
    for ref in refs:
        with pytest.raises(ray.exceptions.RayError):
            ray.get(ref, timeout=120)
    start = time.monotonic()
    while (state := get_actor(actor_id, address=ray.get_runtime_context().gcs_address)).state != "DEAD":
        assert time.monotonic() - start < 60, state.state
        time.sleep(0.5)
    assert state.num_restarts == 0  # five were allowed: none was spent
    last = deaths.last_death(actor_id)
    assert (last.crash.type, last.crash.message) == ("RuntimeError", "CPU Generator does not use offset")
    # where it was raised: the engine core, which runs a CPU engine's one worker
    assert "EngineCore" in last.crash.process and "set_offset" in last.crash.traceback and last.in_flight >= 1
    with pytest.raises(ActorLostError) as lost:
        watchdog.check()
    line = str(lost.value)
    assert "\n" not in line and line.startswith("rollout-server-0: its engine died again right after a restart with the same error")
    assert "RuntimeError: CPU Generator does not use offset" in line and "request(s) in flight, e.g. g" in line


def test_a_poisoned_engine_ends_the_run_in_one_line_within_a_minute(ray_cluster, tmp_path):
    """`raytool train` on a scripted engine poisoned to die of the same error at every request:
    one restart, then the run ends (exit 2) with one line naming the server and the engine's error,
    and the engine's traceback is in run.log."""
    run_dir = tmp_path / "poisoned"
    raytool = str(Path(sys.executable).parent / "raytool")
    env = {**ray_cluster.env, "RAY_ADDRESS": ray_cluster.address}
    start = time.monotonic()
    done = subprocess.run([raytool, "train", "model.path=tiny-random", "eval.before_train=false", "eval.after_train=false", "rollout.engine=scripted", "rollout.scripted_delay_s=0.05",
                           "rollout.scripted_crash='RuntimeError: poisoned on purpose'", "rollout.health_probe_interval_s=1",
                           "trainer.sft_warmup_steps=0", "trainer.total_steps=2", "logging.logger=[]", "--run-dir", str(run_dir)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - start
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("raytool: rollout-server-0: its engine died again right after a restart with the same error"), last
    assert "RuntimeError: poisoned on purpose" in last and "run.log" in last
    assert took < 60 + 30, took  # a minute, plus the driver's and Ray's start
    log = (run_dir / "run.log").read_text()
    assert "(a poisoned scripted engine, request " in log  # the engine's traceback, in the driver's log
