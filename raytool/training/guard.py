"""The run's guard against non-finite training. The trainer skips an update whose batch holds a
non-finite reward or advantage, or whose gradient norm is not finite (a NaN or infinite loss gives
one), and leaves the weights as they were; it never writes a checkpoint or an export from
non-finite weights (Trainer.check_finite). The driver says so after each such step, naming the
rows whose reward was not finite, and stops the run in one line after trainer.max_skipped_steps
such steps in a row: a reward function that returns NaN every time ends a run, it does not end in
a NaN model."""

from __future__ import annotations

import logging
import math

from raytool.errors import RaytoolError

log = logging.getLogger(__name__)


class SkippedUpdates(RaytoolError):
    """Too many GRPO steps in a row skipped their update."""


class UpdateGuard:
    """Counts the GRPO steps in a row whose update the trainer skipped (`after_step`)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0

    def after_step(self, step: int, metrics: dict, rows: list[tuple[str, float]]) -> None:
        """`metrics`: the step's (the trainer's `actor/skipped_updates`); `rows`: each trajectory's
        (where its prompt came from, its reward). A warning per skipping step; SkippedUpdates once
        `limit` steps in a row skipped."""
        skipped = int(metrics.get("actor/skipped_updates", 0))
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        bad = sorted({where for where, reward in rows if not math.isfinite(reward)})
        if bad:
            why = f"non-finite rewards from {', '.join(bad[:5])}" + (f" and {len(bad) - 5} more rows" if len(bad) > 5 else "")
        elif metrics.get("actor/nonfinite_advantage"):
            why = "non-finite advantages (a non-finite KL penalty in the reward)"
        else:
            why = f"a non-finite loss or gradient norm (actor/grad_norm {metrics.get('actor/grad_norm', float('nan'))})"
        line = f"step {step}: {skipped} update{'s' if skipped > 1 else ''} skipped, the weights left as they were: {why}"
        if self.in_a_row >= self.limit:
            raise SkippedUpdates(f"{self.in_a_row} GRPO steps in a row skipped their update (trainer.max_skipped_steps={self.limit}); {line}. "
                                 "No checkpoint holds non-finite weights: fix the reward function or lower trainer.lr, then resume")
        log.warning(line)
