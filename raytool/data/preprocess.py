r"""Dataset preprocessors: public math and tool-use data sets, read from a local copy, turned into
raytool's RL prompt rows (`raytool.data.prompts`) or SFT conversations (`raytool.data.conversations`).

`raytool preprocess NAME --input PATH --output PATH` calls `preprocess`. The input is a .parquet,
.jsonl or .json file or an HF `save_to_disk` folder in the source data set's own schema; the
output's suffix (.parquet or .jsonl) picks the format. A row that cannot be converted is reported
as `FILE row N (0-based): what is wrong` (`FILE line N` in jsonl) and skipped; the rest are written.

RL prompts (data_source = the preprocessor's name, agent_name `tool_agent`):
- `dapo_math_17k` (BytedTsinghua-SIA/DAPO-Math-17k): the problem cut out of DAPO's "Answer: $Answer"
  instruction; ground truth `reward_model.ground_truth`.
- `aime_2024` (Maxwell-Jia/AIME_2024: ID, Problem, Solution, Answer) and `aime_2025`
  (yentinglin/aime_2025: problem, answer, id?, url?); answers must be integers.
- `gsm8k` (openai/gsm8k main: question, answer ending in `#### N`); ground truth N without commas.
Each prompt is a system message (`SYSTEM_PROMPT`, or the `system_prompt` option; "" for none) and
the problem as the user message.

SFT conversations (messages + tools; tool calls with JSON-string arguments, as parquet needs):
- `gsm8k_sft`: each `<<expr=result>>` annotation becomes a `code_interpreter` call `print(expr)`
  answered by a tool message `result`; the last message ends with `\boxed{N}` (the TRL calculator recipe).
- `retool_sft` (JoeYing/ReTool-SFT): the assistant trace is cut at each `<code>...</code>` block
  (a tool call) and its `<interpreter>...</interpreter>` output (a tool message); the text after the
  last output, with the `<answer>` tags dropped, is the final message.
`format`: `hermes` (default, as verl's recipe) gives structured tool calls and the tool schema in
`tools`; `retool` keeps each call as a `<code>` block in the assistant's text and gives no `tools`.
"""

from __future__ import annotations

import ast
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import msgspec

from raytool.agent.parsers import parse_retool
from raytool.data.prompts import PromptRow, write_prompt_rows
from raytool.data.rows import BadRow, DataError, convert_rows, json_list, json_object, kind, read_rows
from raytool.data.tool_arith import code_call_text
from raytool.tools.code_interpreter import SCHEMA as CODE_SCHEMA
from raytool.types import Message

log = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "Solve the math problem. You can write Python code and run it with the code_interpreter tool; "
    "what the code prints comes back to you. Use it to compute and to check your work. "
    "Put the final answer in \\boxed{} on the last line."
)

FORMATS = ("hermes", "retool")
_SHOWN_PROBLEMS = 5  # problems listed in a report's summary; the rest as a count


class PreprocessReport(msgspec.Struct):
    """What one `preprocess` run did; `problems` has one line per skipped row."""

    name: str
    input: str
    output: str
    rows_read: int
    converted: int
    skipped: int
    problems: list[str] = []

    def summary(self) -> str:
        lines = [f"{self.name}: {self.rows_read} rows read from {self.input}, {self.converted} converted, "
                 f"{self.skipped} skipped -> {self.output}"]
        lines += [f"  skipped {p}" for p in self.problems[:_SHOWN_PROBLEMS]]
        if len(self.problems) > _SHOWN_PROBLEMS:
            lines.append(f"  ... and {len(self.problems) - _SHOWN_PROBLEMS} more skipped rows")
        return "\n".join(lines)


@dataclass(frozen=True)
class Options:
    system_prompt: str  # "" for no system message
    format: str  # SFT preprocessors only: hermes | retool


# A row converter: one source row -> a PromptRow or an SFT conversation row; raises BadRow.
Converter = Callable[[dict, Options], "PromptRow | dict"]

PREPROCESSORS: dict[str, Converter] = {}
_COLUMNS: dict[str, tuple[str, ...]] = {}  # the columns each one needs
_SFT: set[str] = set()  # those that write conversations, not prompt rows


def register(name: str, columns: tuple[str, ...], *, sft: bool = False):
    def add(fn: Converter) -> Converter:
        PREPROCESSORS[name] = fn
        _COLUMNS[name] = columns
        if sft:
            _SFT.add(name)
        return fn

    return add


# --- reading fields ------------------------------------------------------------------------------


def _field(row: dict, key: str):
    if row.get(key) is None:
        raise BadRow(f"no '{key}' (the row has: {', '.join(sorted(row)) or 'nothing'})")
    return row[key]


