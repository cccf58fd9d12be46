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
