"""RL prompt data: raytool's own row schema, and reading / writing it as parquet or jsonl.

A prompt row is what one GRPO group (or one evaluation problem) starts from:
- `prompt`: the chat messages before the first assistant turn ({role, content});
- `ground_truth`: the answer the reward checks against, as text;
- `data_source`: the data set's name (`dapo_math_17k`, `aime_2024`, `gsm8k`, ...): metrics are
  reported per source and reward fns may pick an answer convention by it;
- `agent_name`: the agent loop that runs it (None: `agent.default_agent`);
- `tools`: OpenAI function schemas the prompt offers (None: the run's tools);
- `extra_info`: anything else (the original index, the split, ...), handed to the reward fn.

verl's RL parquet rows are read as they are: their ground truth is `reward_model.ground_truth`
(verl's `ability` and `reward_model.style` are not used), and `extra_info` keeps verl's
`tools_kwargs` (each tool's `create_kwargs` for this row) and `interaction_kwargs`.

Parquet stores `prompt` as a list of {role, content} structs and `tools` / `extra_info` as JSON
strings (a struct column would give every row the union of all rows' keys). `raytool preprocess`
writes this schema; `data.train_files` / `data.val_files` and `raytool eval --data` read it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import msgspec

from raytool.data.rows import BadRow, DataError, convert_rows, json_list, json_object, kind, read_rows
from raytool.types import Message


class PromptRow(msgspec.Struct, kw_only=True):
    prompt: list[Message]
    ground_truth: str
    data_source: str
    agent_name: str | None = None
    tools: list[dict] | None = None
    extra_info: dict = {}
    ground_truth_json: bool = False  # the data set's ground truth was a list or an object (verl's may be), held as its JSON text: verl reward fns get the object
    origin: str = ""  # where it was read ('FILE row N (0-based)'), for errors that name the row; not written back


def rows_to_table(rows: list[PromptRow]):
    import pyarrow as pa

    return pa.table({
        "prompt": [[{"role": m.role, "content": m.content} for m in r.prompt] for r in rows],
        "ground_truth": [r.ground_truth for r in rows],
        "data_source": [r.data_source for r in rows],
        "agent_name": pa.array([r.agent_name for r in rows], pa.string()),
        "tools": pa.array([json.dumps(r.tools) if r.tools is not None else None for r in rows], pa.string()),
        "extra_info": [json.dumps(r.extra_info, sort_keys=True, default=str) for r in rows],
        "ground_truth_json": [r.ground_truth_json for r in rows],
    })


def write_prompt_rows(path: str | Path, rows: list[PromptRow]) -> Path:
    """Write rows as .parquet (or .jsonl, one JSON object per line), creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_bytes(b"".join(msgspec.json.encode({k: v for k, v in msgspec.to_builtins(r).items() if k != "origin"}) + b"\n" for r in rows))
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        pq.write_table(rows_to_table(rows), path)
    else:
        raise DataError(f"{path}: write prompt rows as .parquet or .jsonl, not '{path.suffix}'")
    return path


def _row(raw, origin: str = "") -> PromptRow:
    if not isinstance(raw, dict):
        raise BadRow(f"a row must be an object, got {kind(raw)}")
    if raw.get("ground_truth") in (None, "") and raw.get("reward_model") not in (None, ""):  # verl's schema
        raw = {**raw, "ground_truth": json_object(raw["reward_model"], "reward_model").get("ground_truth")}
    missing = [k for k in ("prompt", "ground_truth", "data_source") if raw.get(k) in (None, "")]
    if missing:
        raise BadRow(f"missing {', '.join(repr(k) for k in missing)}")
    messages = []
    for i, m in enumerate(json_list(raw["prompt"], "prompt")):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool") or not isinstance(m.get("content"), str):
            raise BadRow(f"prompt[{i}] must be {{role: system|user|assistant|tool, content: str}}, got {str(m)[:80]}")
        messages.append(Message(m["role"], m["content"]))
    if not messages or messages[-1].role not in ("user", "tool"):
        raise BadRow("prompt must end with a user (or tool) message: the model answers it")
    tools = raw.get("tools")
    tools = json_list(tools, "tools") if tools not in (None, "") else None
    extra = json_object(raw.get("extra_info") or {}, "extra_info")
    return PromptRow(
        prompt=messages, ground_truth=_text(raw["ground_truth"]), data_source=str(raw["data_source"]),
        agent_name=raw.get("agent_name") or None, tools=tools, extra_info=extra, origin=origin,
        ground_truth_json=isinstance(raw["ground_truth"], (list, dict)) or bool(raw.get("ground_truth_json")),
    )