def _text(row: dict, key: str) -> str:
    value = _field(row, key)
    if not isinstance(value, str):
        raise BadRow(f"'{key}' must be text, got {kind(value)}")
    if not value.strip():
        raise BadRow(f"'{key}' is empty")
    return value.strip()


def _integer_answer(row: dict, key: str) -> str:
    """An AIME answer: an integer given as a number or as text."""
    value = _field(row, key)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip() if isinstance(value, (int, str)) and not isinstance(value, bool) else None
    if text is None or not re.fullmatch(r"-?\d+", text):
        raise BadRow(f"'{key}' must be an integer, got {str(value)[:40]!r}")
    return text


def _prompt_row(problem: str, answer: str, source: str, opts: Options, extra: dict) -> PromptRow:
    system = [Message("system", opts.system_prompt)] if opts.system_prompt else []
    return PromptRow(prompt=[*system, Message("user", problem)], ground_truth=answer, data_source=source,
                     agent_name="tool_agent", extra_info=extra)


# --- RL prompts ----------------------------------------------------------------------------------

# DAPO-Math-17k wraps every problem in an instruction to end with "Answer: $Answer"; the tool-use
# prompt asks for \boxed{} instead, so the wrapper is cut off (whitespace-tolerant).
_DAPO_HEAD = re.compile(r"\s*Solve the following math problem step by step\..*?where \$Answer is the answer to the problem\.\s*", re.S)
_DAPO_TAIL = re.compile(r"\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$")


def dapo_problem(content: str) -> str:
    """The problem inside DAPO's instruction text; the content as it is where there is none."""
    head = _DAPO_HEAD.match(content)
    problem = content[head.end():] if head else content
    return _DAPO_TAIL.sub("", problem).strip()


@register("dapo_math_17k", ("prompt", "reward_model"))
def dapo_math_17k(row: dict, opts: Options) -> PromptRow:
    users = [m for m in json_list(_field(row, "prompt"), "prompt") if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[-1].get("content"), str):
        raise BadRow("'prompt' has no user message with text content")
    problem = dapo_problem(users[-1]["content"])
    if not problem:
        raise BadRow("the user message holds no problem")
    answer = json_object(_field(row, "reward_model"), "reward_model").get("ground_truth")
    if answer is None or not str(answer).strip():
        raise BadRow("no 'reward_model.ground_truth'")
    extra = {"original_data_source": row.get("data_source")}
    if row.get("extra_info") is not None:
        extra["index"] = json_object(row["extra_info"], "extra_info").get("index")
    return _prompt_row(problem, str(answer).strip(), "dapo_math_17k", opts, extra)


@register("aime_2024", ("Problem", "Answer"))
def aime_2024(row: dict, opts: Options) -> PromptRow:
    return _prompt_row(_text(row, "Problem"), _integer_answer(row, "Answer"), "aime_2024", opts, {"id": row.get("ID")})


@register("aime_2025", ("problem", "answer"))
def aime_2025(row: dict, opts: Options) -> PromptRow:
    extra = {k: row[k] for k in ("id", "url") if row.get(k) is not None}
    return _prompt_row(_text(row, "problem"), _integer_answer(row, "answer"), "aime_2025", opts, extra)


def gsm8k_answer(text: str) -> tuple[str, str]:
    """(reasoning, final number) of a GSM8K answer `... #### 1,234`; the number without commas."""
    reasoning, sep, final = text.rpartition("####")
    if not sep:
        raise BadRow("'answer' has no '#### N' final line")
    number = final.strip().replace(",", "")
    if not re.fullmatch(r"-?\d+(\.\d+)?", number):
        raise BadRow(f"the answer after '####' is not a number: {final.strip()[:40]!r}")
    return reasoning.strip(), number


@register("gsm8k", ("question", "answer"))
def gsm8k(row: dict, opts: Options) -> PromptRow:
    reasoning, number = gsm8k_answer(_text(row, "answer"))
    return _prompt_row(_text(row, "question"), number, "gsm8k", opts, {"reasoning": reasoning})


# --- SFT conversations ---------------------------------------------------------------------------


def _call_turn(text: str, code: str, block: str, opts: Options) -> dict:
    """The assistant message that says `text` and runs `code`: a structured call (hermes), or the
    text followed by the code as a `<code>` block (`block`: that block as the source wrote it)."""
    if opts.format == "retool":
        return {"role": "assistant", "content": "\n\n".join(s for s in (text, block) if s)}
    call = {"type": "function", "function": {"name": "code_interpreter", "arguments": json.dumps({"code": code}, ensure_ascii=False)}}
    return {"role": "assistant", "content": text, "tool_calls": [call]}


