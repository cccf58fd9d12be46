"""`raytool train` as a newcomer runs it: its own local Ray instance (not the session's cluster, so
this file's test runs in the suite's other worker, beside the cluster's), the embedded default on
the tiny model, and what it prints."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
TINY = ["model.path=tiny-random", "eval.before_train=false", "eval.after_train=false", "trainer.total_steps=2", "trainer.sft_warmup_steps=2", "rollout.n=2",
        "data.prompts_per_step=2", "rollout.max_tokens_per_turn=24", "agent.max_response_tokens=64"]


# What `raytool train` may print besides progress-bar refreshes: its banner, the step and
# validation lines, its own warnings and the end summary.
CONSOLE_LINE = re.compile(r"raytool: |  |\[(sft|grpo) step \d+\] |done: |reward \(mean score\): |held-out accuracy |"
                          r"tool calls per held-out |final model: |next: |warning: ")


def test_the_default_run_tells_its_story_on_the_console(tmp_path):
    """`raytool train` as a newcomer runs it (its own local Ray instance), the embedded default on
    the tiny model: raytool's lines only, at most 60 of them, ending on the summary with held-out
    accuracy before and after training."""
    from raytool.console import validation_means as console_means

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run_dir = tmp_path / "default"
    done = subprocess.run([str(Path(sys.executable).parent / "raytool"), "train", *TINY, "eval.before_train=true",
                           "eval.after_train=true", "eval.max_prompts=4", "eval.n=2", "--run-dir", str(run_dir)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = [line for line in re.split(r"[\r\n]", done.stdout + done.stderr) if line.strip()]
    lines = [line for line in out if not re.match(r"(rollout step \d+|validation): ", line)]  # the progress bars' refreshes
    assert len(lines) <= 60, "\n".join(lines)
    assert [line for line in lines if not CONSOLE_LINE.match(line)] == [], "\n".join(lines)
    assert lines[0].startswith("raytool: tiny-random (") and lines[0].endswith(")")
    assert any(line.startswith("  dashboard: http://") for line in lines[:8])
    summary = lines[lines.index(next(line for line in lines if line.startswith("done: "))):]
    assert summary[0].startswith("done: 2 GRPO steps after 2 SFT warm-up steps in ")
    assert any(re.fullmatch(r"held-out accuracy \(\w+, mean@2\): \d\.\d\d at step 0 -> \d\.\d\d at step 2", line) for line in summary)
    assert summary[-2] == f"next: raytool report {run_dir}   (curves and trajectories in the browser)"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert console_means(metrics[0]) and console_means(metrics[2]).keys() == console_means(metrics[0]).keys()
    # What the console left out is in run.log: Ray's start-up lines among them.
    assert "Started a local Ray instance" in (run_dir / "run.log").read_text()
