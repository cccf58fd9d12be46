"""An assistant turn in each tool-call format: written from its parts, and read back into them.

`turn_text(fmt, message)` is the text a model of format `fmt` generates for an assistant message
given in parts (`reasoning_content`, `tool_calls` in OpenAI's form): what the format's own chat
template writes after its generation prompt, up to the end-of-turn token
(`tests/test_families.py` checks each against its template). SFT trains on it, so a trace in
OpenAI's form teaches the model the calls its format's parser reads at rollout. A message without
parts is its content, as written.

`structured_turn(fmt, text)` reads a generated turn back into parts, for the formats whose chat
templates take a turn only in parts (`STRUCTURED`): Kimi-K2 writes a turn's reasoning from
`reasoning_content` and its calls, with their ids, from `tool_calls`; Mistral writes the calls
with their ids from `tool_calls` and each tool result with its `tool_call_id`. The agent loop records
the turn so, the chat template then renders it as it was generated; None where the text does not
split so (the loop records the turn's text).
"""

from __future__ import annotations

import hashlib
import json
import re

from raytool.agent.families import DS_CALL_BEGIN, DS_CALL_END, DS_CALL_SEP, DS_CALLS_BEGIN, DS_CALLS_END, FORMATS, harmony_messages
from raytool.types import Message

STRUCTURED = frozenset({"kimi_k2", "mistral", "gpt_oss"})
ARGUMENTS_AS_TEXT = frozenset({"deepseek"})  # templates that concatenate a call's arguments: give them JSON text
REASONING_KEY = {"gpt_oss": "thinking"}  # the message key a format's template reads a turn's reasoning from
# Where a format's template writes a turn's end as another token than the model generates (harmony:
# a call the model ends with <|call|> is written ending in <|end|>), the tokens that may end a turn.
TEMPLATE_TURN_ENDS = {"gpt_oss": ("<|end|>", "<|call|>")}
# Formats whose turns have no end-of-turn token of their own: the model stops on the next role's
# token, which the template writes with the next message (GLM: <|observation|> before tool output,
# <|user|> otherwise).
NEXT_ROLE_ENDS = {"glm45": FORMATS["glm45"].stop}  # the tokens the engine stops its turns on
_HARMONY_CALL_END = "<|call|>"

_KIMI = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
         "<|tool_calls_section_end|>")
_DS = (DS_CALLS_BEGIN, DS_CALL_BEGIN, DS_CALL_SEP, DS_CALL_END, DS_CALLS_END)


class TurnError(ValueError):
    """A message the format cannot write as a turn (the message says which part and why)."""


def template_dict(message: Message | dict, fmt: str | None = None) -> dict:
    """A message as format `fmt`'s chat template takes it: the reasoning under the key it reads
    (harmony's `thinking`), a call's arguments as JSON text where it concatenates them (DeepSeek)."""
    d = message if isinstance(message, dict) else message.as_dict()
    if fmt in REASONING_KEY and "reasoning_content" in d:
        d = {REASONING_KEY[fmt] if k == "reasoning_content" else k: v for k, v in d.items()}
    if fmt in ARGUMENTS_AS_TEXT and d.get("tool_calls"):
        d = {**d, "tool_calls": [{**c, "function": {**c["function"], "arguments": _json(c["function"]["arguments"])}}
                                 if "arguments" in c.get("function", {}) else c for c in d["tool_calls"]]}
    return d


def call_id(seed: str, index: int) -> str:
    """A call id for a format that needs one where the model wrote none: 9 alphanumeric characters
    (Mistral's templates refuse shorter ones), the same for the same seed and index."""
    return hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:9]


def _function(call: dict) -> tuple[str, object]:
    fn = call.get("function", call)
    return fn["name"], fn.get("arguments", {})


def _json(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _object(arguments) -> dict:
    return json.loads(arguments) if isinstance(arguments, str) else dict(arguments or {})


def _jinja_string(value) -> str:
    """A value as Jinja's `string` filter writes it (Qwen3-Coder's template: True, None, 2.5)."""
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list)) else str(value)


def _qwen_think(reasoning: str) -> str:
    return f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n"


def _hermes(content: str, calls: list[dict]) -> str:
    blocks = [f"<tool_call>\n{json.dumps({'name': name, 'arguments': _object(args)}, ensure_ascii=False)}\n</tool_call>"
              for name, args in map(_function, calls)]
    return "\n".join([content, *blocks] if content else blocks)


