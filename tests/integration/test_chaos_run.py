"""`raytool chaos` as a CI test: a short run (the HF engine, tiny model) in which each actor kind is hit
once (but the vLLM engine core, which tests/integration/test_end_to_end.py's weight-sync test kills), one fault per step (killed, or stopped and found by the heartbeat), and the run's checks
hold: every step logged once, versions going up one per step, the ledger reconciling, no actor of
the run left. The long soak is the README's `raytool chaos` run.

The command runs as a user runs it, on a local Ray instance of its own (not the session's cluster),
so this file's test runs in the suite's other worker, beside the cluster's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
STEPS = 20


def test_a_short_chaos_run_hits_every_actor_kind_once_and_loses_nothing(tmp_path):
    from raytool.chaos import KINDS

    kinds = sorted(set(KINDS) - {"engine"})  # the HF engine has no engine core process: its kill is the weight-sync test's
    overrides = [
        "model.path=tiny-random", "rollout.engine=hf", "eval.before_train=false", "eval.after_train=false", f"trainer.total_steps={STEPS}",
        "trainer.sft_warmup_steps=1", "rollout.n=2", "data.prompts_per_step=2", "rollout.max_tokens_per_turn=24", "agent.max_response_tokens=64",
        "rollout.seed=7", "cluster.heartbeat_s=5", "trainer.save_final=false", "trainer.save_every=4", "logging.logger=[]", "logging.progress=false",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([str(Path(sys.executable).parent / "raytool"), "chaos", "-c", str(REPO / "examples" / "tiny_cpu.yaml"), *overrides,
                           "--kinds", *kinds, "--kill-every", "1", "--hang", "--seed", "0", "--per-step", "--max-faults", str(len(kinds)),
                           "--run-dir", str(tmp_path / "chaos"), "--json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    table = done.stdout
    assert report["ok"], table
    assert report["by_kind"] == {kind: 1 for kind in kinds} and report["stopped"] >= 1, table
    assert report["steps"] == STEPS and report["lost"] == 0 and report["ledger"]["trained"] == STEPS * 2 - report["groups_failed"], table
