"""The tool-arithmetic task: word problems a 135M model cannot do in its head but can with Python.

Each problem is a short story whose numbers the model must compose into an expression (`a * b - c`,
`a * b + c * d`, `a % b`, ...); some need two tool calls (an intermediate result, then an operation
on it). The cold-start SFT traces come from the templates marked `in_sft`; the others are held out
of SFT (their stories and expressions differ in wording, not in kind), so GRPO and evaluation see
problems the SFT traces never handed the model. Validation rows carry the data source `tool_arith`
(templates seen in SFT) or `tool_arith_unseen` (held out of SFT), and metrics are reported per source.

Generation is deterministic by seed and the validation split never shares a question with train.
"""

from __future__ import annotations

import random
from typing import Callable

import msgspec

from raytool.data.prompts import PromptRow
from raytool.types import Message

SYSTEM_PROMPT = (
    "You solve arithmetic word problems with a Python tool. To run code, write it as "
    "<code>\n```python\n...\n```\n</code> and end your turn; the printed output comes back to you. "
    "Then give the final answer as \\boxed{N}."
)
SEEN, UNSEEN = "tool_arith", "tool_arith_unseen"  # data sources: templates in / held out of SFT


class Problem(msgspec.Struct, frozen=True):
    question: str
    answer: str  # exact integer, as text
    steps: list[str]  # one program per tool call; each prints the next value (the last: the answer)
    outputs: list[str]  # what each step prints
    template: str
    in_sft: bool  # whether SFT traces are made from this problem's template


# A template: rng -> (question, steps as functions of the previous step's printed value).
Steps = list[Callable[[str], str]]


def _leftover_after_sales(rng: random.Random) -> tuple[str, Steps]:
    a, b = rng.randint(12, 99), rng.randint(12, 99)
    c = rng.randint(100, a * b - 1)
    return (f"A shop receives {a} crates with {b} apples in each crate and sells {c} apples. How many apples are left?",
            [lambda _: f"print({a} * {b} - {c})"])


def _savings(rng: random.Random) -> tuple[str, Steps]:  # held out: the same expression, other words
    a, b = rng.randint(12, 99), rng.randint(12, 99)
    c = rng.randint(100, a * b - 1)
    return (f"Mia earns {a} dollars every week for {b} weeks, then spends {c} dollars on a bike. How many dollars does she have left?",
            [lambda _: f"print({a} * {b} - {c})"])


def _ticket_revenue(rng: random.Random) -> tuple[str, Steps]:
    a, b, c, d = (rng.randint(12, 99) for _ in range(4))
    return (f"A theater sells {a} tickets at {b} dollars each and {c} tickets at {d} dollars each. How many dollars does it take in?",
            [lambda _: f"print({a} * {b} + {c} * {d})"])


def _road_trip(rng: random.Random) -> tuple[str, Steps]:  # held out
    a, b, c, d = (rng.randint(12, 99) for _ in range(4))
    return (f"A truck drives at {a} km per hour for {b} hours, then at {c} km per hour for {d} hours. How many km does it drive in total?",
            [lambda _: f"print({a} * {b} + {c} * {d})"])


def _packed_boxes(rng: random.Random) -> tuple[str, Steps]:
    a, b, c = rng.randint(12, 99), rng.randint(12, 99), rng.randint(3, 30)
    return (f"{a} workers each pack {b} boxes a day for {c} days. How many boxes do they pack?",
            [lambda _: f"print({a} * {b} * {c})"])


def _shared_marbles(rng: random.Random) -> tuple[str, Steps]:
    a, b = rng.randint(1000, 99999), rng.randint(7, 97)
    return (f"{a} marbles are shared equally among {b} children. How many marbles are left over?",
            [lambda _: f"print({a} % {b})"])


