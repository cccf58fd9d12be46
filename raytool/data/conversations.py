"""Multi-turn SFT conversations: load and check rows from jsonl / json / parquet, tokenize them as the
agent loop would (loss on assistant tokens only), cut them to a length, split off a validation set.

A row is one conversation:
- `messages`: a list of {role: system|user|assistant|tool, content: str}. An assistant message may
  carry `tool_calls`, each {name, arguments} or OpenAI's {id, type: function, function: {name,
  arguments}}, with `arguments` an object or a string holding one; its `content` may then be null.
  It may carry `reasoning_content` (the reasoning before its answer or calls). A tool message's
  `tool_call_id` is kept (Kimi's and Mistral's templates write it); its `name` is not used.
- `tools` (optional): OpenAI function schemas {type: function, function: {name, description,
  parameters}} (a bare {name, ...} schema is wrapped in that form). In parquet, store `tools` and
  tool-call `arguments` as JSON strings: a struct column gives every row the union of all rows' keys.
- `messages` or `tools` may be a JSON string holding the list. Other columns are kept in `extra`.

A turn given in parts (`tool_calls`, `reasoning_content`) is trained as the text the model of
`agent.format` generates for it (`raytool.agent.turns`): Hermes/Qwen `<tool_call>` JSON for
hermes, `<code>` blocks for retool (code_interpreter calls only), each family's own form for the
others. So what the model learns is what that format's parser reads at rollout; a turn the format
cannot write (a call to another tool under retool, reasoning where the format has none) is a row
error naming it. The chat template gets the turn in parts for the prompts and observations around
it. Retool-format data (`<code>` blocks, `<interpreter>` output) is already text and is used as it is.

Rows are located as `FILE line N` (jsonl / json lines: 1-based line) or `FILE row N (0-based)`
(parquet, or the items of a .json file holding one array).
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import msgspec
from jinja2 import TemplateError

from raytool.agent.render import ChatRenderer, RenderError
from raytool.agent.turns import TurnError
from raytool.data.rows import BadRow, DataError, convert_rows, json_list, kind, read_rows, warn_each
from raytool.errors import one_line
from raytool.types import Message, SFTExample

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
_CALL_FORMS = '{"name": ..., "arguments": {...}} or {"type": "function", "function": {"name": ..., "arguments": ...}}'


class Conversation(msgspec.Struct):
    """One SFT conversation; `source` says where it came from (`FILE line N` / `FILE row N (0-based)`)."""

    messages: list[Message]
    tools: list[dict] | None = None
    source: str = ""
    extra: dict = {}


# --- checking rows -------------------------------------------------------------------------------


def _tool_calls(value, where: str) -> list[dict]:
    """The calls in OpenAI's form, arguments as an object ({id, type: function, function: {name, arguments}}; id where given)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadRow(f"{where}.tool_calls must be a list of calls ({_CALL_FORMS}), got {kind(value)}")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) and isinstance(call.get("function"), dict) else call
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise BadRow(f"{at} must be {_CALL_FORMS} with a non-empty name")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                raise BadRow(f"{at} ('{fn['name']}'): arguments are not valid JSON "
                              f"({exc.msg} at column {exc.colno})") from None
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise BadRow(f"{at} ('{fn['name']}'): arguments must be a JSON object, got {kind(args)}")
        ident = call.get("id") if isinstance(call, dict) and isinstance(call.get("id"), str) and call["id"] else None
        calls.append({**({"id": ident} if ident else {}), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return calls


def _optional_text(value: dict, key: str, where: str) -> str | None:
    text = value.get(key)
    if text is not None and not isinstance(text, str):
        raise BadRow(f"{where}.{key} must be a string, got {kind(text)}")
    return text


def _message(value, i: int) -> Message:
    where = f"messages[{i}]"
    if not isinstance(value, dict):
        raise BadRow(f"{where} must be an object with 'role' and 'content', got {kind(value)}")
    role = value.get("role")
    if role not in ROLES:
        raise BadRow(f"{where} has role {role!r}; expected one of {', '.join(ROLES)}")
    calls = _tool_calls(value.get("tool_calls"), where)
    if calls and role != "assistant":
        raise BadRow(f"{where} is a {role} message with tool_calls; only assistant messages call tools")
    content = value.get("content")
    if content is None and calls:  # OpenAI's form of a turn that only calls tools
        content = ""
    if not isinstance(content, str):
        raise BadRow(f"{where} ({role}) content must be a string, got {kind(content)}")
    if calls and "<tool_call>" in content:
        raise BadRow(f"{where} has tool_calls and also <tool_call> text in its content; give the calls one way")
    reasoning = _optional_text(value, "reasoning_content", where)
    if reasoning is not None and role != "assistant":
        raise BadRow(f"{where} is a {role} message with reasoning_content; only assistant messages reason")
    call_id = _optional_text(value, "tool_call_id", where) if role == "tool" else None
    return Message(role, content, tool_calls=calls or None, reasoning_content=reasoning, tool_call_id=call_id)


def _tools(value) -> list[dict] | None:
    if value is None:
        return None
    tools = []
    for j, tool in enumerate(json_list(value, "tools")):
        if isinstance(tool, dict) and "function" not in tool and isinstance(tool.get("name"), str):
            tool = {"type": "function", "function": tool}  # a bare function schema
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRow(f"tools[{j}] must be an OpenAI function schema "
                          '{"type": "function", "function": {"name": ..., "parameters": {...}}}')
        tools.append(tool)
    return tools or None


def _conversation(row, source: str) -> Conversation:
    if not isinstance(row, dict):
        raise BadRow(f"a row must be an object with 'messages', got {kind(row)}")
    if row.get("messages") is None:
        raise BadRow(f"no 'messages' (the row has: {', '.join(sorted(row)) or 'nothing'})")
    raw = json_list(row["messages"], "messages")
    messages = [_message(m, i) for i, m in enumerate(raw)]
    first_reply = next((i for i, m in enumerate(messages) if m.role == "assistant"), None)
    if first_reply is None:
        raise BadRow("no assistant message, so nothing to train on")
    if first_reply == 0:
        raise BadRow("messages[0] is the first assistant message and nothing comes before it; a reply needs a prompt")
    extra = {k: v for k, v in row.items() if k not in ("messages", "tools")}
    return Conversation(messages=messages, tools=_tools(row.get("tools")), source=source, extra=extra)


def load_conversations(path: str | Path) -> tuple[list[Conversation], list[str]]:
    """The usable conversations of a .jsonl / .json / .parquet file, and one line per skipped row
    (`FILE line N: what is wrong`). Raises DataError when the file cannot be read or no row is usable."""
    path = Path(path)
    return convert_rows(path, read_rows(path), _conversation, "usable conversation")


# --- tokenizing ----------------------------------------------------------------------------------


def sft_examples(conversations: list[Conversation], tokenizer, max_length: int,
                 template_kwargs: dict | None = None, fmt: str | None = None) -> tuple[list[SFTExample], dict]:
    """Each conversation tokenized by a `ChatRenderer` for its tools (loss on assistant tokens only;
    turns given in parts written as a model of tool-call format `fmt` writes them (None: hermes);
    one example, or one per user turn where the template re-renders earlier turns), each cut to
    `max_length` tokens, and stats: `count`, `truncated`, `dropped` (no assistant token within
    `max_length`), `unrenderable` (the chat template rejected it), `mean_tokens`, `loss_tokens`."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    renderers: dict[str, ChatRenderer] = {}  # by the tools' JSON: the template lists them in the prompt
    examples, problems = [], []
    truncated = dropped = 0
    for conv in conversations:
        key = json.dumps(conv.tools, sort_keys=True)
        if key not in renderers:
            renderers[key] = ChatRenderer(tokenizer, conv.tools, template_kwargs, fmt)
        try:
            tokenized = renderers[key].sft_examples(conv.messages)
        except (TemplateError, RenderError) as exc:  # e.g. a template that requires alternating roles
            problems.append(f"{conv.source}: the chat template cannot render it ({one_line(exc)})")
            continue
        except TurnError as exc:  # a turn the tool-call format cannot write (agent.format)
            problems.append(f"{conv.source}: {' '.join(str(exc).split())}")
            continue
        for ex in tokenized:
            if len(ex.input_ids) > max_length:
                ex = SFTExample(input_ids=ex.input_ids[:max_length], loss_mask=ex.loss_mask[:max_length])
                if not any(ex.loss_mask):
                    dropped += 1
                    continue
                truncated += 1
            examples.append(ex)
    warn_each(problems, "the SFT data")
    if not examples:
        raise DataError(f"no SFT example from {len(conversations)} conversations: {dropped} examples have no "
                        f"assistant token within max_length={max_length}, {len(problems)} conversations could not be rendered"
                        + (f" (first: {problems[0]})" if problems else ""))
    lengths = [len(ex.input_ids) for ex in examples]
    stats = {"count": len(examples), "truncated": truncated, "dropped": dropped, "unrenderable": len(problems),
             "mean_tokens": sum(lengths) / len(lengths), "loss_tokens": sum(sum(ex.loss_mask) for ex in examples)}
    log.info("SFT data: %d examples (%d truncated to %d tokens, %d dropped, %d unrenderable), %.0f tokens on average",
             stats["count"], truncated, max_length, dropped, len(problems), stats["mean_tokens"])
    return examples, stats


def split_validation(
    conversations: list[Conversation], size: float | int, seed: int = 0,
) -> tuple[list[Conversation], list[Conversation]]:
    """(train, validation): `size` conversations (an int) or that fraction of them (a float in [0, 1),
    at least one when > 0) picked by `seed`; both keep the input order."""
    n = len(conversations)
    if isinstance(size, bool) or not isinstance(size, (int, float)):
        raise TypeError(f"validation size must be a count (int) or a fraction (float), got {size!r}")
    if isinstance(size, float):
        if not 0.0 <= size < 1.0:
            raise ValueError(f"validation fraction must be in [0, 1), got {size}")
        count = max(round(n * size), 1) if size > 0 else 0
    else:
        count = size
    if not 0 <= count < n:
        raise ValueError(f"a validation set of {count} leaves no training conversation out of {n}")
    picked = set(random.Random(seed).sample(range(n), count))
    train = [c for i, c in enumerate(conversations) if i not in picked]
    val = [c for i, c in enumerate(conversations) if i in picked]
    return train, val
