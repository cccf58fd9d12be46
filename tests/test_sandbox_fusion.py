"""The SandboxFusion backend against raytool's SandboxFusion-compatible server, and against fakes."""

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from aiohttp import web

from helpers.net import free_port
from raytool.sandbox.sandbox_fusion import SandboxFusionBackend, to_exec_result
from raytool.sandbox.server import make_app, to_response
from raytool.types import ExecResult

REPO = Path(__file__).resolve().parent.parent


def run(backend: SandboxFusionBackend, code: str, **kw) -> ExecResult:
    async def go():
        try:
            return await backend.run(code, timeout_s=kw.pop("timeout_s", 5.0), memory_mb=kw.pop("memory_mb", 512), **kw)
        finally:
            await backend.aclose()

    return asyncio.run(go())


def post(url: str, data: bytes) -> tuple[int, object]:
    """POST raw bytes as curl would: (HTTP status, decoded JSON answer)."""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_sandbox_serve_on_a_busy_or_bad_port_is_one_line(capsys):
    """`raytool sandbox serve`: the port is bound before the sandbox starts, so a taken or impossible
    one ends in one line and exit code 2, not an aiohttp traceback."""
    from raytool.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        for args, line in [
            (["--port", str(busy)], f"sandbox serve: port {busy} is in use: stop what listens there or pass another --port"),
            (["--port", "70000"], "sandbox serve: port 70000 is not a TCP port (1-65535): pass --port 8080 or another free port"),
            (["--port", "0"], "sandbox serve: port 0 is not a TCP port (1-65535): pass --port 8080 or another free port"),
            (["--port", "-1"], "sandbox serve: port -1 is not a TCP port (1-65535): pass --port 8080 or another free port"),
        ]:
            assert main(["sandbox", "serve", *args]) == 2, args
            out, err = capsys.readouterr()
            assert out == "" and err == f"raytool: {line}\n", err


@pytest.fixture(scope="module")
def server_url():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [sys.executable, "-c", f"from raytool.sandbox.server import serve; serve('127.0.0.1', {port}, {{}})"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 60
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"sandbox server exited with code {proc.returncode}:\n{log.read().decode()}")
            try:
                with urllib.request.urlopen(f"{url}/v1/ping", timeout=2) as resp:
                    assert json.loads(resp.read()) == "pong"
                break
            except OSError:
                if time.time() > deadline:
                    raise TimeoutError("sandbox server did not answer /v1/ping within 60 s")
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


# --- against the real server ------------------------------------------------------------------


@pytest.mark.integration
def test_print_is_ok(server_url):
    r = run(SandboxFusionBackend(server_url), "print(6*7)")
    assert (r.status, r.stdout, r.exit_code, r.truncated) == ("ok", "42\n", 0, False)


@pytest.mark.integration
def test_raw_http_answer_has_sandbox_fusions_shape(server_url):
    status, body = post(f"{server_url}/run_code", b'{"code": "print(6*7)", "language": "python"}')
    assert status == 200
    assert body["status"] == "Success" and body["message"] == ""
    assert body["compile_result"] is None and body["files"] == {}
    run_result = body["run_result"]
    assert (run_result["status"], run_result["return_code"], run_result["stdout"], run_result["stderr"]) == ("Finished", 0, "42\n", "")
    assert run_result["execution_time"] > 0


@pytest.mark.integration
def test_bad_requests_get_400_with_the_reason(server_url):
    status, body = post(f"{server_url}/run_code", b"{not json")
    assert status == 400 and "not valid JSON" in body["detail"]
    status, body = post(f"{server_url}/run_code", b'{"language": "python"}')
    assert status == 400 and "'code'" in body["detail"]


@pytest.mark.integration
def test_exception_is_error_with_traceback(server_url):
    r = run(SandboxFusionBackend(server_url), "def f():\n    raise ValueError('boom')\nf()")
    assert r.status == "error" and r.exit_code == 1
    assert "Traceback" in r.stderr and "ValueError: boom" in r.stderr


