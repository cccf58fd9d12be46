"""An OpenAI-compatible HTTP gateway over raytool's token-level generate, recording exactly.

Any agent written against the OpenAI API can be rolled out and trained without a rewrite: point
its base URL here (tested with the `openai` client).

Routes (aiohttp):
- `POST /v1/chat/completions`, `GET /v1/models`: interactive use (`raytool serve`); nothing is
  recorded.
- `POST /traj/<key>/v1/chat/completions`, `GET /traj/<key>/v1/models`: one trajectory's URL
  (`Gateway.open`). Its calls are recorded token-exactly by `raytool.agent.recorder`: generated
  ids verbatim (mask 1), only the new messages tokenized, as the template's delta (mask 0). An
  assistant message this gateway produced is rendered from its raw generated text when the agent
  sends it back (matched by content and tool calls), so the rendering extends the recording; an
  agent that edits its history ends the recording there (`agent.on_history_rewrite`). A key that
  does not exist or whose trajectory finished is a 404.

On a trajectory URL the run's temperature and top_p apply whatever the request asks (the trainer
scores the tokens as the run samples them); max_tokens and stop apply everywhere.

A request renders with the chat template (the run's `agent.chat_template_kwargs`), generates once
through `generate` (the LLM manager's token API in the actor graph), and its text is parsed for
tool calls in the run's format (Hermes, or a model family's: raytool.agent.families; XML arguments
typed from the request's tools) into OpenAI `tool_calls` (content is the text before the first
call). Supported: messages, tools, tool_choice auto/none, temperature, top_p, max_tokens /
max_completion_tokens, stop, n (1 on a trajectory URL: one recording is one sequence), seed,
stream (the whole completion is generated, then sent as SSE chunks: token-level generate has no
partial output to stream). Errors are OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`: 400 for a malformed request or a prompt beyond the context, 404 for an unknown model or
trajectory, 500 when generation itself failed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field

from aiohttp import web

from raytool.agent.loop import Generate, request_seed
from raytool.agent.families import FORMATS, get_parser, split_reasoning, stop_token_ids
from raytool.agent.recorder import TokenRecorder, render_chat
from raytool.agent.render import ChatRenderer
from raytool.errors import one_line
from raytool.types import Message, SamplingParams, TokenOutput, Trajectory

log = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """A request the gateway cannot serve, as the OpenAI API reports it."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _text(content, where: str) -> str:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise _bad(f"{where}: only text content parts are supported (got {str(part)[:80]})", where)
        return "".join(parts)
    raise _bad(f"{where}: content must be a string, null or a list of text parts", where)


def _call_key(tool_calls) -> tuple:
    """Tool calls compared by name and arguments (JSON compared as values, not as text)."""
    out = []
    for c in tool_calls or []:
        f = c.get("function") or {}
        args = f.get("arguments")
        try:
            args = json.dumps(json.loads(args) if isinstance(args, str) else args, sort_keys=True)
        except (TypeError, ValueError):
            pass
        out.append((f.get("name"), args))
    return tuple(out)


@dataclass
class _Request:
    messages: list[dict]
    tools: list[dict] | None
    sampling: dict
    n: int
    seed: int | None
    priority: int = 0  # vLLM's extension field: lower is scheduled first (a run's own judge asks for it)


