r"""Tool-call formats of the model families people train, each a parser behind `agent.format`, and
`auto`: the format a chat template writes, told from the markers in it.

| agent.format  | family                        | what the model writes                                                      |
|---------------|-------------------------------|----------------------------------------------------------------------------|
| `llama3_json` | Llama 3.1 / 3.2 / 3.3         | `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` or alone), several joined by `;` |
| `mistral`     | Mistral, Mixtral, Magistral   | `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` or `[TOOL_CALLS]NAME[ARGS]{...}` |
| `qwen3_coder` | Qwen3-Coder, Qwen3.5          | `<tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>` |
| `glm45`       | GLM-4.5 / 4.6                 | `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>value</arg_value></tool_call>` |
| `kimi_k2`     | Kimi-K2                       | `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>` |
| `deepseek`    | DeepSeek-V3.1 (and V3 / R1)   | `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` (V3: `function<｜tool▁sep｜>NAME` and a ```json fence) |
| `gpt_oss`     | gpt-oss (harmony)             | `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` |

Every parser shares `raytool.agent.parsers`' contract: calls and typed errors in text order, never
an exception, linear in the text (str.find scans and `json.JSONDecoder.raw_decode`). JSON bodies get
the same unambiguous repairs as Hermes calls. The XML formats (qwen3_coder, glm45) carry argument
values as text: each is typed from the tool's schema (integer, number, boolean, object, array; a
string stays as written, one leading and trailing newline trimmed), and without a schema, or where
the text does not read as the type, stays a string (`check_arguments` then tells the model).

The formats whose markers are special tokens (`SPECIAL_MARKERS`) are parsed from the turn decoded
with its special tokens, and the message recorded for the turn keeps them (the trace's text shows
the turn without them). Kimi-K2's and Mistral's turns are recorded in parts, and each format writes
a turn given in parts as its models generate it: `raytool.agent.turns`.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from typing import Callable

from raytool.agent.parsers import (PARSERS, ParseResult, ToolError, call_error, json_type, loads_json, shorten, strip_fence, tagged_bodies,
                                   tool_call_bodies)
from raytool.types import ToolCall

log = logging.getLogger(__name__)

Schemas = dict[str, dict]  # tool name -> its OpenAI function schema


def _object_call(name: str, raw: str, fmt: str, hint: str) -> tuple[ToolCall | ToolError, bool]:
    """A call to `name` whose arguments are the JSON object `raw` (repaired as Hermes bodies are)."""
    name = name.strip()
    if not name:
        return call_error("malformed_call", f"a {fmt} call has no tool name. {hint}"), False
    if not raw.strip():
        return ToolCall(name=name, arguments={}), False
    inner, fenced = strip_fence(raw)
    value, repaired, problem = loads_json(inner)
    if problem:
        return call_error("invalid_json", f"the arguments of the call to '{shorten(name)}' are not valid JSON ({problem}). {hint}"), False
    if not isinstance(value, dict):
        return call_error("wrong_argument_type", f"the arguments of the call to '{shorten(name)}' must be a JSON object, got "
                      f"{json_type(value)}. {hint}"), False
    return ToolCall(name=name, arguments=value), repaired or fenced


def _named_object(obj, fmt: str, hint: str, args_keys: tuple[str, ...]) -> tuple[ToolCall | ToolError, bool]:
    """{"name": ..., <one of args_keys>: {...}} as a call."""
    if not isinstance(obj, dict):
        return call_error("invalid_json", f"a {fmt} call must be a JSON object, got {json_type(obj)}. {hint}"), False
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return call_error("invalid_json", f'the call has no "name" string naming the tool. {hint}'), False
    key = next((k for k in args_keys if k in obj), None)
    args = obj.get(key, {}) if key else {}
    repaired = False
    if isinstance(args, str):
        decoded, _, problem = loads_json(args) if args.strip() else ({}, False, None)
        if problem is None and isinstance(decoded, dict):
            args, repaired = decoded, True
    if not isinstance(args, dict):
        return call_error("wrong_argument_type", f'"{key}" of the call to \'{shorten(name)}\' must be a JSON object, got {json_type(args)}. {hint}'), False
    return ToolCall(name=name, arguments=args), repaired


def _json_sequence(text: str, separators: str) -> tuple[list, str | None]:
    """The JSON values at the start of `text`, one after another, `separators` and whitespace
    between them -> (values, what is wrong with the rest, or None)."""
    decoder, values, pos, n = json.JSONDecoder(), [], 0, len(text)
    while True:
        while pos < n and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos >= n:
            return values, None
        try:
            value, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):
            rest = text[pos:]
            value, _, problem = loads_json(rest)  # the repairs, or a message that says where it fails
            if problem is not None:
                return values, problem
            values.append(value)
            return values, None
        values.append(value)


def _guarded(fmt: str, parse: Callable[[str, Schemas | None], ParseResult]) -> Callable[[str, Schemas | None], ParseResult]:
    """Nothing a model writes escapes a parser: a parser bug shows in the log, the model gets an error."""
    def guarded(text: str, schemas: Schemas | None = None) -> ParseResult:
        try:
            return parse(text, schemas)
        except Exception as exc:
            log.warning("%s parser: the turn could not be parsed: %s: %s", fmt, type(exc).__name__, exc)
            result = ParseResult()
            result.add(call_error("malformed_call", f"the tool calls could not be read ({type(exc).__name__}: {shorten(str(exc), 60)})."))
            return result
    guarded.__name__ = f"parse_{fmt}"
    guarded.__doc__ = parse.__doc__
    return guarded


# --- Llama 3.x -----------------------------------------------------------------------------------

_LLAMA_HINT = 'Write {"name": "...", "parameters": {...}}.'


_SPECIAL_TOKEN = re.compile(r"<\|[A-Za-z0-9_]{1,40}\|>")


def _without_closing_tokens(text: str) -> str:
    """`text` without the special tokens that end it (<|eom_id|>, <|eot_id|>: the turn decoded with
    its special tokens ends on one). Linear: each step removes one token from the end."""
    end = len(text)
    while True:
        while end > 0 and text[end - 1].isspace():
            end -= 1
        start = text.rfind("<|", 0, end) if text.endswith("|>", 0, end) else -1
        if start < 0 or not _SPECIAL_TOKEN.fullmatch(text, start, end):
            return text[:end]
        end = start


def _parse_llama3_json(text: str, schemas: Schemas | None) -> ParseResult:
    """A turn that is JSON (after an optional <|python_tag|>) is its calls; any other turn is an answer."""
    result = ParseResult()
    body = _without_closing_tokens(text).strip()
    tagged = body.startswith("<|python_tag|>")
    body = body.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        if tagged and body:
            result.add(call_error("invalid_json", f"after <|python_tag|> comes a JSON call. {_LLAMA_HINT}"))
        return result
    values, problem = _json_sequence(body, ";")
    for value in values:
        item, repaired = _named_object(value, "Llama", _LLAMA_HINT, ("parameters", "arguments"))
        result.add(item)
        result.repaired += repaired
    if problem is not None:
        result.add(call_error("invalid_json", f"the call is not valid JSON ({problem}). {_LLAMA_HINT}"))
    return result


# --- Mistral -------------------------------------------------------------------------------------

_MISTRAL_HINT = 'Write [TOOL_CALLS][{"name": "...", "arguments": {...}}].'


def _parse_mistral(text: str, schemas: Schemas | None) -> ParseResult:
    """Each [TOOL_CALLS] opens a JSON array of calls (v3 tokenizers) or NAME[ARGS]{...} (v11 and later)."""
    result = ParseResult()
    parts = text.split("[TOOL_CALLS]")
    for part in parts[1:]:
        part = part.strip()
        if not part:
            result.add(call_error("empty_call", f"[TOOL_CALLS] is followed by no call. {_MISTRAL_HINT}"))
        elif part.startswith("["):
            calls, repaired, problem = loads_json(_first_json(part))  # the array, without the end-of-turn token after it
            if problem is not None:
                result.add(call_error("invalid_json", f"the calls are not valid JSON ({problem}). {_MISTRAL_HINT}"))
                continue
            for value in calls if isinstance(calls, list) else [calls]:
                item, fixed = _named_object(value, "Mistral", _MISTRAL_HINT, ("arguments", "parameters"))
                result.add(item)
                result.repaired += fixed or repaired
        else:
            head, sep, args = part.partition("[ARGS]")
            if not sep:
                result.add(call_error("malformed_call", f"the call to '{shorten(head)}' has no [ARGS]. Write [TOOL_CALLS]NAME[ARGS]{{...}}."))
                continue
            item, repaired = _object_call(head.split("[CALL_ID]")[0], _first_json(args), "Mistral", "Write [TOOL_CALLS]NAME[ARGS]{...}.")
            result.add(item)
            result.repaired += repaired
    return result


def _first_json(text: str) -> str:
    """The JSON value `text` starts with, without what follows it (an end-of-turn token, a space);
    all of `text` where it does not start with one that reads (the repairs then tell the model)."""
    stripped = text.lstrip()
    try:
        _, end = json.JSONDecoder().raw_decode(stripped)
    except (ValueError, RecursionError):
        return text
    return stripped[:end]


# --- XML parameters: Qwen3-Coder and GLM-4.5 -----------------------------------------------------

def _typed(value: str, spec: dict | None):
    """An XML argument's text as its schema's type says; as written where there is no schema or it does not read."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    types = (spec or {}).get("type")
    types = types if isinstance(types, list) else [types]
    stripped = value.strip()
    for kind in types:
        if kind == "integer" and re.fullmatch(r"[+-]?\d{1,4000}", stripped):
            return int(stripped)
        if kind == "number":
            try:
                number = float(stripped)
            except ValueError:
                continue
            if math.isfinite(number):  # not nan or inf: no JSON number
                return int(stripped) if re.fullmatch(r"[+-]?\d{1,4000}", stripped) else number
        if kind == "boolean" and stripped.lower() in ("true", "false"):
            return stripped.lower() == "true"
        if kind == "null" and stripped.lower() in ("null", "none"):
            return None
        if kind in ("object", "array"):
            decoded, _, problem = loads_json(stripped)
            if problem is None and isinstance(decoded, dict if kind == "object" else list):
                return decoded
    return value


