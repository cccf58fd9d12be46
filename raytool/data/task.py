"""What a run trains and validates on: prompt rows for GRPO and validation, and cold-start traces.

`data.task: tool_arith` generates them (raytool.data.tool_arith); `data.task: files` reads prompt
rows from `data.train_files` / `data.val_files` (`auto`, the default: files when any are named);
`data.task: verifiers` takes the dataset and eval dataset of the verifiers environment
`agent.environment` names (`auto` too when no files are named). The in-run SFT warm-up then reads
its conversations from `sft.train_files`. The start says in one line per file what it loaded (rows
used and skipped, and a warning naming each skipped row), or how many problems it generated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from raytool.config import RunConfig, prompt_source
from raytool.data import tool_arith
from raytool.data.prompts import PromptRow, load_prompt_files
from raytool.data.rows import DataError
from raytool.types import Message

log = logging.getLogger(__name__)


@dataclass
class Task:
    train: list[PromptRow]
    val: list[PromptRow]
    sft_traces: list[list[Message]] = field(default_factory=list)  # generated cold-start traces (tool_arith)
    too_long: int = 0  # training prompts left out because they cannot fit the engine's context with the response budget


def load_task(cfg: RunConfig) -> Task:
    """The run's data; a missing or unusable file stops here, before any actor starts."""
    data, system_prompt = cfg.data, cfg.agent.system_prompt
    source = prompt_source(data, cfg.agent.environment)
    if source == "files":  # config.validate made sure there are train files
        return Task(train=_prompt_files("data.train_files", data.train_files), val=_prompt_files("data.val_files", data.val_files))
    if source == "verifiers":
        from raytool.agent.verifiers_loop import environment_rows

        a = cfg.agent
        train = environment_rows(a.environment, dict(a.environment_args), "train")
        val = environment_rows(a.environment, dict(a.environment_args), "eval", cfg.eval.max_prompts)
        log.info("data: train %d and validation %d rows of the verifiers environment %s%s; its rubric scores them (not reward.fn)",
                 len(train), len(val), a.environment, "" if val else " (it has no eval dataset: no validation)")
        return Task(train=train, val=val)
    train, val = tool_arith.make_splits(data.train_size, data.val_size, data.seed)
    log.info("data: train %d and validation %d generated tool_arith problems (data.seed=%d; name data.train_files to train on yours)",
             len(train), len(val), data.seed)
    return Task(
        train=[tool_arith.prompt_row(p, system_prompt) for p in train],
        val=[tool_arith.prompt_row(p, system_prompt) for p in val],
        sft_traces=[tool_arith.sft_messages(p, system_prompt) for p in train if p.in_sft],
    )


def _prompt_files(key: str, paths: list[str]) -> list[PromptRow]:
    """Every usable row of the files of `key` (each file says in one line how many rows it gave and
    skipped, and warns naming each skipped row)."""
    try:
        return load_prompt_files(paths)
    except DataError as exc:
        raise DataError(f"config key '{key}': {exc}") from None
