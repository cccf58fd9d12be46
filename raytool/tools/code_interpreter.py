"""The code interpreter tool: runs the model's Python in a sandbox session and shows it the output.

What the model sees for one cell (`format_exec_result`):

- `ok`: what the cell printed on stdout, then what it wrote to stderr (warnings, and the sandbox's
  own notes such as "earlier state is gone"), unlabelled as a notebook shows them; or
  "(no output; use print() to see a value)" when both are empty.
- every failure: one line `Error (<kind>): <what happened and what to do>`, then the cell's output
  where it helps (the traceback of an `exit_error`, partial output of a `timeout`). The kinds are
  the `ERROR_KINDS` of `raytool.tools.base`: error -> exit_error, timeout, oom, killed (the
  interpreter's state is lost), infra_error -> sandbox_error (the sandbox's failure, not the code's;
  its detail goes to the metrics, not to the model).

The output is cut to a budget (`OutputBudget`): tokens of the policy's tokenizer when one is given,
characters otherwise. The MIDDLE is cut, with a marker `... N tokens truncated ...` (or `chars`), so
the head and the tail survive; errors keep three quarters of the budget for the tail, where a
traceback's last line (the exception) is.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from raytool.errors import one_line
from raytool.tools.base import ToolContext, ToolResult
from raytool.types import ExecResult, ToolCall

log = logging.getLogger(__name__)

# (code, session) -> ExecResult; in the actor graph a SandboxPool call. The session is the
# trajectory id, so a trajectory's cells share one interpreter.
Executor = Callable[[str, str], Awaitable[ExecResult]]
# session -> None; in the actor graph the pool's close_session.
CloseSession = Callable[[str], Awaitable[None]]

NO_OUTPUT = "(no output; use print() to see a value)"
MIN_BUDGET = 32  # below this a marker and a traceback's last line no longer fit

# ExecResult.status -> ToolResult.kind
ERROR_KIND = {"error": "exit_error", "timeout": "timeout", "oom": "oom", "killed": "killed", "infra_error": "sandbox_error"}

SANDBOX_ERROR_TEXT = (
    "Error (sandbox_error): the sandbox failed to run this cell. This is the sandbox's failure, "
    "not your code's; try the same call again."
)


def code_schema(name: str = "code_interpreter", description: str | None = None) -> dict:
    """The OpenAI function schema of a code interpreter: one required string parameter `code`."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description
            or "Run Python code in a sandbox and return what it prints. Variables, imports and files persist between calls in this conversation.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "The Python source to run."}},
                "required": ["code"],
            },
        },
    }


SCHEMA = code_schema()