def _properties(schemas: Schemas | None, name: str) -> dict:
    function = (schemas or {}).get(name, {}).get("function", {})
    return function.get("parameters", {}).get("properties", {}) if isinstance(function, dict) else {}


def _xml_pairs(body: str, open_key: str, close_key: str, open_value: str | None, close_value: str) -> list[tuple[str, str | None]]:
    """(key, value) pairs of one call's body. Qwen3-Coder: <parameter=KEY>value</parameter>
    (`open_value` None: the key ends at '>'); GLM: <arg_key>KEY</arg_key><arg_value>value</arg_value>.
    A value never closed runs to the next key (None when there is no value at all)."""
    pairs, i = [], body.find(open_key)
    while i >= 0:
        start = i + len(open_key)
        if open_value is None:
            end_key = body.find(">", start)
            if end_key < 0:
                pairs.append((body[start:].strip(), None))
                break
            key, vstart = body[start:end_key], end_key + 1
        else:
            end_key = body.find(close_key, start)
            if end_key < 0:
                pairs.append((body[start:].strip(), None))
                break
            key = body[start:end_key]
            vopen = body.find(open_value, end_key)
            nxt = body.find(open_key, end_key)
            if vopen < 0 or 0 <= nxt < vopen:
                pairs.append((key.strip(), None))
                i = nxt
                continue
            vstart = vopen + len(open_value)
        vend = body.find(close_value, vstart)
        nxt = body.find(open_key, vstart)
        if vend < 0 or 0 <= nxt < vend:
            vend = nxt if nxt >= 0 else len(body)
            i = nxt
        else:
            i = body.find(open_key, vend)
        pairs.append((key.strip(), body[vstart:vend]))
    return pairs


