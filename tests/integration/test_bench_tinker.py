"""`raytool bench tinker` end to end on the tiny model, one round: the same batch through the
Tinker API (the real client on loopback) and through `Trainer.rl_step`, and the figures it reports."""

import pytest

pytest.importorskip("tinker")

from raytool.bench import run_bench  # noqa: E402
from raytool.config import load_config  # noqa: E402

pytestmark = pytest.mark.integration


def test_the_bench_times_both_updates_of_the_same_batch():
    table, result = run_bench("tinker", load_config(None, ["model.path=tiny-random", "trainer.compute_dtype=float32"]), 1)
    assert result["tinker_step_s"] > 0 and result["rl_step_s"] > 0
    assert result["tinker_vs_rl_step"] == pytest.approx(result["tinker_step_s"] / result["rl_step_s"])
    assert (result["sequences"], result["lora_rank"], result["repeats"]) == (8, 16, 1) and result["tokens"] > 8 * 96
    assert "Tinker API (forward_backward + optim_step)" in table and f"tinker_vs_rl_step = {result['tinker_vs_rl_step']:.2f}" in table