class OutputBudget:
    """How much tool output the model may see: `max_tokens` tokens of `tokenizer` (anything with
    `encode(text) -> list[int]` and `decode(ids) -> str`, e.g. a HF tokenizer), or `max_chars`
    characters without one. `fit` cuts the middle and leaves a marker saying how much went."""

    def __init__(self, tokenizer: Any = None, *, max_tokens: int = 256, max_chars: int = 1024):
        if tokenizer is not None and not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
            raise TypeError(f"tokenizer must have encode(text) and decode(ids), got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        self.unit = "tokens" if tokenizer is not None else "chars"
        self.limit = max_tokens if tokenizer is not None else max_chars
        if self.limit < MIN_BUDGET:
            raise ValueError(f"tool output budget must be at least {MIN_BUDGET} {self.unit}, got {self.limit}")

    def __repr__(self) -> str:
        return f"OutputBudget({self.limit} {self.unit})"

    def _encode(self, text: str) -> list[int]:
        try:  # HF tokenizers: no BOS/EOS around a piece of tool output
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        except TypeError:  # a plain encode(text)
            return list(self.tokenizer.encode(text))

    def _units(self, text: str):
        return text if self.tokenizer is None else self._encode(text)

    def _piece(self, units, start: int, end: int) -> str:
        if self.tokenizer is None:
            return units[start:end]
        return self.tokenizer.decode(units[start:end]) if end > start else ""

    def count(self, text: str) -> int:
        return len(self._units(text))

    def marker(self, dropped: int) -> str:
        return f"\n... {dropped} {self.unit} truncated ...\n"

    def fit(self, text: str, *, prefix: str = "", keep_tail: float = 0.5) -> str:
        """`prefix + text`, with the middle of `text` cut so the whole is within the budget;
        `keep_tail` is the share of what is kept that comes from the end."""
        if self.count(prefix + text) <= self.limit:
            return prefix + text
        units = self._units(text)
        n = len(units)
        keep = self.limit - self.count(prefix) - self.count(self.marker(n))
        # Token counts are not additive across the cut points (merges), so check and shrink.
        for _ in range(8):
            if keep <= 0:
                break
            tail = int(keep * keep_tail)
            head = keep - tail
            # A byte-level BPE cut can split a character; drop the half-character it leaves.
            out = (prefix + self._piece(units, 0, head).rstrip("\ufffd") + self.marker(n - head - tail)
                   + self._piece(units, n - tail, n).lstrip("\ufffd"))
            over = self.count(out) - self.limit
            if over <= 0:
                return out
            keep -= over
        return prefix + self.marker(n).strip()


def _output(result: ExecResult) -> str:
    out = result.stdout.rstrip("\n")
    err = result.stderr.strip("\n")
    return out + ("\n" if out and err else "") + err


def _failure_header(result: ExecResult) -> str:
    status = result.status
    if status == "error":
        code = f" (exit code {result.exit_code})" if result.exit_code not in (None, 0, 1) else ""
        return f"Error (exit_error): the code raised an error{code}."
    if status == "timeout":
        after = f" after {result.duration_s:.1f} s" if result.duration_s > 0 else ""
        return f"Error (timeout): the code ran past its time limit and was stopped{after}. Make it faster or split the work."
    if status == "oom":
        return "Error (oom): the code ran out of memory. Use less (smaller inputs, generators instead of lists)."
    if status == "killed":
        return "Error (killed): the interpreter was killed and restarted; its state is lost, so re-run the imports and definitions you still need."
    return SANDBOX_ERROR_TEXT


def format_exec_result(result: ExecResult, budget: OutputBudget) -> str:
    """The text the model sees for one cell (see the module docstring), within `budget`."""
    if result.status == "ok":
        body = _output(result)
        return budget.fit(body) if body.strip() else NO_OUTPUT
    header = _failure_header(result)
    body = _output(result) if result.status in ("error", "timeout", "oom", "killed") else ""
    if not body.strip():
        return header
    return budget.fit(body, prefix=header + "\n", keep_tail=0.75)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _check_code_schema(schema: dict) -> dict:
    fn = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError('a tool schema must look like {"type": "function", "function": {"name": ..., "parameters": ...}}')
    props = (fn.get("parameters") or {}).get("properties") or {}
    code = props.get("code")
    if not isinstance(code, dict) or code.get("type", "string") != "string":
        raise ValueError(
            f"the code interpreter reads its source from a string parameter `code`; schema '{fn['name']}' has parameters {sorted(props)}"
        )
    return schema


class CodeInterpreterTool:
    """Runs `call.arguments["code"]` through `executor(code, ctx.trajectory_id)` and answers with
    `format_exec_result`. It never raises: bad arguments and a failing executor are ToolResults.

    `tokenizer` (the policy's, `encode`/`decode`) makes the output budget `max_output_tokens`
    tokens; without one it is `max_output_chars` characters. `close_session(trajectory_id)` is
    awaited by `release`, once per trajectory. `schema` replaces the default one (it must keep a
    string parameter `code`); its function name is the tool's name.
    """

    def __init__(
        self,
        executor: Executor,
        *,
        tokenizer: Any = None,
        max_output_tokens: int = 256,
        max_output_chars: int = 1024,
        close_session: CloseSession | None = None,
        name: str | None = None,
        schema: dict | None = None,
    ):
        if schema is None:
            schema = code_schema(name or "code_interpreter")
        else:
            _check_code_schema(schema)
            if name is not None and name != schema["function"]["name"]:
                raise ValueError(f"name '{name}' differs from the schema's function name '{schema['function']['name']}'")
        self.executor = executor
        self.close_session = close_session
        self.budget = OutputBudget(tokenizer, max_tokens=max_output_tokens, max_chars=max_output_chars)
        self.schema = schema
        self.name = schema["function"]["name"]

    def __repr__(self) -> str:
        return f"CodeInterpreterTool(name={self.name!r}, budget={self.budget!r})"

    async def execute(self, call: ToolCall, ctx: ToolContext) -> ToolResult:
        args = call.arguments if isinstance(call.arguments, dict) else {}
        if "code" not in args:
            return ToolResult(
                f'Error (missing_argument): {self.name} needs an argument `code` with the Python source to run, e.g. {{"code": "print(1 + 1)"}}.',
                ok=False, kind="missing_argument",
            )
        code = args["code"]
        if not isinstance(code, str):
            return ToolResult(
                f"Error (wrong_argument_type): `code` must be a string of Python source, got {_json_type(code)}.",
                ok=False, kind="wrong_argument_type",
            )
        if not code.strip():
            return ToolResult("Error (empty_call): `code` is empty; put the Python source to run in it.", ok=False, kind="empty_call")
        try:
            result = await self.executor(code, ctx.trajectory_id)
            if not isinstance(result, ExecResult):
                raise TypeError(f"the executor returned {type(result).__name__}, not an ExecResult")
        except Exception as exc:  # the sandbox's failure, never the model's: answer it, do not propagate
            detail = one_line(exc)
            log.warning("%s: the sandbox executor failed for trajectory %s: %s", self.name, ctx.trajectory_id, detail)
            return ToolResult(SANDBOX_ERROR_TEXT, ok=False, kind="sandbox_error", metrics={"status": "infra_error", "detail": detail})
        ok = result.status == "ok"
        metrics = {"status": result.status, "duration_s": result.duration_s, "truncated": result.truncated}
        if result.status == "infra_error":
            metrics["detail"] = result.stderr.strip()[-300:]
        return ToolResult(
            format_exec_result(result, self.budget),
            ok=ok,
            kind=None if ok else ERROR_KIND.get(result.status, "sandbox_error"),
            metrics=metrics,
        )

    async def release(self, ctx: ToolContext) -> None:
        """End the trajectory's sandbox session (its interpreter and files)."""
        if self.close_session is None:
            return
        try:
            await self.close_session(ctx.trajectory_id)
        except Exception as exc:  # the trajectory is over either way; the pool's idle expiry reclaims it
            log.warning("%s: closing sandbox session %s failed: %s", self.name, ctx.trajectory_id, one_line(exc))
