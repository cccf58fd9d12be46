r"""Final-answer extraction from the model's own text, and judging an answer against the ground truth.

Conventions: the last `\boxed{...}` / `\fbox{...}` (nested braces; unbalanced: no answer), DAPO's
last line starting with `Answer:`, GSM8K's `#### N`, each optionally inside ReTool-SFT's
`<answer>...</answer>`. Which apply, in which order, depends on the row's `data_source`.
`<interpreter>...</interpreter>` blocks (tool output spliced into an assistant turn by the
`in_turn` observation style) are removed first: a number the tool printed is not the model's answer.
"""

from __future__ import annotations

import re

from raytool.rewards.verify import MathVerifier

MAX_ANSWER_CHARS = 1000  # longer answers (or ground truths) are only compared exactly, never parsed


def strip_interpreter(text: str) -> str:
    """text without its `<interpreter>...</interpreter>` blocks (an unclosed one runs to the end)."""
    parts, i = [], 0
    while (start := text.find("<interpreter>", i)) >= 0:
        parts.append(text[i:start])
        end = text.find("</interpreter>", start)
        if end < 0:
            return "".join(parts)
        i = end + len("</interpreter>")
    parts.append(text[i:])
    return "".join(parts)


def answer_tag(text: str) -> str | None:
    """The content of the last `<answer>...</answer>` (unclosed: to the end); None if there is none."""
    start = text.rfind("<answer>")
    if start < 0:
        return None
    start += len("<answer>")
    end = text.find("</answer>", start)
    return text[start:] if end < 0 else text[start:end]


def last_boxed(text: str) -> str | None:
    r"""The content of the last \boxed{...} or \fbox{...}, with nested braces; None if there is
    none or its braces do not close."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


_ANSWER_LINE = re.compile(r"\**answer\**\s*:\**\s*(.*)", re.IGNORECASE)


def answer_line(text: str) -> str | None:
    """What follows `Answer:` on the last line that starts with it (DAPO's convention)."""
    for line in reversed(text.splitlines()):
        if m := _ANSWER_LINE.match(line.strip()):
            return m.group(1).strip().rstrip(".").strip()
    return None


def hashes(text: str) -> str | None:
    """What follows the last `####` on its line (GSM8K's convention)."""
    _, sep, rest = text.rpartition("####")
    return rest.strip().split("\n", 1)[0].strip() if sep else None


EXTRACTORS = {"boxed": last_boxed, "answer_line": answer_line, "hashes": hashes}

# data_source prefix -> conventions tried in order; the first that finds an answer wins.
CONVENTIONS: list[tuple[str, tuple[str, ...]]] = [
    ("tool_arith", ("boxed",)),  # tool_arith and tool_arith_unseen: the task's prompt asks for \boxed{N}
    ("dapo", ("boxed", "answer_line")),  # the tool-use prompt asks for \boxed{}; DAPO's own asks for "Answer:"
    ("aime", ("boxed", "answer_line")),
    ("gsm8k", ("hashes", "boxed")),
]
DEFAULT_CONVENTIONS = ("boxed", "answer_line", "hashes")


def conventions(data_source: str | None) -> tuple[str, ...]:
    source = (data_source or "").lower()
    return next((conv for prefix, conv in CONVENTIONS if source.startswith(prefix)), DEFAULT_CONVENTIONS)


def extract_answer(response: str, data_source: str | None = None) -> str | None:
    """The model's final answer in its response text; None if it gave none in a known format.
    Inside an `<answer>` tag with no other convention (and no broken \\boxed), the tag's whole
    content is the answer."""
    text = strip_interpreter(response)
    tagged = answer_tag(text)
    for name in conventions(data_source):
        answer = EXTRACTORS[name](text if tagged is None else tagged)
        if answer is not None and answer.strip():
            return answer.strip()
    if tagged is None or "\\boxed" in tagged or "\\fbox" in tagged:
        return None
    return tagged.strip() or None


_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_SPACING = re.compile(r"\\[!,;: ]|\\left|\\right|\s|\$")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def normalize_answer(answer: str) -> str:
    r"""Strip what never changes an answer: spacing, $, \left/\right, \text{} wrappers, \dfrac,
    a trailing period, thousands separators of a number, and a number's `.0`."""
    answer = _TEXT_WRAPPER.sub(r"\1", answer)
    answer = _SPACING.sub("", answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")).rstrip(".")
    if _THOUSANDS.fullmatch(answer):
        answer = answer.replace(",", "")
    if re.fullmatch(r"-?\d+\.0*", answer):
        answer = answer.split(".")[0]
    return answer


_INTEGER = re.compile(r"-?\d+")


def judge(answer: str | None, ground_truth: str, verifier: MathVerifier | None) -> dict[str, float]:
    """Is `answer` equal to the ground truth? -> {acc, has_answer, verify_timeout} (each 0.0 or 1.0).

    An exact match after normalization is correct; two different integers are wrong; anything else
    goes to math-verify (fractions, LaTeX, units, percentages, numeric tolerance), whose "unparsed"
    leaves the exact comparison's "no". No verifier: exact comparison only.
    """
    out = {"acc": 0.0, "has_answer": float(answer is not None), "verify_timeout": 0.0}
    if answer is None:
        return out
    a, g = normalize_answer(answer), normalize_answer(ground_truth)
    if a and a == g:
        out["acc"] = 1.0
    elif _INTEGER.fullmatch(a) and _INTEGER.fullmatch(g) and max(len(a), len(g)) <= MAX_ANSWER_CHARS:
        out["acc"] = float(int(a) == int(g))  # "007" is 7
    elif verifier is not None and len(answer) <= MAX_ANSWER_CHARS and len(ground_truth) <= MAX_ANSWER_CHARS:
        verdict = verifier.verdict(ground_truth, answer)
        out["acc"] = float(verdict == "equal")
        out["verify_timeout"] = float(verdict in ("timeout", "crashed"))
    return out
