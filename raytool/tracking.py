"""Metrics and traces of a run: metrics.jsonl (one object per GRPO step), sft_metrics.jsonl (one per
SFT warm-up step), a console line per step, and traces.jsonl (sampled full trajectories)."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

import msgspec

log = logging.getLogger(__name__)

# Shown on the console line, in this order, when present.
_CONSOLE_KEYS = [
    ("reward/mean", "reward"), ("acc/mean", "acc"), ("tool/calls_per_traj", "calls"),
    ("tool/error_rate", "tool_err"), ("num_turns/mean", "turns"), ("response_length/mean", "len"),
    ("actor/pg_loss", "loss"), ("timing/step_s", "step_s"),
]


class Tracker:
    def __init__(self, run_dir: str | Path, console: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.console = console
        self._files = {
            "grpo": open(self.run_dir / "metrics.jsonl", "a", buffering=1),
            "sft": open(self.run_dir / "sft_metrics.jsonl", "a", buffering=1),
        }
        self._traces = open(self.run_dir / "traces.jsonl", "a", buffering=1)

    def log(self, metrics: dict, phase: str = "grpo") -> None:
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in metrics.items()}
        self._files[phase].write(json.dumps(clean) + "\n")
        if self.console:
            parts = [f"[{phase} step {metrics.get('step')}]"]
            keys = _CONSOLE_KEYS if phase == "grpo" else [(k, k.split("/")[-1]) for k in sorted(metrics) if k.startswith("sft/")]
            parts += [f"{short}={metrics[k]:.4g}" for k, short in keys if isinstance(metrics.get(k), (int, float))]
            parts += [f"{k.removeprefix('val-core/')}={v:.3f}" for k, v in sorted(metrics.items()) if k.startswith("val-core/") and "/mean@" in k]
            print(" ".join(parts), file=sys.stderr, flush=True)

    def trace(self, step: int, trajectories, decode=None) -> None:
        """Write full trajectories: ids, masks, messages, per-turn texts, tool calls with their
        status and output, errors, reward and timings; `decode(ids)` adds the decoded prompt."""
        for t in trajectories:
            row = {"step": step, **msgspec.to_builtins(t)}
            if decode is not None:
                row["prompt_text"] = decode(t.prompt_ids)
            self._traces.write(json.dumps(row) + "\n")

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._traces.close()
