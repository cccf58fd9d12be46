r"""Tool-call parsers: find tool calls in one assistant turn's text, repair what is unambiguous,
and describe the rest as `ToolError`s the model can read.

- `retool`: ReTool's code tags, <code>```python ...```</code>, each a `code_interpreter` call.
- `hermes`: Hermes/Qwen JSON, <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
- `check_arguments`: a call's arguments against its tool's OpenAI function schema.

A malformed call is not dropped: its `ToolError.message` goes back to the model as the tool's
answer (so the trajectory goes on and the model learns the format) and its `kind` (one of
`ERROR_KINDS`) is counted in the metrics.

Repairs to a <tool_call> body (each call that needed any counts once in `ParseResult.repaired`):
1. A code fence around the JSON (```json ... ```) is removed.
2. Inside JSON strings, a backslash that does not start a JSON escape is read as a literal
   backslash, i.e. the text as the model typed it (`"\d+"` for `"\\d+"`): `\sqrt`, `\d`, `\(`,
   `\$`, `\'`, and `\u` without four hex digits (`\underline`). Valid escapes are left alone.
3. Inside JSON strings, `\f`, `\b` and `\r` followed by an ASCII letter keep their backslash
   too: form feed, backspace and a carriage return before a letter are never what a model means,
   while `\frac`, `\forall`, `\beta`, `\boxed`, `\bar`, `\rho`, `\right` (LaTeX) and `\b`
   (a regex word boundary) are common. `\n` and `\t` are always newline and tab, whatever
   follows: code strings use them as real line breaks and indents (`"import x\nprint(x)"`), so
   `\nu` or `\theta` written without doubling the backslash stay a newline/tab (ambiguous).
   This rule applies even when the JSON is valid as written.
4. Raw control characters inside strings (a literal newline or tab) are escaped.
5. A trailing comma before `}` or `]` is dropped.
6. `arguments` given as a string holding a JSON object is decoded (with the same repairs);
   `parameters` in place of a missing `arguments` (Llama's spelling) is taken as `arguments`.
A call without `arguments` (nor `parameters`) gets `{}`. Anything else is an error.

All scanning is linear in the text (str.find and single-character regex searches), so no input
can make a parser slow, and no input can make one raise: whatever goes wrong decoding a call
(an integer of more than 4,300 digits, nesting deeper than the recursion limit, an unpaired
surrogate that could never be encoded) becomes a `ToolError` answered to the model.

The `retool` scan knows code fences: inside a <code> block whose code opens with a ``` fence, a
`</code>` or `<code>` before the closing fence is part of the code (a string literal), not a tag.
With `agent.observation_style: in_turn` generation stops at the first `</code>` (a stop string), so
a `</code>` inside the code's own strings still ends the block there: the code runs as cut, and
`ParseResult.cut_in_fence` counts such blocks (logged as `tool/cut_in_fence`).
"""

from __future__ import annotations

import json
import logging
import re
import textwrap
from dataclasses import dataclass, field
from typing import Callable, Iterator

from raytool.tools.base import ERROR_KINDS
from raytool.types import ToolCall

log = logging.getLogger(__name__)

_HERMES_FORMAT = 'Write {"name": "...", "arguments": {...}}.'


@dataclass
class ToolError:
    """A malformed tool call: `kind` (one of ERROR_KINDS) for the metrics, `message` for the model."""

    kind: str
    message: str

    def __post_init__(self):
        if self.kind not in ERROR_KINDS:
            raise ValueError(f"unknown tool error kind '{self.kind}'; expected one of {ERROR_KINDS}")

    def __str__(self) -> str:
        return self.message


def call_error(kind: str, text: str) -> ToolError:
    return ToolError(kind, f"Error ({kind}): {text}")