def _conversation(system_prompt: str, question: str, turns: list[dict], opts: Options, **columns) -> dict:
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return {"messages": [*system, {"role": "user", "content": question}, *turns],
            "tools": [CODE_SCHEMA] if opts.format == "hermes" else None, **columns}


_ANNOTATION = re.compile(r"<<(.*?)>>", re.S)


_ARITHMETIC = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.operator, ast.unaryop)


def _printed(expr: str, annotated: str) -> str:
    """What `print(expr)` shows for a plain arithmetic annotation (`48/2` prints `24.0`, not the
    annotated `24`): the tool message must be what the tool would return. Anything else (names,
    calls, huge powers) keeps the annotated result."""
    tree = ast.parse(expr.strip(), mode="eval")
    if not all(isinstance(node, _ARITHMETIC) for node in ast.walk(tree)) or "**" in expr:
        return annotated
    try:
        return str(eval(compile(tree, "<annotation>", "eval"), {"__builtins__": {}}))  # noqa: S307 (numbers and operators only)
    except (ArithmeticError, ValueError):
        return annotated


@register("gsm8k_sft", ("question", "answer"), sft=True)
def gsm8k_sft(row: dict, opts: Options) -> dict:
    question = _text(row, "question")
    reasoning, number = gsm8k_answer(_text(row, "answer"))
    turns, pos = [], 0
    for m in _ANNOTATION.finditer(reasoning):
        expr, sep, result = m.group(1).rpartition("=")
        if not sep or not expr.strip() or not result.strip():
            raise BadRow(f"the annotation {m.group(0)[:60]!r} is not <<expression=result>>")
        try:
            compile(expr, "<annotation>", "eval")
        except SyntaxError:
            raise BadRow(f"the annotation {m.group(0)[:60]!r}: {expr.strip()!r} is not a Python expression") from None
        code = f"print({expr.strip()})"
        turns += [_call_turn(reasoning[pos:m.start()].strip(), code, code_call_text(code), opts),
                  {"role": "tool", "content": _printed(expr, result.strip())}]
        pos = m.end()
    if "<<" in reasoning[pos:] or ">>" in reasoning[pos:]:
        raise BadRow("'answer' has an unclosed << >> annotation")
    final = reasoning[pos:].strip()
    turns.append({"role": "assistant", "content": f"{final}\n\\boxed{{{number}}}" if final else f"\\boxed{{{number}}}"})
    return _conversation(opts.system_prompt, question, turns, opts, data_source="gsm8k", ground_truth=number)


_RETOOL_TAGS = ("code", "interpreter", "answer")
_TAG = re.compile(r"</?(?:code|interpreter|answer)>")
_ROUND = re.compile(r"(.*?)(<code>(.*?)</code>)\s*<interpreter>(.*?)</interpreter>", re.S)
_FINAL = re.compile(r"(.*?)<answer>(.*?)</answer>\s*", re.S)


def _retool_turns(text: str, opts: Options) -> list[dict]:
    """A ReTool-SFT assistant trace cut into assistant / tool messages (see the module docstring)."""
    for tag in _RETOOL_TAGS:
        opened, closed = text.count(f"<{tag}>"), text.count(f"</{tag}>")
        if opened != closed:
            raise BadRow(f"unbalanced tags in the assistant trace: {opened} <{tag}> and {closed} </{tag}>")
    if text.count("<code>") != text.count("<interpreter>"):
        raise BadRow(f"{text.count('<code>')} <code> blocks but {text.count('<interpreter>')} <interpreter> outputs")
    turns, pos = [], 0
    while m := _ROUND.match(text, pos):
        before, block, body, output = m.groups()
        n = len(turns) // 2 + 1
        if _TAG.search(before) or _TAG.search(body) or _TAG.search(output):
            raise BadRow(f"tool round {n} is not text, <code>...</code>, then <interpreter>...</interpreter>")
        parsed = parse_retool(block)
        if not parsed.calls:
            raise BadRow(f"<code> block {n}: {parsed.errors[0].message}")
        turns += [_call_turn(before.strip(), parsed.calls[0].arguments["code"], block, opts),
                  {"role": "tool", "content": output.strip()}]
        pos = m.end()
    final = _FINAL.fullmatch(text, pos)
    if not final or _TAG.search(final.group(1)) or _TAG.search(final.group(2)):
        raise BadRow("the trace does not end with text, then <answer>...</answer> after the last interpreter output")
    turns.append({"role": "assistant", "content": f"{final.group(1).strip()}\n\n{final.group(2).strip()}".strip()})
    return turns