def _xml_call(name: str, pairs: list[tuple[str, str | None]], schemas: Schemas | None, fmt: str, hint: str) -> ToolCall | ToolError:
    if not name:
        return call_error("malformed_call", f"a {fmt} call names no tool. {hint}")
    properties = _properties(schemas, name)
    arguments = {}
    for key, value in pairs:
        if not key:
            return call_error("malformed_call", f"an argument of the call to '{shorten(name)}' has no name. {hint}")
        if value is None:
            return call_error("malformed_call", f"argument '{shorten(key)}' of the call to '{shorten(name)}' has no value. {hint}")
        arguments[key] = _typed(value, properties.get(key))
    return ToolCall(name=name, arguments=arguments)


_QWEN_HINT = "Write <tool_call>\n<function=NAME>\n<parameter=KEY>\nvalue\n</parameter>\n</function>\n</tool_call>."


def _parse_qwen3_coder(text: str, schemas: Schemas | None) -> ParseResult:
    """Each <tool_call> holds <function=NAME> blocks of <parameter=KEY>value</parameter>."""
    result = ParseResult()
    for body in tool_call_bodies(text, result, _QWEN_HINT):
        i = body.find("<function=")
        if i < 0:
            result.add(call_error("malformed_call", f"the <tool_call> has no <function=NAME>. {_QWEN_HINT}"))
        while i >= 0:
            start = i + len("<function=")
            end_name = body.find(">", start)
            if end_name < 0:
                result.add(call_error("malformed_call", f"<function= is not closed by '>'. {_QWEN_HINT}"))
                break
            nxt = body.find("<function=", end_name)
            end = body.find("</function>", end_name)
            stop = min(x for x in (end, nxt, len(body)) if x >= 0)
            name = body[start:end_name].strip()
            if "<" in name or "\n" in name:  # <function=NAME without its '>': the next tag's '>' closed it
                result.add(call_error("malformed_call", f"<function={shorten(name.split(chr(10))[0])} is not closed by '>'. {_QWEN_HINT}"))
            else:
                pairs = _xml_pairs(body[end_name + 1:stop], "<parameter=", ">", None, "</parameter>")
                result.add(_xml_call(name, pairs, schemas, "Qwen3-Coder", _QWEN_HINT))
            i = nxt
    return result


