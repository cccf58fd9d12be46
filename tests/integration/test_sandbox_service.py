"""`raytool sandbox serve` as a service on loopback: curl, SandboxPool actors through Ray, and a
tiny training run whose sandbox is that server (sandbox.backend=sandbox_fusion)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers.net import free_port
from raytool.config import load_config

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
TINY = ["model.path=tiny-random", "eval.before_train=false", "eval.after_train=false", "trainer.total_steps=1", "trainer.sft_warmup_steps=1", "rollout.n=2",
        "data.prompts_per_step=2", "rollout.max_tokens_per_turn=16", "agent.max_response_tokens=32"]


@pytest.fixture(scope="module")
def sandbox_server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "raytool.cli", "sandbox", "serve", "--port", str(port)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url + "/v1/ping", timeout=2) as resp:
                assert json.load(resp) == "pong"
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"raytool sandbox serve did not come up: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.3)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_gets_sandbox_fusions_answer_shape(sandbox_server):
    out = subprocess.run(["curl", "-s", "-X", "POST", sandbox_server + "/run_code", "-d", '{"code": "print(6*7)", "language": "python"}'],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    body = json.loads(out)
    assert body["status"] == "Success" and body["run_result"]["status"] == "Finished"
    assert body["run_result"]["stdout"] == "42\n" and body["run_result"]["return_code"] == 0


def test_sandbox_pools_reach_the_server_through_ray(ray_cluster, sandbox_server):
    import ray

    from actors.drivers.compose import build_sandbox_pools

    cfg = load_config(None, ["sandbox.backend=sandbox_fusion", f"sandbox.fusion_url={sandbox_server}", "sandbox.fusion_sessions=true",
                             "sandbox.num_pools=2", "sandbox.timeout_s=2"])
    pools = build_sandbox_pools(cfg)
    try:
        ray.get([p.ready.remote() for p in pools])
        assert ray.get(pools[0].execute.remote("x = 41", "traj-1")).status == "ok"
        assert ray.get(pools[0].execute.remote("x + 1", "traj-1")).stdout == "42\n"
        timeout = ray.get(pools[1].execute.remote("while True: pass", None))
        assert timeout.status == "timeout"
        ray.get(pools[0].close_session.remote("traj-1"))
        assert "NameError" in ray.get(pools[0].execute.remote("x", "traj-1")).stderr
        stats = ray.get(pools[0].stats.remote())
        assert stats["status"] == {"ok": 2, "error": 1} and stats["latency_p99_s"] > 0
    finally:
        for p in pools:
            ray.kill(p)


def test_training_with_the_sandbox_served_over_http(ray_cluster, sandbox_server, tmp_path):
    from actors.drivers.pipeline import run

    cfg = load_config(REPO / "examples" / "tiny_cpu.yaml", [*TINY, "rollout.engine=hf", "sandbox.backend=sandbox_fusion", f"sandbox.fusion_url={sandbox_server}"])
    run_dir = run(cfg, tmp_path / "run")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1]
    assert metrics[0]["sandbox/breakers_open"] == 0 and "sandbox/latency_p99_s" in metrics[0]
