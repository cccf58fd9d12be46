"""What `raytool chaos` checks after a run it injected faults into (no Ray here: the run directory's
files): every step logged once and in order, policy versions going up one per step, and the ledger
reconciling (every drawn group trained, dropped, failed or unfinished exactly once)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from raytool.ledger import LedgerError, audit

# The actor kinds a chaos run can hit, and what each is in the run: the Ray actor class whose
# process is killed or stopped ("engine": the vLLM engine-core process inside a rollout server).
KINDS = {"agent": "AgentLoopWorker", "reward": "RewardWorker", "sandbox": "SandboxPool", "manager": "LLMManager",
         "server": "RolloutServer", "engine": "RolloutServer", "trainer": "TrainerWorker"}
STOPPABLE = {"agent", "reward", "sandbox", "manager", "server", "trainer"}  # a stopped process of these is found by the heartbeat


class Schedule:
    """Which kind the next fault hits and how: among the kinds hit least so far (so a short run hits
    each), at random (seeded); with `hang`, a stoppable kind is stopped (SIGSTOP) half the time."""

    def __init__(self, kinds: list[str], hang: bool, seed: int):
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown:
            raise ValueError(f"unknown fault kinds {unknown}; expected some of {sorted(KINDS)}")
        self.hits = {kind: 0 for kind in kinds}
        self.hang = hang
        self.rng = random.Random(seed)

    def next(self) -> tuple[str, str]:
        """-> (kind, "kill" or "stop")."""
        fewest = min(self.hits.values())
        kind = self.rng.choice(sorted(k for k, n in self.hits.items() if n == fewest))
        self.hits[kind] += 1
        how = "stop" if self.hang and kind in STOPPABLE and self.rng.random() < 0.5 else "kill"
        return kind, how


def check_run(run_dir: Path, total_steps: int) -> dict:
    """The invariants of a finished run -> {name: ok} plus the ledger's counts; never raises."""
    run_dir = Path(run_dir)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").is_file() else []
    steps = [json.loads(line) for line in lines]
    versions = [m["policy_version"] for m in steps]
    out: dict = {
        "steps": len(steps),
        "every_step_logged": [m["step"] for m in steps] == list(range(1, total_steps + 1)),
        "versions_monotone": all(b == a + 1 for a, b in zip(versions, versions[1:])),
        "groups_retried": sum(m.get("rollout/groups_retried", 0) for m in steps),
        "groups_failed": sum(m.get("rollout/groups_failed", 0) for m in steps),
    }
    try:
        counts = audit(run_dir)
        out["ledger_reconciles"] = True
        out["ledger"] = counts
        out["lost"] = 0
    except (LedgerError, OSError) as exc:
        out["ledger_reconciles"] = False
        out["ledger_error"] = str(exc)
    return out