def parse_request(body, model_name: str) -> _Request:
    """A chat-completions body, checked; OpenAI's 400/404 errors for what cannot be served."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if model != model_name:
        raise APIError(404, f"The model '{model}' does not exist; this gateway serves '{model_name}'", param="model",
                       code="model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise _bad(f"{where}: expected an object with a role in {list(ROLES)}", where)
        d = {"role": "system" if m["role"] == "developer" else m["role"], "content": _text(m.get("content"), where)}
        if m["role"] == "assistant" and m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise _bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
            d["tool_calls"] = m["tool_calls"]
        if m["role"] == "tool":
            d["tool_call_id"] = m.get("tool_call_id", "")
            if m.get("name"):
                d["name"] = m["name"]
        out.append(d)
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function" for t in tools)):
        raise _bad("'tools' must be a list of {type: function, function: {...}} objects", "tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise _bad("tool_choice must be 'auto' or 'none': token-level generation cannot force a tool call", "tool_choice")
    if choice == "none":
        tools = None
    sampling: dict = {}
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            if not isinstance(body[key], (int, float)) or body[key] < 0:
                raise _bad(f"'{key}' must be a number >= 0", key)
            sampling[key] = float(body[key])
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise _bad("'max_tokens' must be a positive integer", "max_tokens")
        sampling["max_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise _bad("'stop' must be a string or a list of strings", "stop")
        sampling["stop"] = tuple(stop)
    n = body.get("n", 1) or 1
    if not isinstance(n, int) or n < 1:
        raise _bad("'n' must be a positive integer", "n")
    seed = body.get("seed")
    if seed is not None and not isinstance(seed, int):
        raise _bad("'seed' must be an integer", "seed")
    priority = body.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise _bad("'priority' must be an integer", "priority")
    return _Request(out, tools, sampling, n, seed, priority)


@dataclass
class _Trajectory:
    """One trajectory's URL: its recorder, the assistant messages produced for it, how it generates."""

    recorder: TokenRecorder
    generate: Generate
    session: str
    sampling: SamplingParams  # the run's sampling (temperature, top_p, max tokens per turn); a request may override
    seed: int | None
    produced: dict[tuple, str] = field(default_factory=dict)  # (content, tool calls) as returned -> the raw generated text
    last_messages: list[dict] = field(default_factory=list)  # the last request's conversation and the answer to it
    infra: str = ""  # a generate call that failed (the engine, the manager): not the policy's doing


