"""Tool-call parsers: find tool calls in one assistant turn's text.

A parser returns the well-formed calls and, for each malformed one, an error text that goes back to
the model as the tool's answer (so the trajectory goes on and the model can learn the format).
- `retool`: ReTool's code tags, <code>```python ...```</code>, each a `code_interpreter` call.
- `hermes`: Hermes/Qwen JSON, <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from raytool.types import ToolCall


@dataclass
class ParseResult:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def any(self) -> bool:
        return bool(self.calls or self.errors)


_CODE_BLOCK = re.compile(r"<code>(.*?)</code>", re.DOTALL)
_FENCE = re.compile(r"^\s*```(?:python|py)?[ \t]*\n(.*?)\n?```\s*$", re.DOTALL)


def parse_retool(text: str) -> ParseResult:
    result = ParseResult()
    for block in _CODE_BLOCK.findall(text):
        fenced = _FENCE.match(block)
        code = fenced.group(1) if fenced else block.strip()
        if not code.strip():
            result.errors.append("malformed tool call: the <code> block is empty")
        else:
            result.calls.append(ToolCall(name="code_interpreter", arguments={"code": code}))
    tail = _CODE_BLOCK.sub("", text)
    if "<code>" in tail:
        result.errors.append("malformed tool call: <code> opened but never closed with </code>")
    return result


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> ParseResult:
    result = ParseResult()
    for body in _TOOL_CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            result.errors.append(f"malformed tool call: invalid JSON ({exc.msg} at char {exc.pos})")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            result.errors.append('malformed tool call: expected {"name": str, "arguments": object}')
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models emit arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            result.errors.append(f"malformed tool call to '{obj['name']}': arguments must be an object")
            continue
        result.calls.append(ToolCall(name=obj["name"], arguments=args))
    if "<tool_call>" in _TOOL_CALL.sub("", text):
        result.errors.append("malformed tool call: <tool_call> opened but never closed with </tool_call>")
    return result


PARSERS = {"retool": parse_retool, "hermes": parse_hermes}


def get_parser(name: str):
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser '{name}'; expected one of {sorted(PARSERS)}") from None
