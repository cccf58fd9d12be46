"""The SandboxFusion backend: cells run on a SandboxFusion server (or raytool's own) over HTTP.

SandboxFusion (github.com/bytedance/SandboxFusion) takes `POST {url}/run_code` with
`{code, language, compile_timeout, run_timeout, memory_limit_MB, stdin, files, fetch_files}` and
answers `{status: Success|Failed|SandboxError, message, compile_result, run_result, files}`, where
each result is `{status: Finished|Error|TimeLimitExceeded, execution_time, return_code, stdout,
stderr}`. A `run_result.status` of Error means the sandbox itself failed (the server then reports
SandboxError at the top).

Every call is one HTTP request; failures of the service (SandboxError, HTTP 5xx, a refused or reset
connection, no answer in time) are retried with exponential backoff and end as `infra_error`;
failures of the code never are.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time

import aiohttp

from raytool.sandbox.output import cap_output
from raytool.types import ExecResult

log = logging.getLogger(__name__)

# Slack on top of run + compile time for what the service does around the run: queueing behind its
# own concurrency limit, writing files, starting the interpreter (verl allows 10 s as well).
REQUEST_MARGIN_S = 10.0
START_WAIT_S = 30.0  # how long a pool's start waits for the service to answer


class SandboxFusionBackend:
    """A `SandboxBackend` that sends each cell to a SandboxFusion-compatible `/run_code`.

    `url` is the service's base address; a URL ending in `/run_code` (as verl configs write it) is
    accepted too. `retries` is how many times a failed request is sent again (so `retries + 1`
    attempts), waiting `backoff_s`, then twice that, and so on. `request_timeout_s` bounds one
    HTTP request; left unset it is run timeout + compile timeout + `REQUEST_MARGIN_S`, and when set
    it must exceed the cell's `timeout_s` (or a cell that ran to its limit would read as a dead
    service). `sessions=True` is only for raytool's own server (`raytool.sandbox.server`): it keeps
    interpreter state between cells of one session; SandboxFusion itself runs every cell fresh.
    """

    def __init__(
        self,
        url: str,
        *,
        max_output_bytes: int = 8192,
        request_timeout_s: float | None = None,
        retries: int = 3,
        backoff_s: float = 0.5,
        language: str = "python",
        sessions: bool = False,
    ):
        base = url.rstrip("/")
        if base.endswith("/run_code"):
            base = base[: -len("/run_code")]
        if not base.startswith(("http://", "https://")):
            raise ValueError(f"sandbox_fusion url must start with http:// or https://, got {url!r}")
        if request_timeout_s is not None and request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be positive (or None for run + compile + {REQUEST_MARGIN_S:g} s), got {request_timeout_s}")
        if retries < 0 or backoff_s < 0:
            raise ValueError(f"retries and backoff_s must be >= 0, got retries={retries}, backoff_s={backoff_s}")
        self.url = base
        self.max_output_bytes = max_output_bytes
        self.request_timeout_s = request_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.language = language
        self.sessions = sessions
        self._http: aiohttp.ClientSession | None = None
        self._started = False

    def request_timeout(self, timeout_s: float, compile_timeout_s: float) -> float:
        """Seconds one HTTP request may take for a cell allowed `timeout_s` to run."""
        if self.request_timeout_s is None:
            return timeout_s + compile_timeout_s + REQUEST_MARGIN_S
        if self.request_timeout_s <= timeout_s:
            raise ValueError(
                f"sandbox_fusion request_timeout_s={self.request_timeout_s} must exceed the cell's timeout_s={timeout_s}: "
                "otherwise a cell that runs to its limit is cut off as if the service were down; raise it or leave it unset"
            )
        return self.request_timeout_s

    def _client(self) -> aiohttp.ClientSession:
        # Created on first use, inside the event loop that will use it (aiohttp binds it to a loop).
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession()
        return self._http

    async def start(self, wait_s: float | None = None) -> None:
        """Check that the service answers (`GET /v1/ping`), trying for up to `wait_s` (None: the
        first start waits START_WAIT_S, since a node's service may still be starting; later ones, the
        pool's circuit-breaker probes, try once): one that does not is a one-line error naming the
        URL, at the run's start instead of in every trajectory's cells later."""
        if wait_s is None:
            wait_s, self._started = (0.0 if self._started else START_WAIT_S), True
        deadline, last = time.monotonic() + wait_s, ""
        while True:
            try:
                async with self._client().get(self.url + "/v1/ping", timeout=aiohttp.ClientTimeout(total=REQUEST_MARGIN_S)) as resp:
                    if resp.status == 200:
                        return
                    last = f"GET /v1/ping answered HTTP {resp.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if time.monotonic() >= deadline:
                raise ConnectionError(f"the SandboxFusion service at {self.url} does not answer ({last}) after {wait_s:g} s: start it where "
                                      "the sandbox pools run (the cluster files start `raytool sandbox serve` on 127.0.0.1:8080 of each node) "
                                      "or point sandbox.fusion_url at it")
            await asyncio.sleep(1.0)

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def run(
        self,
        code: str,
        *,
        session: str | None = None,
        timeout_s: float = 5.0,
        memory_mb: int = 1024,
        stdin: str | None = None,
        files: dict[str, bytes] | None = None,
    ) -> ExecResult:
        # Compiled languages get the same budget to compile as to run; python has no compile step.
        compile_timeout_s = timeout_s
        request_timeout = self.request_timeout(timeout_s, compile_timeout_s)
        payload = {
            "code": code,
            "language": self.language,
            "compile_timeout": compile_timeout_s,
            "run_timeout": timeout_s,
            "memory_limit_MB": memory_mb,
            "stdin": stdin,
            "files": {path: base64.b64encode(data).decode("ascii") for path, data in (files or {}).items()},
            "fetch_files": [],
        }
        if self.sessions and session is not None:
            payload["raytool_session"] = session
        start = time.monotonic()  # duration_s is what the caller waited, retries included
        body, failure = await self._post("/run_code", payload, request_timeout)
        duration = time.monotonic() - start
        if body is None:
            return ExecResult(status="infra_error", stderr=failure, duration_s=duration)
        return to_exec_result(body, self.max_output_bytes, duration)

    async def close_session(self, session: str) -> None:
        """Free a session's interpreter on raytool's server. With `sessions=False` this does
        nothing: SandboxFusion keeps no state between calls, so there is nothing to free."""
        if not self.sessions:
            return
        _, failure = await self._post("/close_session", {"raytool_session": session}, REQUEST_MARGIN_S)
        if failure:
            # The server drops idle sessions on its own; a failed close only delays that.
            log.warning("sandbox_fusion: could not close session %r at %s: %s", session, self.url, failure)

    async def _post(self, path: str, payload: dict, timeout_s: float) -> tuple[dict | None, str]:
        """POST JSON with retries on service failures: (the answer, "") or (None, why it failed)."""
        url = self.url + path
        attempts = self.retries + 1
        failure = ""
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with self._client().post(url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                    text = await resp.text()
                    if resp.status >= 500:
                        failure = f"HTTP {resp.status} from {url}: {text[:200]}"
                    elif resp.status >= 400:  # the request is wrong; sending it again will not help
                        return None, f"HTTP {resp.status} from {url} (request rejected, not retried): {text[:500]}"
                    else:
                        try:
                            body = json.loads(text)
                        except ValueError:
                            return None, f"{url} answered HTTP {resp.status} with something other than JSON: {text[:200]!r}"
                        if not isinstance(body, dict):
                            return None, f"{url} answered with JSON that is not an object: {text[:200]!r}"
                        if body.get("status") != "SandboxError":
                            return body, ""
                        failure = f"SandboxError from {url}: {body.get('message') or '(no message)'}"
            except asyncio.TimeoutError:
                failure = f"no answer from {url} within {timeout_s:g} s"
            except aiohttp.ClientError as exc:  # refused, reset, DNS, server gone mid-answer
                failure = f"cannot reach {url}: {type(exc).__name__}: {exc}"
            log.warning("sandbox_fusion: attempt %d/%d failed: %s", attempt + 1, attempts, failure)
        return None, f"{failure} (gave up after {attempts} attempts)"


def _is_signal(return_code: int) -> bool:
    # Negative: the process itself died of signal -n. 129..192: a shell around it reports 128 + n.
    return return_code < 0 or 128 < return_code <= 128 + 64


def to_exec_result(body: dict, max_output_bytes: int, duration_s: float) -> ExecResult:
    """Map one `/run_code` answer (not a SandboxError) to an ExecResult."""
    compile_result = body.get("compile_result") or {}
    run_result = body.get("run_result") or {}
    message = body.get("message") or ""
    if compile_result and (compile_result.get("status") != "Finished" or compile_result.get("return_code") != 0):
        # The program never ran; what the compiler said is what the model needs to see.
        stderr, cut_err = cap_output(compile_result.get("stderr") or message, max_output_bytes)
        status = "timeout" if compile_result.get("status") == "TimeLimitExceeded" else "error"
        return ExecResult(status=status, stderr=stderr, exit_code=compile_result.get("return_code"), duration_s=duration_s, truncated=cut_err)
    if not run_result:
        # A refusal of the request itself (e.g. raytool's server asked for a language it lacks).
        stderr, cut_err = cap_output(message or f"the sandbox answered {body.get('status')!r} without a run_result", max_output_bytes)
        return ExecResult(status="error", stderr=stderr, duration_s=duration_s, truncated=cut_err)
    stdout, cut_out = cap_output(run_result.get("stdout"), max_output_bytes)
    stderr, cut_err = cap_output(run_result.get("stderr"), max_output_bytes)
    return_code = run_result.get("return_code")
    run_status = run_result.get("status")
    if run_status == "TimeLimitExceeded":
        status = "timeout"
    elif run_status != "Finished":
        status = "error"
    elif return_code == 0:
        status = "ok"
    elif "MemoryError" in stderr:
        status = "oom"
    elif return_code is not None and _is_signal(return_code):
        status = "killed"
    else:
        status = "error"
    truncated = cut_out or cut_err or bool(body.get("raytool_truncated"))
    return ExecResult(status=status, stdout=stdout, stderr=stderr, exit_code=return_code, duration_s=duration_s, truncated=truncated)