_GLM_HINT = "Write <tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>value</arg_value>\n</tool_call>."


def _parse_glm45(text: str, schemas: Schemas | None) -> ParseResult:
    """Each <tool_call> is NAME, then <arg_key>KEY</arg_key><arg_value>value</arg_value> pairs."""
    result = ParseResult()
    for body in tool_call_bodies(text, result, _GLM_HINT):
        first = body.find("<arg_key>")
        name = (body if first < 0 else body[:first]).strip()
        pairs = _xml_pairs(body, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>") if first >= 0 else []
        result.add(_xml_call(name, pairs, schemas, "GLM", _GLM_HINT))
    return result


# --- Kimi-K2 and DeepSeek: special-token sections ------------------------------------------------

_KIMI_HINT = "Write <|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>."


def _parse_kimi_k2(text: str, schemas: Schemas | None) -> ParseResult:
    """Each <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>."""
    result = ParseResult()
    for body in tagged_bodies(text, "<|tool_call_begin|>", "<|tool_call_end|>"):
        if body is None:
            result.add(call_error("unterminated_tag", f"<|tool_call_begin|> was opened but never closed. {_KIMI_HINT}"))
            continue
        head, sep, raw = body.partition("<|tool_call_argument_begin|>")
        if not sep:
            result.add(call_error("malformed_call", f"the call has no <|tool_call_argument_begin|>. {_KIMI_HINT}"))
            continue
        name = head.strip().removeprefix("functions.")
        name = name.rsplit(":", 1)[0] if re.fullmatch(r".*:\d+", name) else name
        item, repaired = _object_call(name, raw, "Kimi", _KIMI_HINT)
        result.add(item)
        result.repaired += repaired
    return result


DS_CALL_BEGIN, DS_CALL_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"  # around a turn's calls
_DS_HINT = f"Write {DS_CALL_BEGIN}NAME{DS_CALL_SEP}{{...}}{DS_CALL_END}."


def _parse_deepseek(text: str, schemas: Schemas | None) -> ParseResult:
    """Each <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜> (V3.1), or V3/R1's
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>."""
    result = ParseResult()
    for body in tagged_bodies(text, DS_CALL_BEGIN, DS_CALL_END):
        if body is None:
            result.add(call_error("unterminated_tag", f"{DS_CALL_BEGIN} was opened but never closed. {_DS_HINT}"))
            continue
        head, sep, rest = body.partition(DS_CALL_SEP)
        if not sep:
            result.add(call_error("malformed_call", f"the call has no {DS_CALL_SEP}. {_DS_HINT}"))
            continue
        if head.strip() == "function" and not rest.lstrip().startswith("{"):  # V3 / R1: the JSON in a fence, by format (no repair)
            name, _, raw = rest.partition("\n")
            raw = strip_fence(raw)[0]
        else:
            name, raw = head, rest
        item, repaired = _object_call(name, raw, "DeepSeek", _DS_HINT)
        result.add(item)
        result.repaired += repaired
    return result


# --- gpt-oss (harmony) ---------------------------------------------------------------------------

_HARMONY_HINT = "Write <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>."
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


def harmony_messages(text: str) -> list[tuple[str, str, bool]]:
    """(header, body, ended) of each message of a harmony turn: the header is what comes before its
    <|message|> (channel, recipient, constraint), the body runs to <|call|>, <|end|>, <|return|> or
    the next <|start|>; `ended` says whether one of those ended it."""
    messages, pos, n = [], 0, len(text)
    while True:
        m = text.find("<|message|>", pos)
        if m < 0:
            return messages
        start = text.rfind("<|start|>", pos, m)
        header = text[(start + len("<|start|>")) if start >= 0 else pos:m]
        body_start = m + len("<|message|>")
        ends = [(i, tok) for tok in ("<|call|>", "<|end|>", "<|return|>", "<|start|>") if (i := text.find(tok, body_start)) >= 0]
        end, token = min(ends) if ends else (n, "")
        messages.append((header, text[body_start:end], bool(token)))
        pos = end + (len(token) if token != "<|start|>" else 0)
        if not token:
            return messages


def _parse_gpt_oss(text: str, schemas: Schemas | None) -> ParseResult:
    """Each message addressed `to=functions.NAME` is a call; its body is the JSON arguments."""
    result = ParseResult()
    for header, body, ended in harmony_messages(text):
        recipient = _RECIPIENT.search(header)
        if recipient is None:
            continue
        item, repaired = _object_call(recipient.group(1), body, "harmony", _HARMONY_HINT)
        if not ended and isinstance(item, ToolError):  # cut short (a call whose <|call|> the engine kept out of the text still reads)
            item = call_error("unterminated_tag", f"the call to '{shorten(recipient.group(1))}' never ended with <|call|>. {_HARMONY_HINT}")
        result.add(item)
        result.repaired += repaired
    # A header addressed to a function whose message never began (the turn was cut there).
    last = text.rfind("<|message|>")
    ended = max(text.rfind(token) for token in ("<|call|>", "<|end|>", "<|return|>"))
    tail = text[ended:] if ended > last else ("" if last >= 0 else text)
    if (cut := _RECIPIENT.search(tail)) is not None:
        result.add(call_error("unterminated_tag", f"the call to '{shorten(cut.group(1))}' has no <|message|>. {_HARMONY_HINT}"))
    return result


# --- the registry and `auto` ---------------------------------------------------------------------

@dataclass(frozen=True)
class Format:
    name: str
    parse: Callable[[str, Schemas | None], ParseResult]
    markers: tuple[str, ...]  # any of these in a chat template: the template writes this format (auto)
    special_markers: bool  # its markers are special tokens: parse the turn decoded with them
    call_start: tuple[str, ...]  # where a turn's calls begin: the text before the first is its content (the gateway)
    stop: tuple[str, ...] = ()  # tokens that end a turn of calls besides the tokenizer's end of sequence


FORMATS = {f.name: f for f in (
    Format("kimi_k2", _guarded("kimi_k2", _parse_kimi_k2), ("<|tool_calls_section_begin|>", "<|tool_call_begin|>"), True,
           ("<|tool_calls_section_begin|>", "<|tool_call_begin|>")),
    Format("deepseek", _guarded("deepseek", _parse_deepseek), (DS_CALL_BEGIN, "tool▁call▁begin"), True, (DS_CALLS_BEGIN, DS_CALL_BEGIN)),
    Format("gpt_oss", _guarded("gpt_oss", _parse_gpt_oss), ("<|channel|>", "to=functions."), True, ("<|start|>", "<|channel|>"),
           ("<|call|>",)),
    Format("qwen3_coder", _guarded("qwen3_coder", _parse_qwen3_coder), ("<function=", "<parameter="), False, ("<tool_call>",)),
    Format("glm45", _guarded("glm45", _parse_glm45), ("<arg_key>",), False, ("<tool_call>",), ("<|observation|>", "<|user|>")),
    Format("mistral", _guarded("mistral", _parse_mistral), ("[TOOL_CALLS]",), True, ("[TOOL_CALLS]",)),
    Format("llama3_json", _guarded("llama3_json", _parse_llama3_json), ("<|python_tag|>", '"parameters"'), True, ("<|python_tag|>", "{"),
           ("<|eom_id|>",)),
)}
SPECIAL_MARKERS = frozenset(name for name, f in FORMATS.items() if f.special_markers)
# `auto` looks for these in this order: the families whose calls also sit in <tool_call> tags
# (Qwen3-Coder, GLM) before Hermes, and Hermes before Llama, whose marker '"parameters"' a
# Hermes template may hold in its prose.
_DETECT_ORDER = ("kimi_k2", "deepseek", "gpt_oss", "qwen3_coder", "glm45", "mistral", "hermes", "llama3_json")


def stop_token_ids(fmt: str, tokenizer) -> tuple[int, ...]:
    """The ids of format `fmt`'s own end-of-call tokens that `tokenizer` has (gpt-oss's <|call|>,
    Llama's <|eom_id|>): vLLM stops only on what it is told (raytool samples with
    generation_config='vllm'), and a harmony call must end at its <|call|>."""
    tokens = FORMATS[fmt].stop if fmt in FORMATS else ()
    ids = [tokenizer.convert_tokens_to_ids(token) for token in tokens]
    return tuple(i for token, i in zip(tokens, ids) if i is not None and tokenizer.convert_ids_to_tokens(i) == token)


def get_parser(name: str, schemas: Schemas | None = None) -> Callable[[str], ParseResult]:
    """The parser of format `name` (retool, hermes: raytool.agent.parsers; or a family above);
    `schemas` types the arguments of the XML formats."""
    if name in PARSERS:
        return PARSERS[name]
    if name in FORMATS:
        parse = FORMATS[name].parse
        return lambda text: parse(text, schemas)
    raise ValueError(f"unknown tool parser '{name}'; expected one of {sorted([*PARSERS, *FORMATS])}")


def detect(chat_template: str | None) -> str | None:
    """The tool-call format `chat_template` writes (a key of FORMATS, or hermes), None when nothing
    in it says."""
    template = chat_template or ""
    for name in _DETECT_ORDER:
        markers = ("<tool_call>",) if name == "hermes" else FORMATS[name].markers
        if any(marker in template for marker in markers):
            return name
    return None


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, the rest) of a turn: what precedes </think> (Qwen3-style templates open <think> in
    the prompt), or a harmony turn's analysis channel against its final channel."""
    if "<|channel|>" in text and "<|message|>" in text:
        messages = harmony_messages(text)
        reasoning = "\n".join(body for header, body, _ in messages if "<|channel|>analysis" in header)
        final = "\n".join(body for header, body, _ in messages if "<|channel|>final" in header)
        return reasoning.strip(), final.strip()
    head, sep, rest = text.partition("</think>")
    if not sep:
        return "", text.strip()
    return head.replace("<think>", "", 1).strip(), rest.strip()


