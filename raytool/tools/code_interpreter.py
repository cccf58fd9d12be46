"""The code interpreter tool: runs the model's Python in a sandbox and shows it the output."""

from __future__ import annotations

from typing import Awaitable, Callable

from raytool.tools.base import ToolContext, ToolResult
from raytool.types import ExecResult, ToolCall

# (code, session) -> ExecResult; in the actor graph this is a SandboxPool call.
Executor = Callable[[str, str], Awaitable[ExecResult]]

SCHEMA = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run Python code and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python source to run"}},
            "required": ["code"],
        },
    },
}


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "...[cut]\n" + text[-limit:]


def format_exec_result(result: ExecResult, max_chars: int) -> str:
    """The text the model sees for one cell: stdout when it ran, else what went wrong."""
    if result.status == "ok":
        out = result.stdout.strip()
        if len(out) > max_chars:
            out = out[:max_chars] + "\n...[output cut]"
        return out if out else "(no output; use print() to see a value)"
    if result.status == "timeout":
        return "Error: the code ran past its time limit and was stopped."
    if result.status == "oom":
        return "Error: the code ran out of memory."
    if result.status == "infra_error":
        return "Error: the sandbox failed to run the code; try again."
    return "Error:\n" + _tail(result.stderr.strip() or f"exit code {result.exit_code}", max_chars)


class CodeInterpreterTool:
    name = "code_interpreter"
    schema = SCHEMA

    def __init__(self, executor: Executor, max_output_chars: int = 512):
        self.executor = executor
        self.max_output_chars = max_output_chars

    async def execute(self, call: ToolCall, ctx: ToolContext) -> ToolResult:
        code = call.arguments.get("code")
        if not isinstance(code, str):
            return ToolResult('Error: code_interpreter expects {"code": "<python source>"}', ok=False)
        result = await self.executor(code, ctx.trajectory_id)
        return ToolResult(
            format_exec_result(result, self.max_output_chars),
            ok=result.status == "ok",
            metrics={"status": result.status, "duration_s": result.duration_s},
        )