def _qwen3_coder(content: str, calls: list[dict]) -> str:
    blocks = []
    for name, args in map(_function, calls):
        params = "".join(f"<parameter={k}>\n{_jinja_string(v)}\n</parameter>\n" for k, v in _object(args).items())
        blocks.append(f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>")
    head = content.strip() + "\n\n" if content.strip() else ""
    return head + "\n".join(blocks)


def _glm45(content: str, calls: list[dict]) -> str:
    text = "\n" + content.strip() if content.strip() else ""
    for name, args in map(_function, calls):
        pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</arg_value>"
                        for k, v in _object(args).items())
        text += f"\n<tool_call>{name}{pairs}</tool_call>"
    return text


def _llama3_json(content: str, calls: list[dict]) -> str:
    if content.strip():
        raise TurnError("Llama 3.1's template writes a turn that calls a tool without its content; give the content in a turn of its own")
    return "; ".join(f'{{"name": "{name}", "parameters": {json.dumps(_object(args), ensure_ascii=False)}}}' for name, args in map(_function, calls))


def _deepseek(content: str, calls: list[dict]) -> str:
    begin, call, sep, end, close = _DS
    return content + begin + "".join(f"{call}{name}{sep}{_json(args)}{end}" for name, args in map(_function, calls)) + close


_KIMI_ID = re.compile(r"functions\.(.+):\d+", re.DOTALL)


def _kimi_id(call: dict, name: str, index: int) -> str:
    """A Kimi call's id: functions.NAME:IDX, which its models write and its parsers read the name from
    (an id of another form, e.g. OpenAI's call_..., is replaced by that)."""
    named = _KIMI_ID.fullmatch(call.get("id") or "")
    return call["id"] if named is not None and named.group(1) == name else f"functions.{name}:{index}"


def _kimi(content: str, calls: list[dict]) -> str:
    section, begin, argument, end, close = _KIMI
    body = "".join(f"{begin}{_kimi_id(c, name, i)}{argument}{_json(args)}{end}"
                   for i, (c, (name, args)) in enumerate(zip(calls, map(_function, calls))))
    return content + section + body + close


def _mistral(content: str, calls: list[dict]) -> str:
    items = []
    for i, (c, (name, args)) in enumerate(zip(calls, map(_function, calls))):
        ident = c.get("id") or call_id(json.dumps(calls, sort_keys=True, default=str), i)
        items.append(json.dumps({"name": name, "arguments": _object(args)}, ensure_ascii=False)[:-1] + f', "id": "{ident[-9:]}"}}')
    return content + "[TOOL_CALLS] [" + ", ".join(items) + "]"


def _gpt_oss(message: Message) -> str:
    """Harmony as gpt-oss's template writes a turn after its generation prompt (<|start|>assistant):
    the reasoning (or, in a turn that calls, the content) on the analysis channel, then the call
    (`to=functions.NAME` in the header, JSON arguments; one per turn) or the final answer."""
    calls, reasoning, content = message.tool_calls or [], message.reasoning_content, message.content
    if len(calls) > 1:
        raise TurnError("gpt-oss's template writes one call per turn; give each call a turn of its own")
    if calls and content and reasoning:
        raise TurnError("gpt-oss's template takes a turn that calls a tool with its reasoning or its content as analysis, not both")
    analysis = reasoning if reasoning is not None else (content if calls else None)
    text = f"<|channel|>analysis<|message|>{analysis}<|end|><|start|>assistant" if analysis else ""
    if calls:
        name, args = _function(calls[0])
        return text + f" to=functions.{name}<|channel|>commentary json<|message|>{json.dumps(_object(args), ensure_ascii=False)}" + _HARMONY_CALL_END
    return text + f"<|channel|>final<|message|>{content}"


def _retool(content: str, calls: list[dict]) -> str:
    blocks = []
    for name, args in map(_function, calls):
        code = _object(args).get("code")
        if name != "code_interpreter" or not isinstance(code, str):
            raise TurnError(f"agent.format retool writes calls to code_interpreter (a 'code' string) only, not to '{name}': "
                            "set agent.format to the model's own tool-call format (hermes, a family's, or auto)")
        blocks.append(f"<code>\n```python\n{code}\n```\n</code>")
    return "\n".join([content, *blocks] if content else blocks)


# format -> (how it writes its calls after the content, how it writes reasoning before it; None: it has none)
_WRITERS = {
    "hermes": (_hermes, _qwen_think), "retool": (_retool, _qwen_think), "qwen3_coder": (_qwen3_coder, _qwen_think),
    "glm45": (_glm45, None), "llama3_json": (_llama3_json, None), "deepseek": (_deepseek, None),
    "kimi_k2": (_kimi, lambda r: f"<think>{r}</think>"), "mistral": (_mistral, None),
}


