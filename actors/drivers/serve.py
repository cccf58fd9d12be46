"""`raytool serve`: the rollout servers and the control plane of a config, and an OpenAI-compatible
gateway (actors.gateway) in front of them, until interrupted."""

from __future__ import annotations

import signal
import threading

import msgspec

from actors.drivers.compose import build
from actors.drivers.session import connect
from raytool.config import RunConfig


def serve(cfg: RunConfig, host: str, port: int, address: str | None = None, stop=None) -> None:
    """`raytool serve`: the rollout servers and the manager of `cfg`, and a gateway on host:port in
    front of them, until interrupted (Ctrl-C or SIGTERM; `stop`, a threading.Event, when set)."""
    connect(address or cfg.cluster.address)
    # the run's graph without a trainer, its gateway on this command's host and port
    cfg = msgspec.structs.replace(cfg, agent=msgspec.structs.replace(cfg.agent, gateway=True, gateway_host=host, gateway_port=port))
    graph = build(cfg, with_trainer=False)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        print(f"OpenAI-compatible API at {graph.gateway_url}/v1 (model {cfg.model.path!r}); Ctrl-C stops it", flush=True)
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        graph.shutdown()
