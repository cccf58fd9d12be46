"""What a run prints: the lines raytool writes for the console (a start banner, progress bars, a
line per step, the validation lines, the end summary), raytool's warnings and every error. The
rest (raytool's other information, vLLM's, Ray's and Python's warnings) goes to RUN_DIR/run.log
and Ray's per-actor logs. `logging.console_level=all` (`-v`) shows everything as it comes."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import warnings
from pathlib import Path

from raytool.evaluation import source_name
from raytool.types import ACC_THRESHOLD

OWN_LOGGERS = ("raytool", "actors", "__main__")
VERBOSE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
log = logging.getLogger(__name__)  # the console's own lines: `show`
CONSOLE = {"console": True}  # `log.info(..., extra=CONSOLE)`: an information line of another module the console shows too


def show(lines: list[str]) -> None:
    """Lines for the console (and run.log)."""
    for line in lines:
        log.info(line)


class OwnLines(logging.Filter):
    """The console's lines (`show`, or a record logged with extra=CONSOLE), raytool's warnings, and anyone's error."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or record.name == __name__ or getattr(record, "console", False):
            return True
        return record.levelno >= logging.WARNING and record.name.split(".")[0] in OWN_LOGGERS


class ConsoleFormat(logging.Formatter):
    """raytool's information as plain lines; a warning or error says so, an error from another
    program also whose it is."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info and record.levelno >= logging.ERROR:
            message += "\n" + self.formatException(record.exc_info)
        if record.levelno < logging.WARNING:
            return message
        source = "" if record.name.split(".")[0] in OWN_LOGGERS else f" ({record.name})"
        return f"{record.levelname.lower()}{source}: {message}"


@contextlib.contextmanager
def configured(verbose: bool):
    """The driver's console while the block runs: raytool's own lines (or, `verbose`, every record
    in the full format). Python warnings become log records (`py.warnings`), so that they reach
    run.log rather than the console. The logging setup before it comes back after it (a CLI
    command run in a process that goes on, as tests do). Ray's own driver logger is routed where
    the driver attaches to Ray (actors.drivers.session.connect)."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, warnings.showwarning)
    root.setLevel(logging.INFO)
    for handler in saved[0]:  # the plain console handler logging.basicConfig installed
        if type(handler) is logging.StreamHandler:
            root.removeHandler(handler)
    console = logging.StreamHandler(sys.stderr)
    if verbose:
        console.setFormatter(logging.Formatter(VERBOSE_FORMAT))
    else:
        console.addFilter(OwnLines())
        console.setFormatter(ConsoleFormat())
    root.addHandler(console)
    warnings.showwarning = _log_warning
    try:
        yield
    finally:
        root.removeHandler(console)
        for handler in saved[0]:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(saved[1])
        warnings.showwarning = saved[2]


def _log_warning(message, category, filename, lineno, file=None, line=None) -> None:
    logging.getLogger("py.warnings").warning("%s", warnings.formatwarning(message, category, filename, lineno, line).rstrip())


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def validation_means(row: dict) -> dict[str, float]:
    """{data source's metric segment (raytool.evaluation.source_segment): acc/mean@n} of one metrics row's validation."""
    out = {}
    for key, value in row.items():
        if key.startswith("val-core/") and "/acc/mean@" in key:
            out[key.split("/")[1]] = value
    return out