@pytest.mark.integration
def test_infinite_loop_times_out(server_url):
    r = run(SandboxFusionBackend(server_url), "while True: pass", timeout_s=1)
    assert r.status == "timeout" and r.duration_s < 5


@pytest.mark.integration
def test_memory_limit_is_oom(server_url):
    assert run(SandboxFusionBackend(server_url), "x = bytearray(1 << 31)", memory_mb=256).status == "oom"


@pytest.mark.integration
def test_stdin_and_files_reach_the_cell(server_url):
    code = "import sys\nprint(input()[::-1], sys.stdin.read().split())\nprint(open('data/x.txt').read())\n1/0"
    r = run(SandboxFusionBackend(server_url), code, stdin="abc\n1 2\n", files={"data/x.txt": b"file body"})
    assert r.stdout == "cba ['1', '2']\nfile body\n"
    # the code's own line numbers survive the preamble that provides stdin and files
    assert r.status == "error" and 'File "<cell>", line 4' in r.stderr


@pytest.mark.integration
def test_other_languages_are_refused_clearly(server_url):
    r = run(SandboxFusionBackend(server_url, language="cpp"), "int main() {}")
    assert r.status == "error" and "only python" in r.stderr and "'cpp'" in r.stderr
    status, body = post(f"{server_url}/run_code", b'{"code": "echo hi", "language": "bash"}')
    assert status == 200 and body["status"] == "Failed" and "only python" in body["message"]


@pytest.mark.integration
def test_sessions_keep_state_when_the_backend_does(server_url):
    async def go(backend):
        try:
            await backend.run("x = 41", session="s1", timeout_s=5, memory_mb=512)
            second = await backend.run("print(x + 1)", session="s1", timeout_s=5, memory_mb=512)
            other = await backend.run("print(x + 1)", session="s2", timeout_s=5, memory_mb=512)
            await backend.close_session("s1")
            after_close = await backend.run("print(x + 1)", session="s1", timeout_s=5, memory_mb=512)
            return second, other, after_close
        finally:
            await backend.aclose()

    second, other, after_close = asyncio.run(go(SandboxFusionBackend(server_url, sessions=True)))
    if second.status == "error" and "NameError" in second.stderr:
        pytest.skip("the local backend runs every cell fresh (no sessions yet)")
    assert second.stdout == "42\n"
    assert other.status == "error" and "NameError" in other.stderr  # sessions do not leak into each other
    assert after_close.status == "error" and "NameError" in after_close.stderr


# --- failures of the service ------------------------------------------------------------------


def test_server_down_is_infra_error_after_retries_with_backoff():
    backend = SandboxFusionBackend(f"http://127.0.0.1:{free_port()}", retries=2, backoff_s=0.2)
    start = time.monotonic()
    r = run(backend, "print(1)")
    elapsed = time.monotonic() - start
    assert r.status == "infra_error" and "after 3 attempts" in r.stderr and "cannot reach" in r.stderr
    assert 0.6 <= elapsed < 5 and r.duration_s >= 0.6  # waited 0.2 s, then 0.4 s


