"""RUN_DIR/ledger.jsonl: what became of every prompt group a run drew. One line per step: the
groups drawn, trained, dropped (with the reason) and failed (with the cause: an infrastructure
failure that outlasted rollout.max_group_retries); a last line names those still unfinished when
the run ended. A resumed run first cuts the lines after its checkpoint's step (those steps are
done again), so at the end every drawn group is trained, dropped, failed or unfinished exactly once."""

from __future__ import annotations

import json
from pathlib import Path

from raytool.tracking import keep_lines

FILE = "ledger.jsonl"


class LedgerError(ValueError):
    pass


class Ledger:
    def __init__(self, run_dir: Path, resume_step: int | None = None):
        self.path = Path(run_dir) / FILE
        if resume_step is not None:
            keep_lines(self.path, lambda entry: entry.get("step", 0) <= resume_step and "unfinished" not in entry)

    def _append(self, entry: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    def record(self, step: int, drawn: list[str], trained: list[str], dropped: dict[str, list[str]], failed: dict[str, str] | None = None) -> None:
        self._append({"step": step, "drawn": drawn, "trained": trained, "dropped": dropped, "failed": failed or {}})

    def finish(self, step: int, unfinished: list[str]) -> None:
        self._append({"step": step, "unfinished": unfinished})


def audit(run_dir: Path) -> dict:
    """Check a finished run's ledger: every drawn group has exactly one outcome and nothing has an
    outcome without being drawn -> counts per outcome. LedgerError names the groups that break it."""
    drawn, outcomes = [], []
    for line in (Path(run_dir) / FILE).read_text().splitlines():
        entry = json.loads(line)
        drawn += entry.get("drawn", [])
        outcomes += [(key, "trained") for key in entry.get("trained", [])]
        outcomes += [(key, f"dropped:{reason}") for reason, keys in entry.get("dropped", {}).items() for key in keys]
        outcomes += [(key, "failed") for key in entry.get("failed", {})]
        outcomes += [(key, "unfinished") for key in entry.get("unfinished", [])]
    seen: dict[str, str] = {}
    for key, outcome in outcomes:
        if key in seen:
            raise LedgerError(f"group {key} is both {seen[key]} and {outcome}")
        seen[key] = outcome
    if len(set(drawn)) != len(drawn):
        raise LedgerError(f"groups drawn twice: {sorted({k for k in drawn if drawn.count(k) > 1})}")
    if set(seen) != set(drawn):
        raise LedgerError(f"drawn without an outcome: {sorted(set(drawn) - set(seen))}; an outcome without a draw: {sorted(set(seen) - set(drawn))}")
    counts: dict[str, int] = {"drawn": len(drawn)}
    for outcome in seen.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return counts


def outcome_metrics(outcomes: dict) -> dict:
    """A step's ledger entry as metrics: groups drawn, trained, dropped and failed during the step."""
    return {
        "ledger/drawn": len(outcomes["drawn"]),
        "ledger/trained": len(outcomes["trained"]),
        "ledger/dropped": sum(len(keys) for keys in outcomes["dropped"].values()),
        "ledger/failed": len(outcomes.get("failed", {})),
    }