@register("retool_sft", ("messages",), sft=True)
def retool_sft(row: dict, opts: Options) -> dict:
    messages = json_list(_field(row, "messages"), "messages")
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
    if roles != ["user", "assistant"]:
        raise BadRow(f"'messages' must be [user, assistant], got roles {roles}")
    question = messages[0].get("content")
    trace = messages[1].get("content")
    if not isinstance(question, str) or not isinstance(trace, str) or not question.strip() or not trace.strip():
        raise BadRow("the user and assistant messages must have non-empty text content")
    # The user message is ReTool's instruction, then the question after "*user question:*".
    head, sep, tail = question.partition("*user question:*")
    question = (tail if sep else head).replace("<answer>", "").replace("</answer>", "").strip()
    if not question:
        raise BadRow("the user message holds no question")
    return _conversation(opts.system_prompt, question, _retool_turns(trace, opts), opts, data_source="retool_sft")


# --- running one -------------------------------------------------------------------------------


def _check_columns(name: str, path: Path, rows: list[tuple[str, object]]) -> None:
    """A DataError when no row has a column `name` needs: the input is another data set."""
    found = set().union(*(row for _, row in rows if isinstance(row, dict)))
    missing = [c for c in _COLUMNS[name] if c not in found]
    if not found or not missing:
        return
    like = [other for other, columns in _COLUMNS.items() if other != name and set(columns) <= found]
    if {"prompt", "ground_truth", "data_source"} <= found:
        hint = "; it looks like raytool prompt rows already (use the file as it is)"
    elif like:
        hint = f"; it looks like {' or '.join(like)} data (raytool preprocess {like[0]} ...)"
    else:
        hint = ""
    raise DataError(f"{path}: not {name} data: expected columns {', '.join(_COLUMNS[name])}, "
                    f"found {', '.join(sorted(found))}{hint}")


def _write_conversations(path: Path, rows: list[dict]) -> None:
    """SFT conversation rows as jsonl, or parquet with `tools` as a JSON string (tool-call arguments
    already are), as `load_conversations` reads them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {key: [row.get(key) for row in rows] for key in rows[0]}
    columns["tools"] = pa.array([json.dumps(t) if t is not None else None for t in columns["tools"]], pa.string())
    pq.write_table(pa.table(columns), path)


def preprocess(name: str, input_path: str | Path, output_path: str | Path, *, system_prompt: str | None = None,
               limit: int | None = None, format: str | None = None) -> PreprocessReport:
    """Convert the data set `name` from `input_path` and write it to `output_path` (.parquet / .jsonl).

    `system_prompt`: the system message of every prompt (None: `SYSTEM_PROMPT`; "": none);
    `limit`: convert the first N rows only; `format`: hermes | retool, SFT preprocessors only.
    Raises DataError for an unknown name, a bad option, an unreadable input, an input in another
    data set's schema, or an input without a single convertible row."""
    if name not in PREPROCESSORS:
        raise DataError(f"unknown preprocessor '{name}'; the known ones are: {', '.join(PREPROCESSORS)}")
    if format is not None and name not in _SFT:
        raise DataError(f"option format applies to {', '.join(sorted(_SFT))} (SFT conversations); {name} writes RL prompt rows")
    if format is not None and format not in FORMATS:
        raise DataError(f"unknown format '{format}'; expected one of {', '.join(FORMATS)}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise DataError(f"limit must be a positive number of rows, got {limit!r}")
    input_path, output_path = Path(input_path), Path(output_path)
    if output_path.suffix not in (".parquet", ".jsonl"):
        raise DataError(f"{output_path}: write the output as .parquet or .jsonl, not '{output_path.suffix}'")
    if output_path.resolve() == input_path.resolve():
        raise DataError(f"{output_path}: the output would overwrite the input; give another path")

    rows = read_rows(input_path)[:limit]
    if not rows:
        raise DataError(f"{input_path}: no rows to convert")
    _check_columns(name, input_path, rows)
    opts = Options(system_prompt=SYSTEM_PROMPT if system_prompt is None else system_prompt, format=format or "hermes")
    convert = PREPROCESSORS[name]

    def one(row, _source):
        if not isinstance(row, dict):
            raise BadRow(f"a row must be an object, got {kind(row)}")
        return convert(row, opts)

    converted, problems = convert_rows(input_path, rows, one, f"convertible {name} row")
    if name in _SFT:
        _write_conversations(output_path, converted)
    else:
        write_prompt_rows(output_path, converted)
    report = PreprocessReport(name=name, input=str(input_path), output=str(output_path), rows_read=len(rows),
                              converted=len(converted), skipped=len(problems), problems=problems)
    log.info("%s", report.summary().splitlines()[0])
    return report