@contextlib.asynccontextmanager
async def serving(app: web.Application):
    """Serve `app` on a loopback port inside this event loop; yields its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


class FakeSandbox:
    """An in-process HTTP server on loopback answering /run_code from a script of replies."""

    def __init__(self, replies: list):
        self.replies = replies
        self.requests: list[dict] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append(await request.json())
        reply = self.replies[min(len(self.requests), len(self.replies)) - 1]
        if isinstance(reply, float):  # a server that takes this long to answer
            await asyncio.sleep(reply)
            reply = OK_ANSWER
        if isinstance(reply, int):
            return web.Response(status=reply, text=f"fake HTTP {reply}")
        return web.json_response(reply)

    async def run(self, code: str, **backend_options) -> ExecResult:
        app = web.Application()
        app.router.add_post("/run_code", self.handle)
        async with serving(app) as url:
            # the full endpoint, as verl configs write it
            backend = SandboxFusionBackend(f"{url}/run_code", **backend_options)
            try:
                return await backend.run(code, timeout_s=0.5, memory_mb=256)
            finally:
                await backend.aclose()


OK_ANSWER = {"status": "Success", "message": "", "compile_result": None, "files": {},
             "run_result": {"status": "Finished", "execution_time": 0.01, "return_code": 0, "stdout": "42\n", "stderr": ""}}
SANDBOX_ERROR = {"status": "SandboxError", "message": "runner crashed", "compile_result": None, "run_result": None, "files": {}}


def test_sandbox_error_and_http_500_are_retried_until_success():
    fake = FakeSandbox([SANDBOX_ERROR, 500, OK_ANSWER])
    r = asyncio.run(fake.run("print(6*7)", retries=3, backoff_s=0.01))
    assert (r.status, r.stdout) == ("ok", "42\n")
    assert len(fake.requests) == 3
    sent = fake.requests[0]
    assert (sent["code"], sent["language"], sent["run_timeout"], sent["memory_limit_MB"]) == ("print(6*7)", "python", 0.5, 256)
    assert "raytool_session" not in sent  # only sent to raytool's own server


def test_persistent_sandbox_error_is_infra_error_with_its_message():
    fake = FakeSandbox([SANDBOX_ERROR])
    r = asyncio.run(fake.run("print(1)", retries=1, backoff_s=0.01))
    assert r.status == "infra_error" and "runner crashed" in r.stderr and len(fake.requests) == 2


def test_http_4xx_is_not_retried():
    fake = FakeSandbox([422, OK_ANSWER])
    r = asyncio.run(fake.run("print(1)", retries=3, backoff_s=0.01))
    assert r.status == "infra_error" and "HTTP 422" in r.stderr and len(fake.requests) == 1


def test_no_answer_within_the_request_timeout_is_infra_error():
    fake = FakeSandbox([1.0])
    r = asyncio.run(fake.run("print(1)", retries=0, request_timeout_s=0.6))
    assert r.status == "infra_error" and "no answer" in r.stderr and r.duration_s < 1.0


# --- units: timeouts and the mapping both ways ------------------------------------------------


def test_client_timeout_always_exceeds_the_run_timeout():
    assert SandboxFusionBackend("http://h").request_timeout(5.0, 5.0) > 10.0
    fixed = SandboxFusionBackend("http://h", request_timeout_s=3.0)
    assert fixed.request_timeout(2.0, 2.0) == 3.0
    with pytest.raises(ValueError, match="must exceed the cell's timeout_s=5"):
        asyncio.run(fixed.run("print(1)", timeout_s=5.0, memory_mb=256))
    with pytest.raises(ValueError, match="request_timeout_s must be positive"):
        SandboxFusionBackend("http://h", request_timeout_s=0)


def answer(run_status: str, return_code: int | None, stdout: str = "", stderr: str = "", compile_result=None) -> dict:
    top = "Success" if run_status == "Finished" and return_code == 0 else "Failed"
    return {"status": top, "message": "", "compile_result": compile_result,
            "run_result": {"status": run_status, "return_code": return_code, "stdout": stdout, "stderr": stderr}}


def test_answers_map_to_exec_statuses():
    def status(body):
        return to_exec_result(body, 8192, 0.1).status

    assert status(answer("Finished", 0)) == "ok"
    assert status(answer("Finished", 1, stderr="ZeroDivisionError")) == "error"
    assert status(answer("Finished", 1, stderr="MemoryError")) == "oom"
    assert status(answer("Finished", -9)) == "killed"
    assert status(answer("Finished", 137)) == "killed"  # a shell reporting SIGKILL
    assert status(answer("TimeLimitExceeded", None)) == "timeout"
    assert status(answer("Error", None)) == "error"
    compile_tle = {"status": "TimeLimitExceeded", "return_code": None, "stderr": ""}
    assert status({"status": "Failed", "compile_result": compile_tle, "run_result": None}) == "timeout"
    compile_err = {"status": "Finished", "return_code": 1, "stderr": "main.cpp:1: error"}
    r = to_exec_result({"status": "Failed", "compile_result": compile_err, "run_result": None}, 8192, 0.1)
    assert (r.status, r.stderr) == ("error", "main.cpp:1: error")


def test_output_is_cut_at_max_output_bytes():
    r = to_exec_result(answer("Finished", 0, stdout="x" * 10000), 100, 0.1)
    assert r.truncated and r.stdout == "x" * 100


def test_server_answers_round_trip_through_the_client():
    cases = [
        ExecResult(status="ok", stdout="1\n", exit_code=0),
        ExecResult(status="error", stderr="NameError: x", exit_code=1),
        ExecResult(status="error", stderr="NameError: x", exit_code=None),  # a session's interpreter
        ExecResult(status="timeout"),
        ExecResult(status="oom", stderr="MemoryError", exit_code=1),
        ExecResult(status="killed", exit_code=-9),
        ExecResult(status="killed", exit_code=None),
    ]
    for sent in cases:
        got = to_exec_result(json.loads(to_response(sent).text), 8192, 0.1)
        assert (got.status, got.stdout, got.stderr) == (sent.status, sent.stdout, sent.stderr), sent
    infra = json.loads(to_response(ExecResult(status="infra_error", stderr="fork failed")).text)
    assert (infra["status"], infra["message"]) == ("SandboxError", "fork failed")


def test_server_passes_limits_and_sessions_to_its_backend():
    class Recorder:
        def __init__(self):
            self.calls = []

        async def run(self, code, *, session=None, timeout_s, memory_mb):
            self.calls.append((code, session, timeout_s, memory_mb))
            return ExecResult(status="ok", stdout="done\n", exit_code=0)

        async def close_session(self, session):
            self.calls.append(("closed", session))

    async def go(recorder):
        async with serving(make_app(recorder)) as url:
            backend = SandboxFusionBackend(url, sessions=True)
            try:
                r = await backend.run("print(1)", session="t7", timeout_s=3.0, memory_mb=300)
                await backend.close_session("t7")
                return r
            finally:
                await backend.aclose()

    recorder = Recorder()
    r = asyncio.run(go(recorder))
    assert r.stdout == "done\n"
    assert recorder.calls == [("print(1)", "t7", 3.0, 300), ("closed", "t7")]


def test_a_backend_that_raises_is_a_sandbox_error_not_a_500():
    class Broken:
        async def run(self, code, *, session=None, timeout_s, memory_mb):
            raise RuntimeError("zygote gone")

        async def close_session(self, session):
            pass

    async def go():
        async with serving(make_app(Broken())) as url:
            status, body = await asyncio.to_thread(post, f"{url}/run_code", b'{"code": "1", "language": "python"}')
            backend = SandboxFusionBackend(url, retries=1, backoff_s=0.01)
            try:
                return status, body, await backend.run("1", timeout_s=1, memory_mb=256)
            finally:
                await backend.aclose()

    status, body, r = asyncio.run(go())
    assert status == 200 and body["status"] == "SandboxError" and "zygote gone" in body["message"]
    assert r.status == "infra_error" and "zygote gone" in r.stderr and "after 2 attempts" in r.stderr


def test_a_service_that_does_not_answer_stops_the_start_in_one_line_naming_its_url():
    """The recipe's SandboxFusion URL with nothing behind it: the pool's start waits for it, then
    fails naming the URL and what to do, instead of the run failing every trajectory's cells later."""
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match=rf"the SandboxFusion service at {url} does not answer \(ClientConnectorError.*\) after 1 s: start it"):
        asyncio.run(SandboxFusionBackend(url).start(wait_s=1.0))


def test_the_start_passes_once_the_service_answers(server_url):
    backend = SandboxFusionBackend(server_url)
    asyncio.run(backend.start(wait_s=0.0))  # raises where it does not answer
    assert backend._started is False  # an explicit wait_s leaves the first start's wait for later
