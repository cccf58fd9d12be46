"""`raytool bench scale`: both layouts complete every call, alternating, and the table says so."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration


def test_scale_bench_runs_both_layouts_and_reports_their_ratio(ray_cluster, capsys):
    from raytool.cli import main

    assert main(["bench", "scale", "--json", "model.path=tiny-random", "agent.max_concurrent_trajectories=8"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    table = "\n".join(lines[:-1])
    assert "scale_vs_central" in table and "capped by its one routing process" in table
    calls = 4 * 8 * 2 * 3  # callers x trajectories at once x TRAJECTORIES_PER_ROUND x turns
    for layout in ("central", "direct"):
        assert [r["calls"] for r in result["all_rounds"][layout]] == [calls] * result["rounds"]
        assert result["layouts"][layout]["calls_per_s"] > 0 and result["layouts"][layout]["added_ms_p99"] >= result["layouts"][layout]["added_ms_p50"]
    # The direct layout's manager routes nothing: its CPU per call is the control plane's, far under the central one's.
    assert result["layouts"]["direct"]["manager_cpu_ms_per_call"] < result["layouts"]["central"]["manager_cpu_ms_per_call"]
    assert result["scale_vs_central"] == pytest.approx(result["layouts"]["direct"]["calls_per_s"] / result["layouts"]["central"]["calls_per_s"])
    assert set(result["router_pick_us"]) == {"8", "64", "256", "1024"} and set(result["projected_calls_per_s"]) == {"8", "64", "512"}
