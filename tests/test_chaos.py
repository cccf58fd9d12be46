"""`raytool chaos`'s plain parts (raytool.chaos): the fault schedule and the checks of a finished run."""

import json

import pytest

from raytool.chaos import KINDS, STOPPABLE, Schedule, check_run
from raytool.ledger import Ledger


def test_the_schedule_hits_every_kind_before_any_twice_and_stops_only_what_the_heartbeat_finds():
    schedule = Schedule(sorted(KINDS), hang=True, seed=3)
    first = [schedule.next() for _ in range(len(KINDS))]
    assert sorted(kind for kind, _ in first) == sorted(KINDS)
    faults = first + [schedule.next() for _ in range(60)]
    assert {how for kind, how in faults if kind not in STOPPABLE} == {"kill"}  # the engine core is only killed
    assert {how for _, how in faults} == {"kill", "stop"}
    assert Schedule(["agent"], hang=False, seed=0).next() == ("agent", "kill")  # without --hang: kills only
    with pytest.raises(ValueError, match="unknown fault kinds"):
        Schedule(["learner"], hang=False, seed=0)


def _run(tmp_path, versions, trained_twice=False):
    tmp_path.mkdir()
    with (tmp_path / "metrics.jsonl").open("w") as f:
        for step, version in enumerate(versions, 1):
            f.write(json.dumps({"step": step, "policy_version": version, "rollout/groups_retried": 1}) + "\n")
    ledger = Ledger(tmp_path)
    for step in range(1, len(versions) + 1):
        ledger.record(step, drawn=[f"s{step}g0"], trained=[f"s{step}g0"] + (["s1g0"] if trained_twice and step == 2 else []), dropped={})
    return tmp_path


def test_the_checks_of_a_run_that_lost_nothing_pass_and_each_break_is_found(tmp_path):
    ok = check_run(_run(tmp_path / "ok", [2, 3, 4]), total_steps=3)
    assert ok["every_step_logged"] and ok["versions_monotone"] and ok["ledger_reconciles"] and ok["lost"] == 0
    assert ok["ledger"] == {"drawn": 3, "trained": 3} and ok["groups_retried"] == 3 and ok["steps"] == 3
    bad = check_run(_run(tmp_path / "bad", [2, 2], trained_twice=True), total_steps=3)
    assert not bad["every_step_logged"] and not bad["versions_monotone"] and not bad["ledger_reconciles"]
    assert "s1g0 is both trained and trained" in bad["ledger_error"]
