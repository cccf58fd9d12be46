"""Metrics and traces of a run, under verl's metric names: metrics.jsonl (one object per GRPO step),
sft_metrics.jsonl (one per SFT step) and traces.jsonl (sampled full trajectories) always, plus the
trackers of `logging.logger`: a console line per step, TensorBoard event files in RUN_DIR/tensorboard,
Weights & Biases in RUN_DIR/wandb (online when WANDB_API_KEY is set, else offline)."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import sys
from pathlib import Path

import msgspec

from raytool.config import ConfigError, LoggingConfig

log = logging.getLogger(__name__)

# raytool's own name -> verl's (verl/trainer/ppo/metric_utils.py, ray_trainer.py, sft_trainer.py).
# Names not listed pass through: verl has the same (actor/*, num_turns/mean, response_length/mean,
# val-core/..., val-aux/...) or nothing like it (acc/mean, tool/errors/<kind>, sandbox/*, ...).
VERL_NAMES = {
    "grpo": {
        "reward/mean": "critic/score/mean",
        "reward/max": "critic/score/max",
        "reward/min": "critic/score/min",
        "timing/step_s": "timing_s/step",
        "timing/rollout_s": "timing_s/gen",
        "timing/train_s": "timing_s/update_actor",
        "timing/weight_sync_s": "timing_s/update_weights",
        "timing/validation_s": "timing_s/testing",
    },
    "sft": {
        "sft/loss": "train/loss",
        "sft/grad_norm": "train/grad_norm",
        "sft/lr": "train/lr",
        "sft/tokens": "train/global_tokens",
        "val/sft_loss": "val/loss",
        "timing/step_s": "train/time(s)",
    },
}

# Tracker -> (the module it needs, how to install it).
_PACKAGES = {"tensorboard": ("tensorboard", "pip install tensorboard"), "wandb": ("wandb", "pip install 'raytool[wandb]'")}

# Shown on the console line, in this order, when present.
_CONSOLE_KEYS = [
    ("critic/score/mean", "score"), ("acc/mean", "acc"), ("tool/calls_per_traj", "calls"),
    ("tool/error_rate", "tool_err"), ("num_turns/mean", "turns"), ("response_length/mean", "len"),
    ("actor/pg_loss", "loss"), ("router/replay_differs_frac", "routes_replayed_differ"), ("timing_s/step", "step_s"),
]


def verl_names(metrics: dict, phase: str = "grpo") -> dict:
    """`metrics` under verl's names (VERL_NAMES; other `timing/<x>_s` become `timing_s/<x>`).
    Names that already are verl's stay, so old and new metrics files read the same.

    verl's critic/rewards/* are its scores after the KL reward penalty; raytool applies that penalty
    inside the trainer (actor/reward_kl_penalty), so critic/rewards/* repeat critic/score/* only
    when no penalty was applied."""
    names = VERL_NAMES[phase]
    out = {}
    for key, value in metrics.items():
        if key in names:
            key = names[key]
        elif phase == "grpo" and key.startswith("timing/") and key.endswith("_s"):
            key = "timing_s/" + key.removeprefix("timing/").removesuffix("_s")
        out[key] = value
    if phase == "grpo" and "actor/reward_kl_penalty" not in out:
        for stat in ("mean", "max", "min"):
            if f"critic/score/{stat}" in out:
                out.setdefault(f"critic/rewards/{stat}", out[f"critic/score/{stat}"])
    return out


def validate_backends(cfg: LoggingConfig) -> None:
    """Fail before a run starts when a tracker of logging.logger lacks its package."""
    for backend in cfg.logger:
        module, install = _PACKAGES.get(backend, (None, ""))
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(f"config key 'logging.logger': the '{backend}' tracker needs the {module} package, which is not installed: "
                              f"{install}, or remove '{backend}' from logging.logger")


def _scalars(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}


def keep_lines(path: Path, keep) -> None:
    """Rewrite the JSONL file `path` with only the entries `keep(entry)` accepts; a torn last line
    (a driver killed mid-write) goes too. A resumed run cuts the steps after its checkpoint this
    way, so that each step it does again is written once."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if keep(entry):
            kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def cut_after_step(run_dir: Path, step: int) -> None:
    """metrics.jsonl, traces.jsonl and val_traces.jsonl without the steps after `step` (a resume from step `step`)."""
    for name in ("metrics.jsonl", "traces.jsonl", "val_traces.jsonl"):
        keep_lines(Path(run_dir) / name, lambda entry: entry.get("step", 0) <= step)


class Tracker:
    """Writes each step's metrics to the JSONL files and the trackers of `cfg.logger`, and trajectories
    to traces.jsonl. `config` (the run config as builtins) goes to W&B as the run's config."""

    def __init__(self, run_dir: str | Path, cfg: LoggingConfig | None = None, config: dict | None = None):
        cfg = cfg or LoggingConfig()
        validate_backends(cfg)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.console = "console" in cfg.logger
        self._files = {
            "grpo": open(self.run_dir / "metrics.jsonl", "a", buffering=1),
            "sft": open(self.run_dir / "sft_metrics.jsonl", "a", buffering=1),
        }
        self._traces = open(self.run_dir / "traces.jsonl", "a", buffering=1)
        self._val_traces = None  # val_traces.jsonl, opened at the first validation that writes
        self._tensorboard = None
        if "tensorboard" in cfg.logger:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        self._wandb = self._start_wandb(cfg, config) if "wandb" in cfg.logger else None
        self._wandb_keys: set[str] = set()

    def _start_wandb(self, cfg: LoggingConfig, config: dict | None):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        run = wandb.init(project=cfg.project_name, name=cfg.experiment_name or self.run_dir.resolve().name, dir=str(self.run_dir),
                         config=config, mode=mode)
        if mode in ("offline", "dryrun"):
            log.info("W&B offline: upload the run later with `wandb sync %s`", Path(run.dir).parent)
        return run

    def log(self, metrics: dict, phase: str = "grpo") -> None:
        metrics = verl_names(metrics, phase)
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in metrics.items()}
        self._files[phase].write(json.dumps(clean) + "\n")
        step = metrics.get("step")
        if self._tensorboard is not None:
            for key, value in _scalars(metrics).items():
                self._tensorboard.add_scalar(key, value, global_step=step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._log_wandb(metrics, phase, step)
        if self.console:
            parts = [f"[{phase} step {step}]"]
            keys = _CONSOLE_KEYS if phase == "grpo" else [(k, k.split("/")[-1]) for k in sorted(metrics) if k.startswith("train/")]
            parts += [f"{short}={metrics[k]:.4g}" for k, short in keys if isinstance(metrics.get(k), (int, float))]
            parts += [f"{k.removeprefix('val-core/')}={v:.3f}" for k, v in sorted(metrics.items()) if k.startswith("val-core/") and "/mean@" in k]
            print(" ".join(parts), file=sys.stderr, flush=True)

    def _log_wandb(self, metrics: dict, phase: str, step) -> None:
        # W&B wants one increasing step per run, but the SFT warm-up and GRPO each count from 1:
        # each metric is plotted against its phase's own step (verl's training/global_step for GRPO).
        step_key = "training/global_step" if phase == "grpo" else "train/global_step"
        row = {**_scalars(metrics), step_key: step}
        for key in row.keys() - self._wandb_keys:
            if key != step_key:
                self._wandb.define_metric(key, step_metric=step_key)
            self._wandb_keys.add(key)
        self._wandb.log(row)

    def trace(self, step: int, trajectories, decode=None, data_sources: list[str] | None = None) -> None:
        """Write full trajectories: ids, masks, messages, per-turn texts, tool calls with their
        status and output, errors, reward and timings; `decode(ids)` adds the decoded prompt.
        With `data_sources` (one per trajectory) they are validation trajectories, written to
        val_traces.jsonl with their data source."""
        if data_sources is not None and self._val_traces is None:
            self._val_traces = open(self.run_dir / "val_traces.jsonl", "a", buffering=1)
        out = self._traces if data_sources is None else self._val_traces
        for i, t in enumerate(trajectories):
            row = {"step": step, **msgspec.to_builtins(t)}
            if t.routes is not None:  # MoE routes: their shape, not megabytes of expert indices
                row["routes"] = {"start": t.routes.start, "positions": len(t.routes.array()), "layers": t.routes.layers, "top_k": t.routes.top_k}
            if data_sources is not None:
                row["data_source"] = data_sources[i]
            if decode is not None:
                row["prompt_text"] = decode(t.prompt_ids)
            out.write(json.dumps(row) + "\n")

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._traces.close()
        if self._val_traces is not None:
            self._val_traces.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            wandb.teardown()  # stops wandb-core, which may still be writing the run's .wandb file when finish() returns
