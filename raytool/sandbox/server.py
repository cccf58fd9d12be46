"""A SandboxFusion-compatible HTTP server in front of any SandboxBackend (`raytool sandbox serve`).

Routes: `POST /run_code` (SandboxFusion's request and response shape, python only),
`POST /close_session` (raytool's addition: `{"raytool_session": name}` frees that interpreter),
`GET /v1/ping` (answers "pong", as SandboxFusion does) and `GET /health`.

Extensions to SandboxFusion's request: `raytool_session` names a session whose interpreter state
carries over between calls (when the backend keeps state). Extension to its answer:
`raytool_truncated` says the backend cut stdout or stderr.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import errno
import logging
import posixpath
import socket

from aiohttp import web

from raytool.errors import RaytoolError
from raytool.types import ExecResult

log = logging.getLogger(__name__)

# SandboxFusion's defaults for a request that leaves them out.
DEFAULT_RUN_TIMEOUT_S = 10.0
# SandboxFusion reads memory_limit_MB <= 0 as "no limit"; the local backend always sets one, so
# those cells get the 4 GiB that SandboxFusion's own cgroup isolation gives every cell.
UNLIMITED_MEMORY_MB = 4096
# Request bodies carry files as base64; aiohttp's 1 MiB default would refuse modest inputs.
MAX_REQUEST_BYTES = 64 << 20
PYTHON_LANGUAGES = ("python", "python3")


class BadRequest(ValueError):
    """The request cannot be run as sent; the message says which field and why."""


def _number(body: dict, key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"field '{key}' must be a number, got {value!r}")
    return float(value)


def _decoded_files(files: object) -> dict[str, str]:
    """Check `files` (path -> base64) and return the entries to write, keyed by relative path."""
    if files is None:
        return {}
    if not isinstance(files, dict):
        raise BadRequest(f"field 'files' must be an object mapping a relative path to base64 content, got {type(files).__name__}")
    out = {}
    for path, content in files.items():
        if content is None:  # SandboxFusion skips entries without content
            continue
        norm = posixpath.normpath(path)
        if not path or posixpath.isabs(norm) or norm == ".." or norm.startswith("../"):
            raise BadRequest(f"file path {path!r} must be relative and stay inside the cell's working directory")
        if not isinstance(content, str):
            raise BadRequest(f"content of file {path!r} must be a base64 string")
        try:
            base64.b64decode(content, validate=True)
        except binascii.Error as exc:
            raise BadRequest(f"content of file {path!r} is not valid base64: {exc}") from None
        out[norm] = content
    return out


def with_inputs(code: str, stdin: str | None, files: dict[str, str]) -> str:
    """The cell as the backend runs it: `files` written into its working directory and `stdin` as
    its standard input, before `code` runs.

    The backend protocol has neither, so a short preamble provides them. The code then runs
    through `compile(..., "<cell>")` so that its traceback line numbers stay its own, and the real
    stdin comes back afterwards (a session's interpreter may read its next cell from it).
    """
    if stdin is None and not files:
        return code
    lines = ["import base64 as __rt_b64, io as __rt_io, os as __rt_os, sys as __rt_sys"]
    for path, content in files.items():
        lines.append(f"__rt_os.makedirs(__rt_os.path.dirname({path!r}) or '.', exist_ok=True)")
        lines.append(f"with open({path!r}, 'wb') as __rt_f: __rt_f.write(__rt_b64.b64decode({content!r}))")
    lines.append("__rt_stdin = __rt_sys.stdin")
    if stdin is not None:
        lines.append(f"__rt_sys.stdin = __rt_io.TextIOWrapper(__rt_io.BytesIO({stdin.encode()!r}), encoding='utf-8')")
    lines += [
        "try:",
        f"    exec(compile({code!r}, '<cell>', 'exec'), globals())",
        "finally:",
        "    __rt_sys.stdin = __rt_stdin",
        "    del __rt_b64, __rt_io, __rt_os, __rt_sys, __rt_stdin" + (", __rt_f" if files else ""),
    ]
    return "\n".join(lines) + "\n"


def _response(status: str, message: str = "", run_result: dict | None = None, truncated: bool = False) -> web.Response:
    return web.json_response({
        "status": status,
        "message": message,
        "compile_result": None,
        "run_result": run_result,
        "executor_pod_name": None,
        "files": {},
        "raytool_truncated": truncated,
    })


def to_response(result: ExecResult) -> web.Response:
    """Map an ExecResult to SandboxFusion's answer."""
    run = {"status": "Finished", "execution_time": result.duration_s, "return_code": result.exit_code,
           "stdout": result.stdout, "stderr": result.stderr}
    if result.status == "ok":
        run["return_code"] = 0
        return _response("Success", run_result=run, truncated=result.truncated)
    if result.status == "timeout":
        run.update(status="TimeLimitExceeded", return_code=None)
        return _response("Failed", run_result=run, truncated=result.truncated)
    if result.status == "infra_error":
        run.update(status="Error", return_code=None)
        return _response("SandboxError", message=result.stderr or "the sandbox backend failed", run_result=run)
    # error, oom, killed: the process ended badly. A session's interpreter can report an error with
    # no exit code of its own; SandboxFusion clients read failure from a non-zero code, so give one.
    if not result.exit_code:
        run["return_code"] = -9 if result.status == "killed" else 1
    return _response("Failed", run_result=run, truncated=result.truncated)


async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except ValueError as exc:  # json.JSONDecodeError and a body that is not UTF-8
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def make_app(backend, max_concurrency: int = 32) -> web.Application:
    """The HTTP app serving `backend` (anything with the SandboxBackend methods), running at most
    `max_concurrency` cells at once (the rest wait their turn, as behind SandboxFusion's own limit)."""
    slots = asyncio.Semaphore(max_concurrency)

    async def run_code(request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
            code = body.get("code")
            if not isinstance(code, str):
                raise BadRequest("field 'code' (a string of source code) is required")
            language = body.get("language")
            if not isinstance(language, str):
                raise BadRequest("field 'language' is required, e.g. \"python\"")
            timeout_s = _number(body, "run_timeout", DEFAULT_RUN_TIMEOUT_S)
            if timeout_s <= 0:
                raise BadRequest(f"field 'run_timeout' must be positive, got {timeout_s}")
            memory_mb = int(_number(body, "memory_limit_MB", -1))
            stdin = body.get("stdin")
            if stdin is not None and not isinstance(stdin, str):
                raise BadRequest("field 'stdin' must be a string")
            files = _decoded_files(body.get("files"))
            session = body.get("raytool_session")
            if session is not None and not isinstance(session, str):
                raise BadRequest("field 'raytool_session' must be a string")
        except BadRequest as exc:
            return web.json_response({"detail": str(exc)}, status=400)
        if language not in PYTHON_LANGUAGES:
            return _response("Failed", message=f"raytool's sandbox server runs only python (language 'python' or 'python3'), not {language!r}")
        try:
            async with slots:
                result = await backend.run(
                    with_inputs(code, stdin, files), session=session, timeout_s=timeout_s,
                    memory_mb=memory_mb if memory_mb > 0 else UNLIMITED_MEMORY_MB,
                )
        except Exception as exc:  # a backend bug: the client sees a SandboxError (and retries), the log the traceback
            log.exception("sandbox backend %s raised on /run_code", type(backend).__name__)
            result = ExecResult(status="infra_error", stderr=f"sandbox backend raised {type(exc).__name__}: {exc}")
        return to_response(result)

    async def close_session(request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
            session = body.get("raytool_session")
            if not isinstance(session, str):
                raise BadRequest("field 'raytool_session' (the session's name) is required")
        except BadRequest as exc:
            return web.json_response({"detail": str(exc)}, status=400)
        await backend.close_session(session)
        return web.json_response({"status": "Success", "message": ""})

    async def ping(request: web.Request) -> web.Response:
        return web.json_response("pong")

    async def health(request: web.Request) -> web.Response:
        stats = getattr(backend, "stats", None)
        return web.json_response({"status": "ok", "backend": type(backend).__name__, **({"stats": stats()} if stats else {})})

    app = web.Application(client_max_size=MAX_REQUEST_BYTES)
    app.router.add_post("/run_code", run_code)
    app.router.add_post("/close_session", close_session)
    app.router.add_get("/v1/ping", ping)
    app.router.add_get("/health", health)
    return app


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port, bound before anything else starts: a port that is taken,
    privileged or not a port is a RaytoolError in one line naming it."""
    if not 1 <= port <= 65535:
        raise RaytoolError(f"sandbox serve: port {port} is not a TCP port (1-65535): pass --port 8080 or another free port")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except socket.gaierror as exc:
        raise RaytoolError(f"sandbox serve: --host {host} is not an address ({exc.strerror})") from exc
    except OSError as exc:
        why = {errno.EADDRINUSE: f"port {port} is in use: stop what listens there or pass another --port",
               errno.EACCES: f"port {port} needs more privileges than this user has (ports below 1024: root): pass --port 8080",
               errno.EADDRNOTAVAIL: f"--host {host} is not an address of this machine: pass one of its addresses, or 0.0.0.0"}
        raise RaytoolError(f"sandbox serve: {why.get(exc.errno, f'cannot listen on {host}:{port}: {exc.strerror}')}") from exc


def serve(host: str, port: int, backend_options: dict, max_concurrency: int = 32) -> None:
    """Serve a local backend built with `backend_options` until interrupted (blocking)."""
    from raytool.sandbox import make_backend

    sock = listen(host, port)  # first: a busy port is one line, before the backend's processes start
    backend = make_backend("local", **backend_options)
    app = make_app(backend, max_concurrency)

    async def start(app: web.Application) -> None:
        if hasattr(backend, "start"):
            await backend.start()
        log.info("sandbox server (SandboxFusion API) on http://%s:%d (POST /run_code, GET /v1/ping)", host, port)

    async def stop(app: web.Application) -> None:
        if hasattr(backend, "aclose"):
            await backend.aclose()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    web.run_app(app, sock=sock, print=None, access_log=None)
