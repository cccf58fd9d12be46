"""`raytool rehearse` for real: a reference recipe's cluster as raylets on this machine, its stages
as token-authenticated `ray job submit`s, and the checks' JSON. The default suite runs the shortest
form (the 32B recipe's four 8-GPU nodes, its SFT stage alone with two trainer ranks); the whole
rehearsal of the one-GPU recipe (warm-up + GRPO, then the resume) is marked slow. Each runs the CLI
in a process of its own: it starts its own cluster, not the session's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def rehearse(tmp_path: Path, *args: str, timeout: float) -> tuple[int, dict, str]:
    cli = Path(sys.executable).parent / "raytool"
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    done = subprocess.run([str(cli), "rehearse", *args, "--workdir", str(tmp_path / "rehearsal"), "--json"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), done.stdout[-3000:] + done.stderr[-3000:]
    return done.returncode, json.loads(lines[-1]), done.stdout + done.stderr


def test_the_32b_recipes_four_nodes_place_its_sft_stage_on_gpu_nodes_with_shared_checkpoints(tmp_path):
    code, out, text = rehearse(tmp_path, "-c", "examples/retool_qwen2.5_32b_sandbox_fusion.yaml", "trainer.num_workers=2", "--stages", "sft",
                               timeout=300)
    checks = {c["name"]: c for c in out["checks"]}
    assert [n["accelerators"] for n in out["nodes"]] == [{"GPU": 8.0}] * 4
    for name in ("cluster", "job (sft)", "placement (sft)", "trainer host memory (sft)", "checkpoints (sft)", "working copy (sft)"):
        assert checks[name]["ok"], f"{name}: {checks[name]['detail']}\n{text[-3000:]}"
    # the rehearsal scales the ranks down where this host's free memory is short: the override says so
    workers = int(next((o["value"] for o in out["overrides"] if o["key"] == "trainer.num_workers"), 2))
    placed = re.findall(r"(\d+) trainer workers?", checks["placement (sft)"]["detail"])
    assert sum(map(int, placed)) == workers, checks["placement (sft)"]["detail"]
    assert {"model.path", "rollout.engine", "trainer.checkpoint_dir", "sandbox.fusion_url"} <= {o["key"] for o in out["overrides"]}
    assert out["stages"]["sft"].startswith("raytool sft -c examples/retool_qwen2.5_32b_sandbox_fusion.yaml trainer.num_workers=2 ")
    assert any("tensor parallelism" in line for line in out["not_rehearsed"])
    failed = [c["name"] for c in out["checks"] if c["ok"] is False]
    assert (code != 0) == bool(failed)
    for name in failed:  # one line per failed check, naming it
        assert f"raytool: rehearsal check failed: {name}: " in text


@pytest.mark.slow
def test_the_one_gpu_recipe_rehearses_every_stage_and_resumes_exactly(tmp_path):
    code, out, text = rehearse(tmp_path, "-c", "examples/gsm8k_lora_qwen2.5_1.5b.yaml", timeout=900)
    checks = {c["name"]: c for c in out["checks"]}
    assert checks["export read back (grpo)"]["ok"] is None  # the warm-up is in-run: no SFT stage
    for name in ("job (grpo)", "placement (grpo)", "checkpoints (grpo)", "job (resume)", "resume exact (resume)"):
        assert checks[name]["ok"], f"{name}: {checks[name]['detail']}\n{text[-3000:]}"


def test_a_recipe_without_a_cluster_cannot_be_rehearsed_in_one_line(tmp_path):
    cli = Path(sys.executable).parent / "raytool"
    done = subprocess.run([str(cli), "rehearse", "-c", "examples/tiny_cpu.yaml", "--workdir", str(tmp_path / "r")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("raytool:")]
    assert "cannot rehearse" in line and "cluster.nodes" in line