def _parts_in_boxes(rng: random.Random) -> tuple[str, Steps]:  # two calls: the total, then what is left
    a, b, c = rng.randint(120, 999), rng.randint(12, 99), rng.randint(7, 97)
    return (f"A factory makes {a} parts a day for {b} days. The parts are packed into boxes of {c}. "
            "First find how many parts it makes, then how many parts are left over after filling as many boxes as possible.",
            [lambda _: f"print({a} * {b})", lambda total: f"print({total} % {c})"])


def _pencils_per_class(rng: random.Random) -> tuple[str, Steps]:  # held out, two calls
    a, b, c = rng.randint(120, 999), rng.randint(12, 99), rng.randint(7, 97)
    return (f"A school orders {a} packs of {b} pencils. First find how many pencils it gets, then share them equally "
            f"among {c} classes: how many pencils are left over?",
            [lambda _: f"print({a} * {b})", lambda total: f"print({total} % {c})"])


# name -> (template, in SFT)
TEMPLATES: dict[str, tuple[Callable[[random.Random], tuple[str, Steps]], bool]] = {
    "leftover_after_sales": (_leftover_after_sales, True),
    "ticket_revenue": (_ticket_revenue, True),
    "packed_boxes": (_packed_boxes, True),
    "shared_marbles": (_shared_marbles, True),
    "parts_in_boxes": (_parts_in_boxes, True),
    "savings": (_savings, False),
    "road_trip": (_road_trip, False),
    "pencils_per_class": (_pencils_per_class, False),
}


def _run(code: str) -> str:
    # The templates only emit `print(<integer expression>)`; evaluating it here (trusted input we
    # just built) gives the ground truth without a sandbox round trip.
    return str(eval(code.removeprefix("print(").removesuffix(")"), {"__builtins__": {}}))  # noqa: S307


def _problem(name: str, rng: random.Random) -> Problem:
    template, in_sft = TEMPLATES[name]
    question, step_fns = template(rng)
    steps, outputs, previous = [], [], ""
    for make in step_fns:
        steps.append(make(previous))
        previous = _run(steps[-1])
        outputs.append(previous)
    return Problem(question=question, answer=outputs[-1], steps=steps, outputs=outputs, template=name, in_sft=in_sft)


def generate(count: int, seed: int, exclude: frozenset[str] = frozenset()) -> list[Problem]:
    """`count` problems cycling through the templates, none of whose questions is in `exclude`."""
    rng = random.Random(seed)
    names = list(TEMPLATES)
    problems: list[Problem] = []
    seen = set(exclude)
    while len(problems) < count:
        problem = _problem(names[len(problems) % len(names)], rng)
        if problem.question in seen:
            continue
        seen.add(problem.question)
        problems.append(problem)
    return problems


def make_splits(train_size: int, val_size: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """Deterministic train/val splits with no question in both."""
    val = generate(val_size, seed=seed * 1_000_003 + 1)
    train = generate(train_size, seed=seed * 1_000_003 + 2, exclude=frozenset(p.question for p in val))
    return train, val


def prompt_messages(problem: Problem, system_prompt: str | None = None) -> list[Message]:
    return [Message("system", system_prompt or SYSTEM_PROMPT), Message("user", problem.question)]


def prompt_row(problem: Problem, system_prompt: str | None = None) -> PromptRow:
    return PromptRow(prompt=prompt_messages(problem, system_prompt), ground_truth=problem.answer,
                     data_source=SEEN if problem.in_sft else UNSEEN, extra_info={"template": problem.template})


def code_call_text(code: str) -> str:
    """How an assistant turn calls the code tool in the ReTool tag format."""
    return f"<code>\n```python\n{code}\n```\n</code>"


def sft_messages(problem: Problem, system_prompt: str | None = None) -> list[Message]:
    """A cold-start trace: question -> one code call per step, each with its output -> boxed answer."""
    messages = prompt_messages(problem, system_prompt)
    for code, output in zip(problem.steps, problem.outputs):
        messages += [Message("assistant", code_call_text(code)), Message("tool", output)]
    return [*messages, Message("assistant", f"The answer is \\boxed{{{problem.answer}}}.")]
