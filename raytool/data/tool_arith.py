"""The tool-arithmetic task: problems a 135M model cannot do in its head but can with one Python call.

Each problem has an exact integer answer and the one-line program that computes it; the same
generator yields the cold-start SFT traces (question -> code call -> output -> boxed answer).
Generation is deterministic by seed and the validation split never shares a question with train.
"""

from __future__ import annotations

import random

import msgspec

from raytool.types import Message

SYSTEM_PROMPT = (
    "You solve arithmetic problems with a Python tool. To run code, write it as "
    "<code>\n```python\n...\n```\n</code> and end your turn; the printed output comes back to you. "
    "Then give the final answer as \\boxed{N}."
)


class Problem(msgspec.Struct, frozen=True):
    question: str
    answer: str  # exact integer, as text
    code: str  # a program whose printed output is the answer
    kind: str


def _product(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(100, 9999), rng.randint(100, 9999)
    return f"What is {a} * {b}?", f"print({a} * {b})"


def _range_sum(rng: random.Random) -> tuple[str, str]:
    a = rng.randint(1, 500)
    b = a + rng.randint(50, 5000)
    return f"What is the sum of all integers from {a} to {b}?", f"print(sum(range({a}, {b} + 1)))"


def _power_mod(rng: random.Random) -> tuple[str, str]:
    base, exp, mod = rng.randint(2, 99), rng.randint(20, 400), rng.randint(7, 9973)
    return f"What is {base}^{exp} mod {mod}?", f"print(pow({base}, {exp}, {mod}))"


def _square_sum(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(20, 999)
    return f"What is the sum of the squares of the integers from 1 to {n}?", f"print(sum(k * k for k in range(1, {n} + 1)))"


def _multiple_count(rng: random.Random) -> tuple[str, str]:
    k, n = rng.randint(3, 97), rng.randint(1000, 99999)
    return (
        f"How many integers from 1 to {n} are divisible by {k} but not by {2 * k}?",
        f"print(sum(1 for i in range(1, {n} + 1) if i % {k} == 0 and i % {2 * k} != 0))",
    )


_KINDS = {
    "product": _product,
    "range_sum": _range_sum,
    "power_mod": _power_mod,
    "square_sum": _square_sum,
    "multiple_count": _multiple_count,
}


def _evaluate(code: str) -> str:
    # The generators only emit `print(<integer expression>)`; evaluating it here (trusted input we
    # just built) gives the ground truth without a sandbox round trip.
    expression = code.removeprefix("print(").removesuffix(")")
    return str(eval(expression, {"__builtins__": {"sum": sum, "range": range, "pow": pow}}))  # noqa: S307


def generate(count: int, seed: int, exclude: frozenset[str] = frozenset()) -> list[Problem]:
    rng = random.Random(seed)
    kinds = sorted(_KINDS)
    problems: list[Problem] = []
    seen = set(exclude)
    while len(problems) < count:
        kind = kinds[len(problems) % len(kinds)]
        question, code = _KINDS[kind](rng)
        if question in seen:
            continue
        seen.add(question)
        problems.append(Problem(question=question, answer=_evaluate(code), code=code, kind=kind))
    return problems


def make_splits(train_size: int, val_size: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """Deterministic train/val splits with no question in both."""
    val = generate(val_size, seed=seed * 1_000_003 + 1)
    train = generate(train_size, seed=seed * 1_000_003 + 2, exclude=frozenset(p.question for p in val))
    return train, val


def prompt_messages(problem: Problem, system_prompt: str | None = None) -> list[Message]:
    return [Message("system", system_prompt or SYSTEM_PROMPT), Message("user", problem.question)]


def code_call_text(code: str) -> str:
    """How an assistant turn calls the code tool in the ReTool tag format."""
    return f"<code>\n```python\n{code}\n```\n</code>"


def sft_messages(problem: Problem, system_prompt: str | None = None) -> list[Message]:
    """A cold-start trace: question -> code call -> tool output -> boxed answer."""
    return [
        *prompt_messages(problem, system_prompt),
        Message("assistant", code_call_text(problem.code)),
        Message("tool", problem.answer),
        Message("assistant", f"The answer is \\boxed{{{problem.answer}}}."),
    ]
