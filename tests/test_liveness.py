"""Which late heartbeat means a hung actor (actors.common.Liveness): no Ray needed."""

from actors.common import Liveness


def test_a_process_that_answered_before_and_is_late_now_is_hung():
    live = Liveness()
    live.answered("reward-worker-0", 101)
    assert live.hung("reward-worker-0", 101)


def test_a_process_that_became_running_during_the_round_gets_one_more_interval():
    """The race CI met: a ping sent during the constructor, the actor reported running just as the
    interval ended. Late once: not hung; late again with the same process: hung."""
    live = Liveness()
    assert not live.hung("rollout-server-0", 202)
    assert live.hung("rollout-server-0", 202)


def test_a_restarted_process_is_not_judged_by_its_predecessor():
    live = Liveness()
    live.answered("agent-worker-0", 301)
    assert not live.hung("agent-worker-0", 302)  # Ray restarted it: a new pid, still starting
    live.answered("agent-worker-0", 302)
    assert live.hung("agent-worker-0", 302)


def test_an_actor_that_is_not_running_is_never_hung_and_starts_afresh():
    live = Liveness()
    assert not live.hung("sandbox-pool-0", 401)
    assert not live.hung("sandbox-pool-0", None)  # being restarted
    assert not live.hung("sandbox-pool-0", 401)  # running again: a fresh round of grace