def _text(value) -> str:
    """A ground truth as text: verl's may be a number, or a list of accepted answers (kept as JSON)."""
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def load_prompt_rows(path: str | Path) -> tuple[list[PromptRow], list[str]]:
    """The usable prompt rows of a .parquet / .jsonl / .json file and one line per skipped row
    (`FILE row N: what is wrong`). Raises DataError when the file cannot be read or no row is usable."""
    path = Path(path)
    return convert_rows(path, read_rows(path), _row, "usable prompt row")


def load_prompt_files(paths: list[str]) -> list[PromptRow]:
    """Every usable row of every file, in order (bad rows are reported and skipped)."""
    return [row for path in paths for row in load_prompt_rows(path)[0]]


def with_system_prompt(messages: list[Message], system_prompt: str | None) -> list[Message]:
    """`messages` with their system message replaced by `system_prompt` (added if there is none);
    unchanged when `system_prompt` is None."""
    if system_prompt is None:
        return messages
    rest = messages[1:] if messages and messages[0].role == "system" else messages
    return [Message("system", system_prompt), *rest]


def drop_too_long(rows: list[PromptRow], prompt_tokens: Callable[[PromptRow], int], context: int, response_budget: int,
                  what: str, max_prompt: int | None = None, overlong: str = "drop") -> tuple[list[PromptRow], str]:
    """The rows whose prompt (`prompt_tokens(row)`: its length as the agent renders it) is at most
    `max_prompt` tokens (data.max_prompt_tokens; None: no such limit) and leaves room for
    `response_budget` tokens within the engine's `context` -> (those rows, one warning line naming
    the others, or "" when none was dropped). With `overlong` "error" the first such row raises
    DataError naming it. A prompt that cannot fit would be rejected by the engine on every try;
    left in, it would cost a group's rollouts each time it is drawn."""
    kept, dropped = [], []
    for i, row in enumerate(rows):
        n = prompt_tokens(row)
        over = n + response_budget > context or (max_prompt is not None and n > max_prompt)
        if over and overlong == "error":
            limit = (f"data.max_prompt_tokens={max_prompt}" if max_prompt is not None and n > max_prompt else
                     f"the engine's context of {context} tokens (rollout.max_model_len) with agent.max_response_tokens={response_budget} after it")
            raise DataError(f"{what}: {row.origin or f'row {i}'}: a prompt of {n} tokens is over {limit} (data.overlong_prompts=error; "
                            "drop leaves such prompts out)")
        (dropped if over else kept).append((i, n, row))
    if not dropped:
        return rows, ""
    named = ", ".join(f"{i} ({n} tokens)" for i, n, _ in dropped[:10]) + (f" and {len(dropped) - 10} more" if len(dropped) > 10 else "")
    limits = f"over data.max_prompt_tokens={max_prompt} or " if max_prompt is not None else ""
    line = (f"{what}: {len(dropped)} of {len(rows)} prompts left out: a prompt {limits}with agent.max_response_tokens={response_budget} after it "
            f"does not fit the engine's context of {context} tokens (rollout.max_model_len); rows {named}")
    return [row for _, _, row in kept], line
