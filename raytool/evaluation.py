"""Validation metrics from sampled trajectories, named as verl names them.

Each validation prompt is sampled k times (temperature as configured, as the reference recipes do);
per data source:
- `val-core/<source>/acc/mean@k`: accuracy averaged over all samples;
- `val-core/<source>/acc/maj@k`: accuracy of the majority answer of each prompt's k samples;
- `val-core/<source>/acc/pass@k`: share of prompts with at least one correct sample;
- `val-aux/<source>/...`: reward mean@k, mean turns, tool calls per trajectory, share of
  trajectories that call a tool, tool error rate (errors per call), response length;
and the same auxiliary metrics over all sources as `val-aux/<metric>`. A source is one segment of
the name: its '/' and '%' are percent-escaped (`source_segment`; verl's gsm8k, MATH and geometry3k
preprocessing write `openai/gsm8k`-style names).
"""

from __future__ import annotations

from collections import Counter, defaultdict

import msgspec


def source_segment(source: str) -> str:
    """A data source as one segment of a metric name ('openai/gsm8k' -> 'openai%2Fgsm8k')."""
    return source.replace("%", "%25").replace("/", "%2F")


def source_name(segment: str) -> str:
    """The data source a metric name's segment stands for (the inverse of source_segment)."""
    return segment.replace("%2F", "/").replace("%25", "%")


class EvalSample(msgspec.Struct):
    """One sampled trajectory of a validation prompt, as the metrics need it."""

    data_source: str
    prompt: int  # index of its prompt: the k samples of one prompt share it
    acc: float  # 1.0 correct, 0.0 wrong
    reward: float
    answer: str | None  # the extracted final answer (None: none given); majority votes count these
    num_turns: int
    tool_calls: int
    tool_errors: int
    response_length: int
    acc_from_score: bool = False  # the reward fn gave no `acc`: acc is score >= raytool.types.ACC_THRESHOLD


def _aux(samples: list[EvalSample], prefix: str) -> dict[str, float]:
    n = len(samples)
    calls = sum(s.tool_calls for s in samples)
    return {
        f"{prefix}num_turns/mean": sum(s.num_turns for s in samples) / n,
        f"{prefix}tool/calls_per_traj": calls / n,
        f"{prefix}tool/call_rate": sum(s.tool_calls > 0 for s in samples) / n,
        f"{prefix}tool/error_rate": sum(s.tool_errors for s in samples) / calls if calls else 0.0,
        f"{prefix}response_length/mean": sum(s.response_length for s in samples) / n,
    }


def majority_correct(group: list[EvalSample]) -> float:
    """Whether the most frequent answer of a prompt's samples is correct (ties: the earliest
    sample's answer among the most frequent; no answer at all counts as wrong)."""
    answered = [s for s in group if s.answer is not None]
    if not answered:
        return 0.0
    counts = Counter(s.answer for s in answered)
    top = max(counts.values())
    winner = next(s.answer for s in answered if counts[s.answer] == top)
    return max(s.acc for s in answered if s.answer == winner)


def summarize(samples: list[EvalSample], k: int) -> dict[str, float]:
    """The validation metrics of samples (k per prompt)."""
    if not samples:
        raise ValueError("no validation samples to summarize")
    metrics: dict[str, float] = {}
    by_source: dict[str, list[EvalSample]] = defaultdict(list)
    for s in samples:
        by_source[s.data_source].append(s)
    for name in sorted(by_source):
        group, source = by_source[name], source_segment(name)
        prompts: dict[int, list[EvalSample]] = defaultdict(list)
        for s in group:
            prompts[s.prompt].append(s)
        metrics[f"val-core/{source}/acc/mean@{k}"] = sum(s.acc for s in group) / len(group)
        metrics[f"val-core/{source}/acc/maj@{k}"] = sum(majority_correct(p) for p in prompts.values()) / len(prompts)
        metrics[f"val-core/{source}/acc/pass@{k}"] = sum(max(s.acc for s in p) for p in prompts.values()) / len(prompts)
        metrics[f"val-aux/{source}/reward/mean@{k}"] = sum(s.reward for s in group) / len(group)
        metrics[f"val-aux/{source}/prompts"] = float(len(prompts))
        metrics.update(_aux(group, f"val-aux/{source}/"))
    metrics.update(_aux(samples, "val-aux/"))
    metrics["val-aux/acc_from_score"] = sum(s.acc_from_score for s in samples) / len(samples)
    return metrics


def sources(metrics: dict[str, float]) -> list[str]:
    """The data sources' segments (source_segment) that `metrics` holds validation accuracies of."""
    return sorted({key.split("/")[1] for key in metrics if key.startswith("val-core/")})


def table(metrics: dict[str, float], k: int) -> str:
    """One row per data source: the core accuracies and the tool-use figures."""
    columns = [("prompts", "val-aux/{s}/prompts", "{:.0f}"), (f"mean@{k}", f"val-core/{{s}}/acc/mean@{k}", "{:.3f}"),
               (f"maj@{k}", f"val-core/{{s}}/acc/maj@{k}", "{:.3f}"), (f"pass@{k}", f"val-core/{{s}}/acc/pass@{k}", "{:.3f}"),
               ("turns", "val-aux/{s}/num_turns/mean", "{:.2f}"), ("calls/traj", "val-aux/{s}/tool/calls_per_traj", "{:.2f}"),
               ("call rate", "val-aux/{s}/tool/call_rate", "{:.2f}"), ("tool err", "val-aux/{s}/tool/error_rate", "{:.2f}"),
               ("length", "val-aux/{s}/response_length/mean", "{:.0f}")]
    rows = [["source", *(name for name, _, _ in columns)]]
    rows += [[source_name(s), *(fmt.format(metrics[key.format(s=s)]) for _, key, fmt in columns)] for s in sources(metrics)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))) for r in rows)
