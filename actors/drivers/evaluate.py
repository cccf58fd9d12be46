"""Validation on the actor graph: sample each prompt k times, score, summarize per data source.

`raytool eval` runs it on a model alone (no trainer); `raytool train` runs it on its schedule
(`eval.before_train`, `eval.every`) with the policy the rollout servers hold.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import ray

from actors.drivers.compose import Graph, build
from raytool.agent.loop import reward_view
from raytool import storage
from raytool.config import EvalConfig, RunConfig, load_config
from raytool.data.prompts import PromptRow, load_prompt_files
from raytool.data.task import load_task
from raytool.evaluation import EvalSample, summarize
from raytool.models import load_tokenizer, resolve_model
from raytool.rewards import check_judge, extract_answer, normalize_answer, validate_reward_fn
from raytool.types import Trajectory, accuracy

log = logging.getLogger(__name__)


def evaluate(graph: Graph, rows: list[PromptRow], ecfg: EvalConfig, prefix: str = "val", progress: str | None = "validation") -> tuple[dict, list[tuple[str, Trajectory]]]:
    """(metrics, (data source, trajectory) of each sample) of `ecfg.n` samples per row (the first
    `ecfg.max_prompts` rows)."""
    rows = rows[: ecfg.max_prompts] if ecfg.max_prompts else rows
    if not rows:
        raise ValueError("validation needs prompts: the validation set is empty (data.val_files / data.val_size)")
    sampling = {"temperature": ecfg.temperature, "top_p": ecfg.top_p}
    _, refs = graph.rollout(rows, f"{prefix}g", progress, n=ecfg.n, sampling=sampling, teach=False)  # a teacher's word would train nothing here
    groups = ray.get([r.trajectories for r in refs])
    samples, trajectories = [], []
    for i, (row, group) in enumerate(zip(rows, groups)):
        for t in group:
            answer = extract_answer(reward_view(t)["response"], row.data_source)  # majority votes count answers the same up to normalization
            acc, from_score = accuracy(t.reward, t.reward_extra)
            samples.append(EvalSample(
                data_source=row.data_source, prompt=i, acc=acc, acc_from_score=from_score, reward=t.reward,
                answer=normalize_answer(answer) if answer is not None else None, num_turns=t.num_turns, tool_calls=t.tool_calls,
                tool_errors=t.tool_errors, response_length=len(t.response_ids),
            ))
            trajectories.append((row.data_source, t))
    return summarize(samples, ecfg.n), trajectories


def eval_model_path(model: str, work_dir: Path) -> str:
    """An HF model directory for `--model`: a built-in name or HF directory as it is; a raytool
    checkpoint (or a run directory: its latest) through its `hf/` export, or exported into work_dir."""
    from actors.drivers.checkpoint import find_checkpoint

    path = Path(model)
    if not path.is_dir() or (path / "config.json").is_file():
        return resolve_model(model)
    checkpoint = find_checkpoint(path, load_config(str(path / "config.yaml")) if (path / "config.yaml").is_file() else None)
    hf = storage.join(checkpoint, "hf")
    if storage.exists(storage.join(hf, "config.json")):
        return hf if storage.is_local(hf) else str(storage.get_dir(hf, work_dir / "hf"))
    from raytool.training.export import export_checkpoint

    log.info("exporting %s to HF format for the engine", checkpoint)
    return str(export_checkpoint(checkpoint, work_dir / "hf"))


def run_eval(cfg: RunConfig, model: str, data_files: list[str], address: str | None = None) -> dict:
    """`raytool eval`: validation metrics of `model` on data_files (none: the config's validation set)."""
    from actors.agent_worker import build_toolset
    from actors.drivers.session import check_row_tools, connect
    from raytool.agent.registry import check_agents
    from raytool.agent.render import check_template_kwargs
    from raytool.data.task import Task

    validate_reward_fn(cfg.reward.fn)
    rows = load_prompt_files(data_files) if data_files else load_task(cfg).val
    check_agents(cfg.agent, rows)
    check_judge(cfg.reward, rows)
    with tempfile.TemporaryDirectory(prefix="raytool-eval-") as work_dir:
        model_path = eval_model_path(model, Path(work_dir))
        tokenizer = load_tokenizer(model_path)
        check_template_kwargs(tokenizer, cfg.agent.chat_template_kwargs)
        check_row_tools(build_toolset(cfg.agent, tokenizer, None), Task(train=[], val=rows))
        connect(address or cfg.cluster.address, log_to_driver=cfg.logging.console_level == "all")
        graph = build(cfg, model_path, with_trainer=False)
        try:
            start = time.perf_counter()
            metrics, _ = evaluate(graph, rows, cfg.eval, progress="eval" if cfg.logging.progress else None)
            metrics["timing/validation_s"] = time.perf_counter() - start
        finally:
            graph.shutdown()
    return metrics