def summary(run_dir: Path, wall_s: float, final_hf: str | None = None) -> list[str]:
    """The lines a finished run ends on, from its metrics.jsonl: steps and wall time, the reward over
    the first and last third of the GRPO steps, held-out accuracy and tool calls per trajectory
    before and after training (where the run validated then), where the model is, what to run next."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    steps = [r for r in rows if r.get("step", 0) > 0]
    sft = Path(run_dir) / "sft_metrics.jsonl"
    sft_steps = len(sft.read_text().splitlines()) if sft.is_file() else 0
    minutes, seconds = divmod(round(wall_s), 60)
    lines = [f"done: {len(steps)} GRPO steps" + (f" after {sft_steps} SFT warm-up steps" if sft_steps else "")
             + f" in {minutes} min {seconds:02d} s"]
    if steps:
        third = max(1, len(steps) // 3)
        first = _mean([r.get("critic/score/mean") for r in steps[:third]])
        last = _mean([r.get("critic/score/mean") for r in steps[-third:]])
        span = ("step 1", f"step {len(steps)}") if third == 1 else (f"steps 1-{third}", f"steps {len(steps) - third + 1}-{len(steps)}")
        lines.append(f"reward (mean score): {_fmt(first)} over {span[0]} -> {_fmt(last)} over {span[1]}")
    validated = [r for r in rows if validation_means(r)]
    if validated:
        before, after = validated[0], validated[-1]
        for source in validation_means(after) | validation_means(before):
            b, a = validation_means(before).get(source), validation_means(after).get(source)
            n = next((k.rsplit("@", 1)[1] for k in after if k.startswith(f"val-core/{source}/acc/mean@")), "n")
            if before is after:
                lines.append(f"held-out accuracy ({source_name(source)}, mean@{n}): {_fmt(a)} at step {after['step']}")
            else:
                lines.append(f"held-out accuracy ({source_name(source)}, mean@{n}): {_fmt(b)} at step {before['step']} -> {_fmt(a)} at step {after['step']}")
        if after.get("val-aux/acc_from_score") or before.get("val-aux/acc_from_score"):
            lines.append(f"(accuracy: score >= {ACC_THRESHOLD:g} where the reward gives no `acc` of its own)")
        calls = [r.get("val-aux/tool/calls_per_traj") for r in (before, after)]
        if any(c is not None for c in calls):
            lines.append(f"tool calls per held-out trajectory: {_fmt(calls[0])} -> {_fmt(calls[1])}" if before is not after
                         else f"tool calls per held-out trajectory: {_fmt(calls[1])}")
    if final_hf:
        lines.append(f"final model: {Path(final_hf).parent} (checkpoint), {final_hf} (Hugging Face format)")
    lines.append(f"next: raytool report {run_dir}   (curves and trajectories in the browser)")
    if final_hf:
        lines.append(f"      raytool eval --model {run_dir}   (its final model on the held-out set, or on --data FILE)")
    return lines


ROLE_NAMES = {"RolloutServer": "rollout server", "TrainerWorker": "trainer rank", "AgentLoopWorker": "agent worker",
              "RewardWorker": "reward worker", "SandboxPool": "sandbox pool", "LLMManager": "LLM manager", "GatewayActor": "gateway"}


def _count(n: int, name: str) -> str:
    return f"{n} {name}" + ("" if n == 1 else ("es" if name.endswith("s") else "s"))


def banner(cfg, model_path: str, run_dir: Path) -> list[str]:
    """The first lines of a run, before its actors start: the model and its dtypes, the engine, the
    plan of steps, the run directory (with `placement`'s, at most 8 lines)."""
    t, r = cfg.trainer, cfg.rollout
    # auto follows the device as model.dtype's auto does (resolved on the driver): bf16 where it computes natively
    compute = cfg.model.dtype if t.compute_dtype == "auto" and cfg.model.dtype in ("bfloat16", "float32") else t.compute_dtype
    plan = (f"  plan: {t.sft_warmup_steps} SFT warm-up steps, then " if t.sft_warmup_steps else "  plan: ") + \
        f"{t.total_steps} GRPO steps of {cfg.data.prompts_per_step} prompts x {r.n} samples"
    if cfg.distill.teacher:
        plan += f", each token scored by the teacher {cfg.distill.teacher} (on-policy distillation)"
    if cfg.eval.before_train or cfg.eval.after_train:
        when = "before and after" if cfg.eval.before_train and cfg.eval.after_train else "before" if cfg.eval.before_train else "after"
        plan += f"; held-out accuracy {when} training"
    return [f"raytool: {cfg.model.path} ({model_path})",
            f"  trainer: compute {compute}, fp32 weights and optimizer" + (f", LoRA rank {t.lora_rank}" if t.lora_rank else "")
            + f"; engine: {r.engine}, {cfg.model.dtype} weights",
            plan,
            f"  run directory: {run_dir}   (other programs' lines: run.log; -v shows them here)"]


def placement(actors_by_node: dict[str, dict[str, int]], dashboard: str | None) -> list[str]:
    """At most 4 lines once the actors run: which run on each node (`actors_by_node`: node address
    -> {actor class name: count}; beyond 3 nodes the rest are counted), and the dashboard."""
    order = list(ROLE_NAMES)
    nodes = sorted(actors_by_node.items())
    shown = nodes if len(nodes) <= 3 else nodes[:2]
    lines = []
    for node, counts in shown:
        kinds = sorted(counts, key=lambda name: order.index(name) if name in order else len(order))
        lines.append(f"  on {node}: " + ", ".join(_count(counts[name], ROLE_NAMES.get(name, name)) for name in kinds))
    if len(nodes) > len(shown):
        lines.append(f"  and {len(nodes) - len(shown)} more nodes (the dashboard lists them)")
    if dashboard:
        lines.append(f"  dashboard: {dashboard}")
    return lines