class Gateway:
    """The OpenAI API over `generate`; trajectories opened and finished by whoever runs the agents."""

    def __init__(self, renderer: ChatRenderer, generate: Generate | None, *, model_name: str, max_model_len: int | None = None,
                 defaults: SamplingParams | None = None, template_kwargs: dict | None = None, tool_format: str = "hermes"):
        """`tool_format`: how the model writes tool calls, hermes or a family of raytool.agent.families
        (agent.format; retool's <code> blocks are no OpenAI tool call: hermes)."""
        self.renderer, self.generate, self.model_name = renderer, generate, model_name
        self.tool_format = "hermes" if tool_format == "retool" else tool_format
        get_parser(self.tool_format)  # an unknown name fails here
        self.call_start = FORMATS[self.tool_format].call_start if self.tool_format in FORMATS else ("<tool_call>",)
        # the format's own end-of-call tokens (gpt-oss's <|call|>, Llama's <|eom_id|>) end a generation as eos does
        self.stop_ids = (renderer.eos_id, *stop_token_ids(self.tool_format, renderer.tokenizer))
        self.max_model_len = max_model_len
        self.defaults = defaults or SamplingParams(max_tokens=1024)
        self.template_kwargs = template_kwargs or {}
        self.trajectories: dict[str, _Trajectory] = {}
        # seconds each recent completion spent outside generate (rendering, recording, parsing; not HTTP);
        # bounded: a gateway serves a whole run
        self.latencies: deque[float] = deque(maxlen=10_000)
        self._runner: web.AppRunner | None = None
        self.url = ""

    # -- trajectories --------------------------------------------------------------------------------

    def open(self, session: str, generate: Generate, *, sampling: SamplingParams | None = None, seed: int | None = None,
             max_response_tokens: int | None = None, on_history_rewrite: str = "truncate") -> str:
        """A new trajectory; returns its base URL path (`/traj/<key>/v1`), the only way to reach it."""
        key = secrets.token_hex(12)
        self.trajectories[key] = _Trajectory(TokenRecorder(self.renderer, max_response_tokens, on_history_rewrite), generate, session,
                                             sampling or self.defaults, seed)
        return f"/traj/{key}/v1"

    def finish(self, path: str, uid: str, group_id: str, ground_truth: str, answer: str | None) -> Trajectory:
        """Close the trajectory at `path` (later calls to it are 404) and return what it recorded;
        `answer` (the agent's return value) ends the conversation as the reward's response. A
        trajectory one of whose generate calls failed is infra-failed, whatever the agent did next."""
        parts = path.split("/")
        traj = self.trajectories.pop(parts[2] if len(parts) > 2 else "", None)
        if traj is None:
            raise KeyError(f"no open trajectory at {path!r}")
        messages = [Message(m["role"], m["content"]) for m in traj.last_messages]
        if answer is not None:
            messages.append(Message("assistant", answer))
        out = traj.recorder.to_trajectory(uid, group_id, messages, ground_truth)
        if traj.infra:  # the driver rolls its group out again instead of scoring it
            out.infra_failure, out.finish_reason = f"generate: {traj.infra}", "infra_failed"
        return out

    # -- completions ---------------------------------------------------------------------------------

    def _render(self, request: _Request, traj: _Trajectory | None) -> str:
        messages = []
        for m in request.messages:
            if traj is not None and m["role"] == "assistant":
                raw = traj.produced.get((m["content"], _call_key(m.get("tool_calls"))))
                if raw is not None:  # ours: rendered from what was generated, so the rendering extends the recording
                    m = {"role": "assistant", "content": raw}
            messages.append(m)
        try:
            return render_chat(self.renderer.tokenizer, messages, request.tools, self.template_kwargs)
        except Exception as exc:  # the template refused the conversation (e.g. roles out of order)
            raise _bad(f"the chat template cannot render these messages: {one_line(exc)}", "messages") from None

    def _sampling(self, request: _Request, traj: _Trajectory | None, prompt_len: int, call: int, choice: int) -> SamplingParams:
        base = traj.sampling if traj is not None else self.defaults
        wanted = request.sampling.get("max_tokens", base.max_tokens)
        if traj is not None and traj.recorder.tokens_left() is not None and not traj.recorder.stopped:
            wanted = min(wanted, traj.recorder.tokens_left())
        if self.max_model_len is not None:
            room = self.max_model_len - prompt_len
            if room < 1:
                raise _bad(f"This model's maximum context length is {self.max_model_len} tokens; the messages are {prompt_len} "
                           "tokens", "messages", "context_length_exceeded")
            wanted = min(wanted, room)
        seed = request.seed if request.seed is not None else (traj.seed if traj is not None else None)
        session = traj.session if traj is not None else "gateway"
        # A trajectory samples as the run does: the trainer scores its tokens at the run's temperature
        # and top_p, so an agent's own values (often 0 or 0.7) are not applied there.
        chosen = request.sampling if traj is None else {}
        return SamplingParams(
            max_tokens=wanted,
            temperature=chosen.get("temperature", base.temperature),
            top_p=chosen.get("top_p", base.top_p),
            top_k=base.top_k,
            stop_token_ids=self.stop_ids,
            stop=request.sampling.get("stop", ()),
            seed=request_seed(seed, f"{session}/{choice}", call),
            priority=request.priority if traj is None else 0,  # a trajectory's calls are the rollouts themselves
        )

    async def complete(self, body, key: str | None = None) -> dict:
        """One chat completion (the response object); raises APIError."""
        traj = None
        if key is not None:
            traj = self.trajectories.get(key)
            if traj is None:
                raise APIError(404, "no such trajectory: it does not exist or has finished", code="trajectory_not_found",
                               kind="not_found_error")
        request = parse_request(body, self.model_name)
        if traj is not None and request.n != 1:
            raise _bad("'n' must be 1 on a trajectory URL: one trajectory records one sequence", "n")
        started = time.perf_counter()
        rendered = self._render(request, traj)
        if traj is not None:
            rec = traj.recorder
            prompt = rec.next_prompt(rendered)
            call = rec.num_calls - 1
            if prompt is None:  # the trajectory's response budget is spent: an empty answer that says why
                return self._response([("", TokenOutput([], [], "length"))], request.messages, 0, traj, request)
        elif self.generate is None:
            raise APIError(404, "this gateway serves trajectory URLs only (/traj/<key>/v1)", kind="not_found_error")
        else:
            prompt, call = self.renderer.encode(rendered), 0
        samplings = [self._sampling(request, traj, len(prompt), call, i) for i in range(request.n)]
        generate = traj.generate if traj is not None else self.generate
        session = traj.session if traj is not None else f"gateway-{secrets.token_hex(4)}"
        prep = time.perf_counter() - started
        try:
            outs = await asyncio.gather(*(generate(list(prompt), s, f"{session}-{call}.{i}", session) for i, s in enumerate(samplings)))
        except APIError:
            raise
        except Exception as exc:
            if traj is not None:
                traj.infra = traj.infra or one_line(exc)
            raise APIError(500, f"generation failed: {one_line(exc)}", kind="server_error") from None
        started = time.perf_counter()
        texts = []
        for out in outs:
            text = traj.recorder.record(out) if traj is not None else self.renderer.reply_text(out.token_ids)
            texts.append((text, out))
        response = self._response(texts, request.messages, len(prompt), traj, request)
        self.latencies.append(prep + time.perf_counter() - started)
        return response

    def _response(self, texts: list[tuple[str, TokenOutput]], messages: list[dict], prompt_tokens: int, traj: _Trajectory | None,
                  request: _Request) -> dict:
        choices = []
        schemas = {t["function"]["name"]: t for t in request.tools or [] if isinstance(t.get("function"), dict) and "name" in t["function"]}
        parse = get_parser(self.tool_format, schemas)
        for i, (text, out) in enumerate(texts):
            parsed = parse(text)
            at = min((p for p in (text.find(start) for start in self.call_start) if p >= 0), default=-1)
            tool_calls = []
            first = traj.recorder.tool_calls if traj is not None else 0
            for j, c in enumerate(parsed.calls):
                tool_calls.append({"id": f"call_{first + j}", "type": "function",
                                   "function": {"name": c.name, "arguments": json.dumps(c.arguments)}})
            content = (text[:at].strip() if at >= 0 else text) if tool_calls else text
            reasoning = ""
            if "</think>" in content:  # a thinking model's reasoning, apart from its answer (as vLLM's reasoning parsers return it)
                reasoning, content = split_reasoning(content)
            message = {"role": "assistant", "content": content or None}
            if reasoning:
                message["reasoning_content"] = reasoning
            if tool_calls:
                message["tool_calls"] = tool_calls
            if traj is not None:
                traj.recorder.count_tool_calls(len(parsed.calls), len(parsed.errors))
                traj.produced[(content or "", _call_key(tool_calls))] = text
                traj.last_messages = [*messages, {"role": "assistant", "content": text}]
            finish = "tool_calls" if tool_calls else ("length" if out.finish_reason == "length" else "stop")
            choices.append({"index": i, "message": message, "finish_reason": finish, "logprobs": None})
        completion = sum(len(out.token_ids) for _, out in texts)
        return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}}

    # -- HTTP ----------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/traj/{key}/v1/models", self._models)
        app.router.add_post("/traj/{key}/v1/chat/completions", self._chat)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        key = request.match_info.get("key")
        if key is not None and key not in self.trajectories:
            return web.json_response(APIError(404, "no such trajectory", code="trajectory_not_found", kind="not_found_error").body(), status=404)
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "raytool"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError):
                raise _bad("the request body is not valid JSON") from None
            response = await self.complete(body, request.match_info.get("key"))
        except APIError as exc:
            return web.json_response(exc.body(), status=exc.status)
        if not body.get("stream"):
            return web.json_response(response)
        return await self._stream(request, response, bool((body.get("stream_options") or {}).get("include_usage")))

    async def _stream(self, request: web.Request, response: dict, include_usage: bool) -> web.StreamResponse:
        """The completion as chat.completion.chunk events: role, content, tool calls, finish reason."""
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await stream.prepare(request)
        head = {k: response[k] for k in ("id", "created", "model")}

        async def send(choices, usage=None):
            chunk = {**head, "object": "chat.completion.chunk", "choices": choices}
            if include_usage:
                chunk["usage"] = usage
            await stream.write(f"data: {json.dumps(chunk)}\n\n".encode())

        for c in response["choices"]:
            m, i = c["message"], c["index"]
            await send([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            if m["content"]:
                await send([{"index": i, "delta": {"content": m["content"]}, "finish_reason": None}])
            for j, call in enumerate(m.get("tool_calls") or []):
                await send([{"index": i, "delta": {"tool_calls": [{"index": j, **call}]}, "finish_reason": None}])
            await send([{"index": i, "delta": {}, "finish_reason": c["finish_reason"]}])
        if include_usage:
            await send([], response["usage"])
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on host:port (0: a free port); returns the base URL (`http://host:port`)."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{bound}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
