"""The Tool interface: an OpenAI-format schema plus `async execute(call, ctx) -> ToolResult`.

A tool never raises for what the model did wrong: it answers with a `ToolResult` whose `kind`
names the error (one of `ERROR_KINDS`), so the agent loop can show it to the model and count it
(`tool/errors/<kind>`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from raytool.types import ToolCall

# Every way a tool call can fail, as counted in the metrics (`tool/errors/<kind>`).
ERROR_KINDS = (
    "invalid_json",  # the call's JSON could not be read (after the unambiguous repairs)
    "malformed_call",  # a call that does not follow its format (no tool name, an argument without a value, a missing separator)
    "unknown_tool",  # no tool of that name
    "missing_argument",  # a required argument is absent
    "wrong_argument_type",  # an argument has the wrong JSON type
    "unterminated_tag",  # <tool_call> / <code> opened but never closed
    "empty_call",  # a call with nothing in it
    "too_many_calls",  # beyond agent.max_tool_calls_per_turn
    "timeout",  # the code ran past its time limit
    "oom",  # the code ran out of memory
    "exit_error",  # the code raised or exited non-zero
    "killed",  # the interpreter was killed (a signal; its state is gone)
    "sandbox_error",  # the sandbox itself failed (infrastructure), not the code
    "tool_exception",  # a tool's own implementation raised
)


@dataclass
class ToolContext:
    trajectory_id: str
    extra: dict = field(default_factory=dict)


@dataclass
class ToolResult:
    text: str  # what the model sees as the tool's output
    ok: bool  # False counts as a tool error in the metrics
    kind: str | None = None  # which error (one of ERROR_KINDS) when not ok
    metrics: dict = field(default_factory=dict)


class Tool(Protocol):
    name: str
    schema: dict  # OpenAI function format: {"type": "function", "function": {"name", "description", "parameters"}}

    async def execute(self, call: ToolCall, ctx: ToolContext) -> ToolResult: ...

    async def release(self, ctx: ToolContext) -> None:
        """Free what the trajectory held (e.g. its sandbox session); called once it ends, whatever happened."""
        ...
