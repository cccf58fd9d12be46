"""Answer extraction (the last \\boxed{...}) and exact-match verification."""

from __future__ import annotations

import re


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in text, with nested braces; None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


_NUMBER_NOISE = re.compile(r"[\s,$]|\\!|\\,|\\text\{[^}]*\}")


def normalize_answer(answer: str) -> str:
    """Strip what does not change a number's value: spaces, thousands separators, \\text{}, $."""
    answer = _NUMBER_NOISE.sub("", answer.strip())
    if re.fullmatch(r"-?\d+\.0*", answer):
        answer = answer.split(".")[0]
    return answer


def boxed_match(view: dict, ground_truth: str, extra: dict) -> dict:
    """1.0 if the final answer's last \\boxed{} equals the ground truth after normalization."""
    predicted = last_boxed(view["response"])
    correct = predicted is not None and normalize_answer(predicted) == normalize_answer(ground_truth)
    return {"score": 1.0 if correct else 0.0, "acc": float(correct), "has_answer": float(predicted is not None)}
