"""The metrics helpers without Ray: the tokens/s window, recording that never raises, the sandbox
pool's event counters (deltas of PooledBackend.counts)."""

import logging

import pytest

from actors import metrics
from actors.metrics import RateWindow


def test_rate_is_tokens_over_the_recent_window():
    w = RateWindow(window_s=10.0, buckets=10)
    for t in (1000.0, 1012.0, 1015.0):
        w.add(100, now=t)
    assert w.rate(now=1019.5) == pytest.approx(20.0)  # the last two adds are in the window: 200 tokens / 10 s
    assert w.rate(now=1022.5) == pytest.approx(10.0)  # the one at 1012 fell out
    assert w.rate(now=1026.0) == 0.0  # idle: the rate decays to zero


def test_a_fresh_window_does_not_read_low():
    w = RateWindow(window_s=30.0)
    w.add(50, now=500.0)
    w.add(50, now=502.0)
    assert w.rate(now=502.0) == pytest.approx(50.0)  # 100 tokens over the 2 s since the first
    assert RateWindow().rate() == 0.0


def test_a_failing_recorder_logs_once_and_does_not_raise(caplog):
    calls = []

    @metrics._never_raises
    def broken(x):
        calls.append(x)
        raise RuntimeError("agent gone")

    with caplog.at_level(logging.WARNING, logger="actors.metrics"):
        broken(1)
        broken(2)
    assert calls == [1, 2]
    assert [r.getMessage() for r in caplog.records if "agent gone" in r.getMessage()] != []
    assert len([r for r in caplog.records if "broken" in r.getMessage()]) == 1


class _Recorder:
    def __init__(self, log):
        self.log = log

    def inc(self, value, tags=None):
        self.log.append(("inc", value, dict(tags or {})))

    def set(self, value, tags=None):
        self.log.append(("set", value, dict(tags or {})))

    def observe(self, value, tags=None):
        self.log.append(("observe", value, dict(tags or {})))


def test_sandbox_events_count_what_the_pool_counted_since_the_last_sample(monkeypatch):
    from raytool.sandbox.pool import PooledBackend

    recorded: dict[str, list] = {}
    monkeypatch.setattr(metrics, "_metric", lambda kind, name, *a, **k: _Recorder(recorded.setdefault(name, [])))
    monkeypatch.setattr(metrics._Sampler, "add", lambda self, fn: None)  # no thread: the test samples by hand
    pool = PooledBackend(backend=None, name="p0")
    m = metrics.SandboxMetrics("p0", pool)
    pool.counts.update(rejected=3, retried=1)
    m.sample()
    pool.counts.update(rejected=2)
    pool.waiting = 4
    m.sample()
    m.cell_done("timeout", 5.0)
    assert recorded["raytool_sandbox_events"] == [("inc", 3, {"pool": "p0", "event": "rejected"}),
                                                  ("inc", 1, {"pool": "p0", "event": "retried"}),
                                                  ("inc", 2, {"pool": "p0", "event": "rejected"})]
    assert recorded["raytool_sandbox_queue_depth"][-1] == ("set", 4, {"pool": "p0"})
    assert recorded["raytool_sandbox_breaker_open"][-1] == ("set", 0.0, {"pool": "p0"})
    assert recorded["raytool_sandbox_cells"] == [("inc", 1, {"pool": "p0", "status": "timeout"})]