def turn_text(fmt: str | None, message: Message) -> str:
    """The text a model of format `fmt` (None: hermes) generates for `message` (see the module
    docstring). Raises TurnError where the format has no way to write one of its parts."""
    if fmt == "gpt_oss":  # harmony: every turn is written on its channels
        return _gpt_oss(message)
    if message.tool_calls is None and message.reasoning_content is None:
        return message.content
    fmt = fmt or "hermes"
    if fmt not in _WRITERS:
        raise TurnError(f"agent.format {fmt} does not write turns given as tool_calls / reasoning_content yet; give the turn as text")
    write_calls, write_reasoning = _WRITERS[fmt]
    if fmt == "glm45":  # GLM writes a reasoning block, empty where there is none, before every such turn
        return f"\n<think>{(message.reasoning_content or '').strip()}</think>" + write_calls(message.content, message.tool_calls or [])
    text = write_calls(message.content, message.tool_calls) if message.tool_calls else message.content
    if message.reasoning_content is None:
        return text if fmt != "kimi_k2" else "<think></think>" + text
    if write_reasoning is None:
        raise TurnError(f"agent.format {fmt} has no reasoning in a turn; the message's reasoning_content cannot be written")
    return write_reasoning(message.reasoning_content) + text


def closes_itself(fmt: str | None, text: str) -> bool:
    """Whether a turn's text (turn_text's) ends with its own end-of-turn token, not the tokenizer's
    end of sequence: a harmony call ends with <|call|>."""
    return (fmt == "gpt_oss" and text.endswith(_HARMONY_CALL_END)) or (fmt in NEXT_ROLE_ENDS and text.endswith(NEXT_ROLE_ENDS[fmt]))


# --- reading a generated turn back into parts ------------------------------------------------------


def _split_kimi(text: str) -> Message | None:
    section, begin, argument, end, close = _KIMI
    reasoning = None
    if text.startswith("<think>"):
        at = text.find("</think>")
        if at < 0:
            return None
        reasoning, text = text[len("<think>"):at], text[at + len("</think>"):]
    at = text.find(section)
    if at < 0:
        return None if reasoning is None else Message("assistant", text, reasoning_content=reasoning)
    content, body = text[:at], text[at + len(section):]
    if not body.endswith(close):
        return None
    body, calls = body[: -len(close)], []
    while body:
        if not body.startswith(begin) or (stop := body.find(end)) < 0:
            return None
        head, sep, arguments = body[len(begin):stop].partition(argument)
        named = _KIMI_ID.fullmatch(head)
        if not sep or named is None:
            return None
        calls.append({"id": head, "type": "function", "function": {"name": named.group(1), "arguments": arguments}})
        body = body[stop + len(end):]
    return Message("assistant", content, tool_calls=calls or None, reasoning_content=reasoning)


def _split_mistral(text: str, seed: str) -> Message | None:
    content, sep, rest = text.partition("[TOOL_CALLS]")
    if not sep:
        return None
    try:
        items = json.loads(rest)
    except (ValueError, RecursionError):
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", {}), dict):
            return None
        ident = item.get("id") if isinstance(item.get("id"), str) and len(item["id"]) >= 9 else call_id(seed, i)
        calls.append({"id": ident, "type": "function", "function": {"name": item["name"], "arguments": item.get("arguments", {})}})
    return Message("assistant", content, tool_calls=calls)


def _split_gpt_oss(text: str) -> Message | None:
    parts = harmony_messages(text)
    reasoning = None
    if parts and "<|channel|>analysis" in parts[0][0]:
        reasoning = parts.pop(0)[1]
    if len(parts) != 1:
        return None
    header, body, _ = parts[0]
    called = re.search(r"to=functions\.([^\s<]+)", header)
    if called is None:
        return Message("assistant", body, reasoning_content=reasoning) if "<|channel|>final" in header else None
    try:
        arguments = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(arguments, dict):
        return None
    return Message("assistant", "", reasoning_content=reasoning,
                   tool_calls=[{"type": "function", "function": {"name": called.group(1), "arguments": arguments}}])


def structured_turn(fmt: str, text: str, seed: str = "") -> Message | None:
    """The message in parts for generated turn `text` (decoded with its special tokens, without its
    end-of-turn token) of a STRUCTURED format; None where it does not split so. Mistral calls
    without a usable id get `call_id(seed, i)`."""
    if fmt == "kimi_k2":
        return _split_kimi(text)
    if fmt == "mistral":
        return _split_mistral(text, seed)
    if fmt == "gpt_oss":
        return _split_gpt_oss(text)
    return None
