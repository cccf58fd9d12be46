import pytest

from raytool.routing import NoHealthyServer, Router


def test_least_in_flight_with_decrement_on_completion():
    r = Router(["a", "b", "c"])
    picks = [r.pick() for _ in range(3)]
    assert sorted(picks) == ["a", "b", "c"]
    assert r.in_flight == {"a": 1, "b": 1, "c": 1}
    r.done("b")
    assert r.pick() == "b"
    r.done("a"), r.done("a")
    assert r.in_flight["a"] == 0 and r.pick() == "a"


def test_sticky_session_keeps_its_server_even_when_busier():
    r = Router(["a", "b"])
    first = r.pick(session="traj-1")
    for _ in range(5):
        r.pick(session="traj-1")
    assert r.in_flight[first] == 6
    r.end_session("traj-1")
    assert r.pick(session="traj-1") != first  # a new session goes to the least loaded


def test_group_affinity_with_slack():
    r = Router(["a", "b"], affinity_slack=1)
    home = r.pick(session="s0", group="g")
    assert r.pick(session="s1", group="g") == home  # 1 in flight vs 0: within slack
    other = r.pick(session="s2", group="g")
    assert other != home  # 2 vs 0 exceeds the slack: least loaded wins


def test_ejected_server_is_skipped_and_sessions_move():
    r = Router(["a", "b"])
    s = r.pick(session="x")
    r.eject(s, "died")
    assert r.pick(session="x") != s
    r.restore(s)
    r2 = Router(["a", "b"], affinity_slack=100)
    home = r2.pick(group="g")
    r2.eject(home, "died")
    new_home = r2.pick(group="g")
    r2.restore(home)
    assert r2.pick(group="g") == new_home  # the group moved for good, not back and forth
    r.eject("a", "died"), r.eject("b", "died")
    with pytest.raises(NoHealthyServer, match="ejected"):
        r.pick()


def test_retry_excludes_the_failed_server_and_the_session_follows():
    r = Router(["a", "b", "c"])
    first = r.pick(session="x")
    retry = r.pick(session="x", exclude={first})
    assert retry != first
    r.done(first, ok=False)
    assert r.pick(session="x") == retry  # the conversation now lives on the retry's server
    with pytest.raises(NoHealthyServer, match="excluded for this request: a, b, c"):
        r.pick(session="x", exclude=["a", "b", "c"])


def test_in_flight_is_exact_on_success_and_failure():
    r = Router(["a", "b"])
    for _ in range(4):
        r.pick()
    r.done("a", ok=True, latency_s=1.0)
    r.done("a", ok=False, latency_s=3.0)
    r.done("b", ok=False)
    assert r.in_flight == {"a": 0, "b": 1}
    r.done("a")  # nothing in flight there: a caller's double done must not go below zero or count
    a = r.stats()["servers"]["a"]
    assert (r.in_flight["a"], a["requests"], a["ok"], a["failed"], a["mean_latency_s"]) == (0, 2, 1, 1, 2.0)
    with pytest.raises(KeyError, match="unknown server 'z'"):
        r.done("z")


def test_group_stays_within_slack_then_moves_home_to_the_least_loaded():
    r = Router(["a", "b", "c"], affinity_slack=2)
    picks = []
    for i in range(9):
        before = dict(r.in_flight)
        picks.append(r.pick(session=f"s{i}", group="g"))
        assert before[picks[-1]] - min(before.values()) <= 2
    # a fills to 3 (2 above the idle others), then b takes the 4th and becomes home, then c
    assert picks == ["a", "a", "a", "b", "b", "b", "c", "c", "c"]


def test_eject_moves_sessions_and_groups_and_readmit_starts_clean():
    r = Router(["a", "b", "c"], affinity_slack=100)
    assert r.pick(session="x", group="g") == "a"
    assert r.pick(session="y", group="g") == "a"
    r.eject("a", "actor died")
    moved = r.pick(session="x", group="g")
    assert moved != "a"
    assert r.pick(session="z", group="g") == moved  # the group re-homed with x, not scattered
    assert r.in_flight["a"] == 2  # its requests still in flight will call done()
    r.done("a", ok=False), r.done("a", ok=False)
    r.readmit("a")
    assert r.pick(session="y") == "c"  # y's pin died with the ejection (alive, it would say "a")
    assert r.pick(session="w", group="g") == moved  # the group does not come back
    s = r.stats()["servers"]["a"]
    assert (s["ejected"], s["ejections"], s["failed"]) == (None, 1, 2)


def test_no_healthy_server_names_every_ejected_server_and_why():
    r = Router(["a", "b"])
    r.eject("a", "OOM"), r.eject("b", "actor died")
    r.eject("a", "actor restarting")  # a consequence of the first failure: the cause stays, counted once
    assert r.stats()["servers"]["a"]["ejections"] == 1
    with pytest.raises(NoHealthyServer, match=r"a \(OOM\), b \(actor died\)"):
        r.pick()
    assert r.stats()["ejected"] == {"a": "OOM", "b": "actor died"}


def test_sessions_and_groups_tables_are_lru_bounded():
    r = Router(["a", "b"], max_sessions=2)
    assert [r.pick(session=s, group=s) for s in ("x", "y", "z")] == ["a", "b", "a"]
    assert r.pick(session="x") == "b"  # x was the oldest and forgotten; pinned it would be "a"
    assert r.pick(session="z") == "a"  # z is remembered even though "a" is now busier
    assert (r.stats()["sessions"], r.stats()["groups"]) == (2, 2)


def test_stats_reports_every_server():
    r = Router(["a", "b"])
    r.pick(session="x", group="g")
    r.pick(session="y", group="g")
    r.done("a", latency_s=0.5)
    r.eject("b", "timeout")
    assert r.stats() == {
        "servers": {
            "a": {"in_flight": 1, "requests": 2, "ok": 1, "failed": 0, "ejected": None, "ejections": 0, "mean_latency_s": 0.5},
            "b": {"in_flight": 0, "requests": 0, "ok": 0, "failed": 0, "ejected": "timeout", "ejections": 1, "mean_latency_s": None},
        },
        "sessions": 2,
        "groups": 1,
        "in_flight": {"a": 1, "b": 0},
        "ejected": {"b": "timeout"},
    }
