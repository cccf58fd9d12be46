"""raytool's arithmetic task as a verifiers ToolEnv: word problems, a `calculate` tool the model
calls with an arithmetic expression, and a rubric that checks the final answer (and counts the
calls, as every verifiers ToolEnv does). `examples/env_verifiers_tiny.yaml` trains on it:

    raytool train -c examples/env_verifiers_tiny.yaml

Any verifiers environment is used the same way: `agent.environment` names an installed one's id or
its `load_environment` function.
"""

from __future__ import annotations

import ast
import operator

import verifiers as vf
from datasets import Dataset

from raytool.data import tool_arith
from raytool.rewards.math import extract_answer, normalize_answer

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.USub: operator.neg}


def _value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand))
    raise ValueError("only integers and + - * // % are allowed")


def calculate(expression: str) -> str:
    """Evaluate an integer arithmetic expression.

    Args:
        expression: An expression of integers with + - * // % and parentheses, e.g. "(17 + 25) * 3".
    """
    return str(_value(ast.parse(expression, mode="eval").body))


def correct(completion, answer) -> float:
    """1.0 when the last assistant message's answer (\\boxed{...} or the last number) is the right one."""
    text = completion[-1].content if completion and completion[-1].role == "assistant" else ""
    found = extract_answer(text or "")
    return float(found is not None and normalize_answer(found) == normalize_answer(answer))


def _rows(problems) -> Dataset:
    return Dataset.from_list([{"question": p.question, "answer": p.answer} for p in problems])


def load_environment(train_size: int = 256, eval_size: int = 16, seed: int = 0, max_turns: int = 3) -> vf.Environment:
    train, val = tool_arith.make_splits(train_size, eval_size, seed)
    return vf.ToolEnv(dataset=_rows(train), eval_dataset=_rows(val), tools=[calculate], max_turns=max_turns,
                      system_prompt="Solve the problem. Use the calculate tool for arithmetic, then give the answer as \\boxed{N}.",
                      rubric=vf.Rubric(funcs=[correct]))
