"""The Tinker API over HTTP (aiohttp): the routes the `tinker` client (0.38) calls, each handed to
raytool.tinker.service. Point a client at it with `TINKER_BASE_URL=http://host:port` (or
`ServiceClient(base_url=...)`) and any key that starts with `tml-` in `TINKER_API_KEY` (the one given
to `--api-key`, when the service was started with one)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

from aiohttp import web

from raytool.tinker.errors import Refused, Unauthorized, Unknown
from raytool.tinker.service import Result, TinkerService
from raytool.tinker.wire import PROTO, decode_forward_backward

log = logging.getLogger(__name__)

# What the client's /client/config asks for: API keys (no token exchange), plain httpx, forward_backward
# chunks one after another (the service runs a model's calls in arrival order), custom losses on the client.
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "parallel_fwdbwd_chunks": False,
                 "proto_compress_fwdbwd": False, "use_pyqwest_transport": False, "sample_use_retrieve_futures": False,
                 "custom_loss_server_side": False, "sample_join_sampling_session": False}


def _future(rid: str, **extra) -> web.Response:
    return web.json_response({"request_id": rid, **extra})


async def _body(request: web.Request) -> dict:
    return await request.json() if request.can_read_body else {}


def _session_routes(routes: web.RouteTableDef, service: TinkerService) -> None:
    """The client's configuration, health, capabilities, telemetry and its session's life."""

    @routes.post("/api/v1/client/config")
    async def client_config(request):
        return web.json_response(CLIENT_CONFIG)

    @routes.post("/api/v1/client/dynamic_config")
    async def dynamic_config(request):
        return web.json_response({"refresh_interval_sec": 300})

    @routes.get("/api/v1/healthz")
    async def healthz(request):
        return web.json_response({"status": "ok"})

    @routes.get("/api/v1/get_server_capabilities")
    async def capabilities(request):
        return web.json_response({"supported_models": [{"model_name": name, "trainable": True, "sampleable": True} for name in service.models]})

    @routes.post("/api/v1/telemetry")
    async def telemetry(request):
        return web.json_response({"status": "accepted"})

    @routes.post("/api/v1/create_session")
    async def create_session(request):
        await _body(request)
        return web.json_response({"type": "create_session", "session_id": service.create_session()})

    @routes.post("/api/v1/session_heartbeat")
    async def heartbeat(request):
        sid = (await _body(request))["session_id"]
        if sid not in service.sessions:  # 410: the client's heartbeat loop stops; its next call is told why
            return web.json_response({"detail": f"session '{sid}' has ended"}, status=410)
        service.session(sid)
        return web.json_response({"type": "session_heartbeat"})

    @routes.post("/api/v1/sessions/{session_id}/finish")
    async def finish(request):
        service.finish(request.match_info["session_id"])
        return web.json_response(None)


def _model_routes(routes: web.RouteTableDef, service: TinkerService) -> None:
    """Training models, their saves and loads, samplers, and the futures of every queued call."""

    @routes.post("/api/v1/create_model")
    async def create_model(request):
        b = await _body(request)
        optimizer = (b.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise Refused(f"optimizer '{optimizer}' is not served here; raytool trains with Adam (AdamOptimizerConfig)")
        return _future(service.create_model(b["session_id"], b["model_seq_id"], b["base_model"], b.get("lora_config")))

    @routes.post("/api/v1/get_info")
    async def get_info(request):
        return web.json_response(service.info((await _body(request))["model_id"]))

    @routes.post("/api/v1/forward_backward")
    async def forward_backward(request):
        if request.content_type != PROTO:
            raise Refused(f"forward_backward takes a protobuf body ({PROTO}), got {request.content_type}")
        req = decode_forward_backward(await request.read())
        return _future(service.forward_backward(req), model_id=req.model_id)

    @routes.post("/api/v1/optim_step")
    async def optim_step(request):
        b = await _body(request)
        return _future(service.optim_step(b["model_id"], b.get("adam_params") or b.get("optimizer_params") or b.get("optim_params") or {}),
                       model_id=b["model_id"])

    @routes.post("/api/v1/save_weights")
    async def save_weights(request):
        b = await _body(request)
        return _future(service.save_state(b["model_id"], b.get("path"), b.get("ttl_seconds")), model_id=b["model_id"])

    @routes.post("/api/v1/load_weights")
    async def load_weights(request):
        b = await _body(request)
        if b.get("weights_access_token"):
            raise Refused("load_weights: weights_access_token (another account's checkpoint) is not served here")
        if b.get("session_id"):
            return _future(service.create_from_state(b["session_id"], b["model_seq_id"], b["path"], bool(b.get("optimizer")),
                                                     b.get("base_model")))
        return _future(service.load_state(b["model_id"], b["path"], bool(b.get("optimizer"))), model_id=b["model_id"])

    @routes.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request):
        b = await _body(request)
        if b.get("kind", "snapshot") != "snapshot":
            raise Refused(f"save_weights_for_sampler: kind '{b['kind']}' is not served here; raytool serves snapshot samplers")
        return _future(service.save_for_sampler(b["model_id"], b.get("path"), b.get("ttl_seconds")), model_id=b["model_id"])

    @routes.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request):
        b = await _body(request)
        sid = service.create_sampler(b["session_id"], b.get("base_model"), b.get("model_path"))
        return web.json_response({"type": "create_sampling_session", "sampling_session_id": sid})

    @routes.get("/api/v1/samplers/{sampler_id}")
    async def sampler(request):
        return web.json_response(service.sampler_info(request.match_info["sampler_id"]))

    @routes.post("/api/v1/asample")
    async def asample(request):
        rid, sequence_ids = service.sample(await _body(request))
        return _future(rid, sample_sequence_ids=sequence_ids)

    @routes.post("/api/v1/retrieve_future")
    async def retrieve(request):
        out = await service.retrieve((await _body(request))["request_id"])
        if isinstance(out, Result) and isinstance(out.body, bytes):
            return web.Response(body=out.body, content_type=PROTO)
        return web.json_response(out.body if isinstance(out, Result) else out)


def build_app(service: TinkerService, api_key: str | None = None) -> web.Application:
    routes = web.RouteTableDef()
    _session_routes(routes, service)
    _model_routes(routes, service)

    @web.middleware
    async def guard(request: web.Request, handler):
        if api_key is not None and request.headers.get("X-API-Key") != api_key:
            return web.json_response({"detail": "wrong or missing API key (X-API-Key; TINKER_API_KEY on the client)"}, status=Unauthorized.status)
        try:
            return await handler(request)
        except Refused as exc:
            return web.json_response({"detail": str(exc)}, status=exc.status)
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            return web.json_response({"detail": f"{request.method} {request.path}: malformed request ({type(exc).__name__}: {exc})"}, status=400)

    served = sorted({f"{r.method} {r.path}" for r in routes if isinstance(r, web.RouteDef)})

    async def not_served(request):
        return web.json_response({"detail": f"{request.method} {request.path} is not served by raytool's Tinker service "
                                            f"(it serves the training, sampling and checkpoint calls: {', '.join(served)})"}, status=400)

    app = web.Application(middlewares=[guard], client_max_size=1 << 30)
    app.add_routes(routes)
    app.router.add_route("*", "/{tail:.*}", not_served)
    return app


async def _reap(service: TinkerService, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        service.release_idle()


def serve(service: TinkerService, host: str, port: int, *, api_key: str | None = None, stop: threading.Event | None = None,
          ready: threading.Event | None = None, bound: list | None = None) -> None:
    """Serve until `stop` is set (or KeyboardInterrupt). `bound`: receives the port listened on
    (port 0: a free one); `ready` is set once it listens."""
    stop = stop or threading.Event()

    async def main():
        runner = web.AppRunner(build_app(service, api_key), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        if bound is not None:
            bound.append(site._server.sockets[0].getsockname()[1])
        reaper = asyncio.ensure_future(_reap(service, min(10.0, max(service.session_ttl_s / 4, 0.5))))
        if ready is not None:
            ready.set()
        try:
            while not stop.is_set():
                await asyncio.sleep(0.2)
        finally:
            reaper.cancel()
            service.close()
            await runner.cleanup()

    asyncio.run(main())


def serve_config(cfg, args) -> None:
    """`raytool serve --tinker`: the service of `cfg`'s trainer settings over the --model base models."""
    from raytool.config import ConfigError
    from raytool.models import resolve_model

    models = {}
    for spec in args.model or [cfg.model.path]:
        name, _, path = spec.partition("=") if "=" in spec else (spec, "", spec)
        if not name or not path:
            raise ConfigError(f"--model {spec!r}: expected NAME=PATH")
        models[name] = resolve_model(path)
    service = TinkerService(models, args.checkpoints, cfg, session_ttl_s=args.session_ttl, max_training_models=args.max_training_models)
    where = f"http://{args.host}:{args.port}"
    print(f"Tinker API at {where} (base models: {', '.join(models)}; checkpoints in {args.checkpoints}; trainers and {service.engine_name} "
          f"samplers on {service.device} in this process). Point a client at it: TINKER_BASE_URL={where} "
          f"TINKER_API_KEY={args.api_key or 'tml-<anything>'}; Ctrl-C stops it", flush=True)
    try:
        serve(service, args.host, args.port, api_key=args.api_key)
    except KeyboardInterrupt:
        pass