def shorten(text: str, limit: int = 40) -> str:
    """`text` cut to `limit` characters, to quote the model's words inside a message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _quote(value, limit: int = 30) -> str:
    """`value` as JSON, cut to `limit` characters."""
    return shorten(json.dumps(value, ensure_ascii=False, default=str), limit)


@dataclass
class ParseResult:
    """The calls and errors of one turn, and how many calls parsed only after a repair.

    `calls` and `errors` are each in text order; `order` says how they interleave ("call" or
    "error" per item) and `items()` walks both in the order they appear in the text.
    """

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[ToolError] = field(default_factory=list)
    repaired: int = 0
    order: list[str] = field(default_factory=list)
    cut_in_fence: int = 0  # <code> blocks whose ``` fence was still open at their </code> (retool)

    @property
    def any(self) -> bool:
        return bool(self.calls or self.errors)

    def add(self, item: ToolCall | ToolError) -> None:
        if isinstance(item, ToolError):
            self.errors.append(item)
            self.order.append("error")
        else:
            self.calls.append(item)
            self.order.append("call")

    def items(self) -> list[ToolCall | ToolError]:
        """Calls and errors in text order (calls first when built by hand without `order`)."""
        if not self.order:
            return [*self.calls, *self.errors]
        if len(self.order) != len(self.calls) + len(self.errors):
            raise ValueError(
                f"ParseResult.order has {len(self.order)} entries for {len(self.calls)} calls and "
                f"{len(self.errors)} errors; build it with add()"
            )
        calls, errors = iter(self.calls), iter(self.errors)
        return [next(calls) if kind == "call" else next(errors) for kind in self.order]


def tagged_bodies(text: str, open_tag: str, close_tag: str) -> Iterator[str | None]:
    """The body of each `open_tag` in text order, or None where it is never closed: no
    `close_tag` follows it before the next `open_tag`. Linear: each find resumes where it stopped."""
    i = text.find(open_tag)
    close = -1
    while i >= 0:
        start = i + len(open_tag)
        if close < start:  # the last close found is behind us (or none was looked for yet)
            close = text.find(close_tag, start)
            if close < 0:  # no close anywhere after this point: every tag from here is unclosed
                close = len(text) + 1
        nxt = text.find(open_tag, start)
        closed = close <= len(text) and not 0 <= nxt < close
        yield text[start:close] if closed else None
        i = nxt


_FENCE_INFO = re.compile(r"[A-Za-z0-9_.+-]*")
_FENCE_OPEN = re.compile(r"[ \t\r\n]*```")
# A closing fence: ``` at the start of a line, or right before </code> (`print(1)```</code>).
_FENCE_CLOSE = re.compile(r"\n[ \t]*```|```(?=[ \t\r\n]{0,8}</code>)")
_FENCED_CODE = re.compile(r"<code>[ \t\r\n]*```")


class _FirstMatch:
    """The first match of `pattern` at or after a position that only ever grows: a match found
    stays the answer until the position passes it, and "none" stays the answer for good, so a scan
    that asks at every block stays linear."""

    def __init__(self, pattern: re.Pattern, text: str):
        self.pattern, self.text = pattern, text
        self.match: re.Match | None = None
        self.exhausted = False

    def at_or_after(self, pos: int) -> re.Match | None:
        if self.exhausted:
            return None
        if self.match is None or self.match.start() < pos:
            self.match = self.pattern.search(self.text, pos)
            self.exhausted = self.match is None
        return self.match


def _code_blocks(text: str) -> Iterator[tuple[str | None, bool]]:
    """(body, cut_in_fence) of each <code> block in text order; body None where it is never closed.

    A block whose code opens with a ``` fence ends at the first `</code>` after its closing fence,
    so tags inside the fenced code's strings are code. Without a closing fence before the next
    fenced block, it ends at its first `</code>` and `cut_in_fence` is True. Linear: every search
    resumes past the last one (`_FirstMatch`)."""
    n = len(text)
    fences, fenced_blocks = _FirstMatch(_FENCE_CLOSE, text), _FirstMatch(_FENCED_CODE, text)
    close = -1  # the last </code> found (n + 1: none after it)
    i = text.find("<code>")
    while i >= 0:
        start = i + len("<code>")
        code_end, cut = start, False  # where the code's own text is known to end; the fence left open
        opening = _FENCE_OPEN.match(text, start)
        if opening is not None:
            fence, next_block = fences.at_or_after(opening.end()), fenced_blocks.at_or_after(opening.end())
            if fence is None or (next_block is not None and next_block.start() < fence.start()):
                cut = True
            else:
                code_end = fence.end()
        if close < code_end:
            close = text.find("</code>", code_end)
            if close < 0:
                close = n + 1
        nxt = text.find("<code>", code_end)
        if close <= n and not 0 <= nxt < close:
            yield text[start:close], cut
            i = text.find("<code>", close + len("</code>"))
        else:
            yield None, False
            i = nxt


def strip_fence(body: str) -> tuple[str, bool]:
    """The text inside a ``` fence (with or without a language name, closed or not), and whether
    there was one. Text after the closing fence is dropped."""
    s = body.strip()
    if not s.startswith("```"):
        return body, False
    s = s[3:]
    newline = s.find("\n")
    if newline >= 0 and _FENCE_INFO.fullmatch(s[:newline].strip()):
        s = s[newline + 1 :]
    end = s.rfind("```")
    return (s[:end] if end >= 0 else s), True


# --- JSON repair ---------------------------------------------------------------------------------

_STRING_SPECIAL = re.compile(r'["\\\x00-\x1f]')
_OUTSIDE_SPECIAL = re.compile(r'[",]')
_CLOSER_AHEAD = re.compile(r"\s*[}\]]")
_HEX4 = re.compile(r"[0-9A-Fa-f]{4}")
_CONTROL_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}


def _repair_json(s: str) -> tuple[str, list[tuple[int, int]]]:
    """`s` with repairs 2-5 of the module docstring applied, and anchors (repaired position,
    original position) at each edit, to point errors at what the model wrote."""
    out: list[str] = []
    out_len = 0
    anchors = [(0, 0)]
    copied = 0  # s[:copied] is already in `out`
    i, in_string = 0, False

    def edit(upto: int, replacement: str, resume: int):
        nonlocal out_len, copied
        out.append(s[copied:upto])
        out.append(replacement)
        out_len += upto - copied + len(replacement)
        copied = resume
        anchors.append((out_len, resume))

    while True:
        if in_string:
            m = _STRING_SPECIAL.search(s, i)
            if m is None:
                break
            j = m.start()
            c = s[j]
            if c == '"':
                in_string, i = False, j + 1
            elif c == "\\":
                nxt, after = s[j + 1 : j + 2], s[j + 2 : j + 3]
                latex = nxt in ("f", "b", "r") and after.isascii() and after.isalpha()  # \frac, \beta, \rho
                if nxt in ('"', "\\", "/", "n", "t", "f", "b", "r") and not latex:
                    i = j + 2
                elif nxt == "u" and _HEX4.match(s, j + 2):
                    i = j + 6
                else:  # not a JSON escape, or LaTeX: keep the backslash
                    edit(j, "\\\\", j + 1)
                    i = j + 1
            else:  # a raw control character inside a string
                edit(j, _CONTROL_ESCAPES.get(c, f"\\u{ord(c):04x}"), j + 1)
                i = j + 1
        else:
            m = _OUTSIDE_SPECIAL.search(s, i)
            if m is None:
                break
            j = m.start()
            if s[j] == '"':
                in_string = True
            elif _CLOSER_AHEAD.match(s, j + 1):  # a trailing comma
                edit(j, "", j + 1)
            i = j + 1
    if len(anchors) == 1:
        return s, anchors
    out.append(s[copied:])
    return "".join(out), anchors


def _where(s: str, anchors: list[tuple[int, int]], pos: int) -> str:
    """Line and column in the original `s` of position `pos` in its repaired text."""
    out_at, in_at = max((a for a in anchors if a[0] <= pos), default=(0, 0))
    orig = min(in_at + (pos - out_at), len(s))
    line = s.count("\n", 0, orig) + 1
    column = orig - (s.rfind("\n", 0, orig) + 1) + 1
    return f"line {line} column {column}"


def loads_json(s: str):
    """(value, repaired, None) or (None, False, 'what is wrong and where')."""
    fixed, anchors = _repair_json(s)
    try:
        value = json.loads(fixed)
    except json.JSONDecodeError as exc:
        return None, False, f"{exc.msg.removesuffix(' at')} at {_where(s, anchors, exc.pos)}"
    except RecursionError:
        return None, False, "nested too deeply"
    except ValueError as exc:  # e.g. an integer of more than 4,300 digits (Python's int conversion limit)
        return None, False, shorten(str(exc).split(";")[0], 80)
    try:  # a lone surrogate (\ud800) decodes to a str that can never be sent on as UTF-8
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return None, False, "a string holds an unpaired surrogate escape (\\ud800-\\udfff)"
    except RecursionError:
        return None, False, "nested too deeply"
    return value, len(anchors) > 1, None


_JSON_TYPE = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}


def json_type(value) -> str:
    return "null" if value is None else _JSON_TYPE.get(type(value), type(value).__name__)


# --- parsers -------------------------------------------------------------------------------------


def _hermes_call(body: str) -> tuple[ToolCall | ToolError, bool]:
    """One <tool_call> body as a call (and whether it needed a repair) or an error."""
    inner, fenced = strip_fence(body)
    obj, repaired, problem = loads_json(inner)
    if problem:
        return call_error("invalid_json", f"the <tool_call> body is not valid JSON ({problem}). {_HERMES_FORMAT}"), False
    if not isinstance(obj, dict):
        return call_error(
            "invalid_json",
            f"the <tool_call> body must be one JSON object, got {json_type(obj)}. {_HERMES_FORMAT[:-1]}, "
            "one per <tool_call>.",
        ), False
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return call_error("invalid_json", f'the call has no "name" string naming the tool. {_HERMES_FORMAT}'), False
    if "arguments" in obj:
        args = obj["arguments"]
    elif "parameters" in obj:
        args, repaired = obj["parameters"], True
    else:
        args = {}
    if isinstance(args, str):
        decoded, _, problem = loads_json(args) if args.strip() else ({}, False, None)
        if problem is None and isinstance(decoded, dict):
            args, repaired = decoded, True
    if not isinstance(args, dict):
        return call_error(
            "wrong_argument_type",
            f"\"arguments\" of the call to '{shorten(name)}' must be a JSON object, got {json_type(args)}. "
            + _HERMES_FORMAT,
        ), False
    return ToolCall(name=name, arguments=args), repaired or fenced


def tool_call_bodies(text: str, result: ParseResult, hint: str) -> Iterator[str]:
    """The body of each <tool_call>...</tool_call> that holds something; one never closed, or
    empty, is added to `result` as its error (`hint`: how a call is written). A call inside the
    turn's reasoning (before its </think>) is not run: it is answered with an error (the chat
    templates drop that reasoning from later prompts, so the call would vanish from the history)."""
    reasoning, sep, rest = text.partition("</think>")
    if sep:
        for _ in range(reasoning.count("<tool_call>")):
            result.add(call_error("malformed_call", "a <tool_call> inside the reasoning (before </think>) is not run. "
                                                "Finish the reasoning with </think>, then write the call."))
        text = rest
    for body in tagged_bodies(text, "<tool_call>", "</tool_call>"):
        if body is None:
            result.add(call_error("unterminated_tag", "<tool_call> was opened but never closed. End each call with </tool_call>."))
        elif not body.strip():
            result.add(call_error("empty_call", f"the <tool_call> is empty. {hint}"))
        else:
            yield body


def parse_hermes(text: str) -> ParseResult:
    """Each <tool_call>...</tool_call> is one call, JSON repaired as the module docstring says."""
    result = ParseResult()
    for body in tool_call_bodies(text, result, 'Write <tool_call>{"name": "...", "arguments": {...}}</tool_call>.'):
        try:
            item, repaired = _hermes_call(body)
        except Exception as exc:  # nothing a model writes may escape the parser (but a parser bug shows in the log)
            log.warning("hermes parser: a call could not be decoded: %s: %s", type(exc).__name__, exc)
            item, repaired = _undecodable(exc), False
        result.add(item)
        result.repaired += repaired
    return result


def _undecodable(exc: Exception) -> ToolError:
    return call_error("invalid_json", f"the call could not be decoded ({type(exc).__name__}: {shorten(str(exc), 60)}). "
                  + _HERMES_FORMAT)


def parse_retool(text: str) -> ParseResult:
    """Each <code> block is a `code_interpreter` call; its code may be fenced (```python, ```py,
    ``` or any language name) or bare, and is dedented. No repairs are counted. A fenced block ends
    at the first `</code>` after its closing fence (see `_code_blocks`)."""
    result = ParseResult()
    for body, cut in _code_blocks(text):
        if body is None:
            result.add(
                call_error("unterminated_tag", "<code> was opened but never closed. Write <code>```python ... ```</code>.")
            )
            continue
        result.cut_in_fence += cut
        code = textwrap.dedent(strip_fence(body)[0]).strip("\n").rstrip()
        code = code.encode("utf-8", "replace").decode()  # a lone surrogate (never in decoded tokens) becomes "?"
        if not code.strip():
            result.add(
                call_error("empty_call", "the <code> block is empty. Put Python in it: <code>```python ... ```</code>.")
            )
        else:
            result.add(ToolCall(name="code_interpreter", arguments={"code": code}))
    return result


# --- arguments against a schema ------------------------------------------------------------------

_TYPE_CHECKS: dict[str, Callable[[object], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _expected_arguments(params: dict, limit: int) -> str:
    """The schema's arguments, required ones first, as `name (type, required)`, within `limit` chars."""
    required = params.get("required", ())
    properties = params.get("properties", {})
    parts = []
    for arg in [*required, *(a for a in properties if a not in required)]:
        types = properties.get(arg, {}).get("type", "any")
        types = " or ".join(types) if isinstance(types, list) else types
        parts.append(f"{arg} ({types}{', required' if arg in required else ''})")
    listing = ", ".join(parts) or "none"
    while len(listing) > limit and len(parts) > 1:  # drop whole entries from the end
        parts.pop()
        listing = ", ".join(parts) + ", ..."
    return shorten(listing, limit)


def check_arguments(call: ToolCall, schema: dict) -> ToolError | None:
    """`call.arguments` against the tool's OpenAI function schema (`schema["function"]["parameters"]`,
    top level only): required arguments, each property's `type` (a name or a list of names) and
    `enum`. An integer is a valid number; a boolean is not an integer; `integer` means a Python int
    (3.0 is a number). Arguments the schema does not name are ignored: models add them, and
    punishing that teaches nothing about the task. An enum miss is a `wrong_argument_type`."""
    function = schema.get("function")
    if not isinstance(function, dict):
        raise ValueError(
            f"the schema of tool '{call.name}' has no \"function\" object; expected OpenAI function format "
            '{"type": "function", "function": {"name": ..., "parameters": {...}}}'
        )
    params = function.get("parameters", {})
    tool = shorten(call.name)
    for arg in params.get("required", ()):
        if arg not in call.arguments:
            text = f"the call to '{tool}' lacks the required argument '{shorten(arg)}'. Expected arguments: "
            return call_error("missing_argument", text + _expected_arguments(params, 170 - len(text)) + ".")
    for arg, spec in params.get("properties", {}).items():
        if arg not in call.arguments:
            continue
        value = call.arguments[arg]
        types = spec.get("type")
        if types is not None:
            types = types if isinstance(types, list) else [types]
            unknown = [t for t in types if t not in _TYPE_CHECKS]
            if unknown:
                raise ValueError(
                    f"tool '{call.name}' schema: argument '{arg}' has unknown type(s) {unknown}; "
                    f"expected JSON type names {sorted(_TYPE_CHECKS)}"
                )
            if not any(_TYPE_CHECKS[t](value) for t in types):
                return call_error(
                    "wrong_argument_type",
                    f"argument '{shorten(arg)}' of '{tool}' must be {' or '.join(types)}, "
                    f"got {json_type(value)} ({_quote(value)}).",
                )
        enum = spec.get("enum")
        if enum is not None and not any(
            value == e and isinstance(value, bool) == isinstance(e, bool) for e in enum
        ):
            return call_error(
                "wrong_argument_type",
                f"argument '{shorten(arg)}' of '{tool}' must be one of {_quote(enum, 60)}, got {_quote(value)}.",
            )
    return None


PARSERS = {"retool": parse_retool, "hermes": parse_hermes}