def describe(text: str, fmt: str, schemas: Schemas | None = None) -> dict:
    """What raytool reads in one model output under format `fmt`: its calls, typed errors, how many
    calls needed a repair, the reasoning and the rest (`raytool parse-tools`)."""
    parsed = get_parser(fmt, schemas)(text)
    reasoning, rest = split_reasoning(text)
    items = [{"call": {"name": i.name, "arguments": i.arguments}} if isinstance(i, ToolCall) else {"error": {"kind": i.kind, "message": i.message}}
             for i in parsed.items()]
    return {"format": fmt, "items": items, "calls": len(parsed.calls), "errors": len(parsed.errors), "repaired": parsed.repaired,
            "reasoning": reasoning, "text": rest}


def describe_table(found: dict) -> str:
    """`describe`'s result as lines for a terminal."""
    lines = [f"format: {found['format']}   calls: {found['calls']}   errors: {found['errors']}   repaired: {found['repaired']}"]
    for n, item in enumerate(found["items"], start=1):
        if "call" in item:
            lines.append(f"{n:>3}  call   {item['call']['name']}  {json.dumps(item['call']['arguments'], ensure_ascii=False)}")
        else:
            lines.append(f"{n:>3}  error  {item['error']['kind']}: {item['error']['message']}")
    if found["reasoning"]:
        lines.append("reasoning: " + shorten(" ".join(found["reasoning"].split()), 200))
    return "\n".join(lines)
