"""The `openenv` agent loop: environments served by Meta's OpenEnv (reset/step over HTTP and
WebSocket), played by the policy through raytool's gateway.

`agent.environment` names the server: its URL (`http://host:8000`, as `uvicorn` or `openenv serve`
run it), or an OpenEnv app (`package.module:app`, `path/to/file.py:app`: the FastAPI app
`openenv.core.env_server.create_app` builds), which each agent worker then serves itself on
loopback. `agent.environment_args`: `action_field` (the action's field the model's reply goes
into; default `message`), `observation_field` (the observation's field shown to the model; default:
every field but done, reward and metadata, as JSON).

Each trajectory opens its own session (OpenEnv's WebSocket client, one environment instance on the
server) and closes it when it ends or fails. The row's messages start the conversation (the task's
instructions); `reset` (with the row's `extra_info.reset` as its arguments, e.g. a seed) gives the
first observation, appended to the row's last user message or as a user message; then each turn
the model's reply (through the trajectory's gateway URL: token-exact, observations masked) is the
action, and the observation comes back as the next user message, until the environment says done,
`agent.max_turns` or the token budget. The trajectory's reward is the sum of the environment's
step rewards (`reward.fn` is not used for these rows); `reward_extra` holds `env_steps` and
`env_done`. An environment that fails (cannot be reached, refuses an action, raises) makes the
trajectory infra-failed (`env: ...`), so its group is rolled out again.
Needs the `openenv-core` package (`pip install raytool[openenv]`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

from raytool.agent.openai_loop import MODEL_NAME, first_line, recording
from raytool.agent.registry import register_agent_loop
from raytool.agent.render import ChatRenderer
from raytool.config import AgentConfig, ConfigError, RolloutConfig
from raytool.errors import one_line
from raytool.types import TIME_LIMIT, Message, Trajectory

log = logging.getLogger(__name__)

ACTION_FIELD = "message"
_HIDDEN = {"done", "reward", "metadata"}  # an observation's fields the model is not shown by default
_SERVERS: dict[str, "_Server"] = {}  # per process: the OpenEnv app each spec names, served on loopback


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://", "ws://", "wss://"))


class _Server:
    """An OpenEnv app served by uvicorn on a thread of this process (loopback, a free port)."""

    def __init__(self, app):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, name="openenv-server", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError("config key 'agent.environment': the OpenEnv app did not start serving within 30 s")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class _ClientGoneFilter(logging.Filter):
    """openenv-core 0.3.0's server logs an exception for every session the client closed first."""

    def filter(self, record: logging.LogRecord) -> bool:
        kind = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        return kind not in ("WebSocketDisconnect", "ClientDisconnected")


def load_app(spec: str):
    """The OpenEnv app (`module:app` or `file.py:app`), or one ConfigError line naming the key."""
    from raytool.imports import required_object

    app = required_object(spec, "agent.environment", "openenv")
    if not callable(app):
        raise ConfigError(f"config key 'agent.environment': {spec!r} is not an ASGI app (an OpenEnv create_app(...) result)")
    return app


def server_url(spec: str) -> str:
    """Where the environment `spec` serves: its URL, or this process's server of its app."""
    if is_url(spec):
        return spec
    if spec not in _SERVERS:
        logging.getLogger("uvicorn.error").addFilter(_ClientGoneFilter())
        _SERVERS[spec] = _Server(load_app(spec))
    return _SERVERS[spec].url


def stop_servers() -> None:
    """Stop the apps this process serves (tests; an actor's process ends with them)."""
    while _SERVERS:
        _SERVERS.popitem()[1].stop()


def check_environment(spec: str | None) -> None:
    """Before any actor starts: `agent.environment` names an app that imports, or a URL whose
    server answers /health. One ConfigError line naming the key."""
    if not spec:
        raise ConfigError("config key 'agent.environment': rows with agent_name openenv need an OpenEnv server: its URL, or its app "
                          "('package.module:app' or 'path/to/file.py:app')")
    try:
        import openenv.core  # noqa: F401
    except ImportError:
        raise ConfigError("config key 'agent.environment': the openenv loop needs the openenv-core package: pip install 'raytool[openenv]'") from None
    if not is_url(spec):
        load_app(spec)
        return
    import urllib.request

    health = spec.replace("ws://", "http://").replace("wss://", "https://").rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(health, timeout=10) as reply:
            reply.read()
    except Exception as exc:
        raise ConfigError(f"config key 'agent.environment': the OpenEnv server at {spec} does not answer {health} ({one_line(exc)})") from None


def render_observation(observation: dict, field: str | None) -> str:
    if field is not None:
        if field not in observation:
            raise KeyError(f"the observation has no field {field!r} (agent.environment_args.observation_field); it has {sorted(observation)}")
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value)
    shown = {k: v for k, v in observation.items() if k not in _HIDDEN}
    if len(shown) == 1 and isinstance(next(iter(shown.values())), str):
        return next(iter(shown.values()))
    return json.dumps(shown)


@register_agent_loop("openenv")
class OpenEnvAgentLoop:
    row_extra = True  # run() is given the row's extra (its extra_info.reset: the reset's arguments)
    scored_by_environment = True  # the environment's step rewards are the reward: reward.fn is not called

    @staticmethod
    def check_environment(agent: AgentConfig) -> None:
        """Before any actor starts (raytool.agent.registry.check_agents): its app imports, or its server answers."""
        check_environment(agent.environment)

    def __init__(self, renderer: ChatRenderer, tools: dict, generate, agent: AgentConfig, rollout: RolloutConfig):
        args = dict(agent.environment_args)
        self.action_field = args.pop("action_field", ACTION_FIELD)
        self.observation_field = args.pop("observation_field", None)
        if args:
            raise ConfigError(f"config key 'agent.environment_args': the openenv loop takes action_field and observation_field, not {sorted(args)}")
        self.url = server_url(agent.environment)
        self.renderer, self.generate, self.agent, self.rollout = renderer, generate, agent, rollout

    async def run(self, messages: list[Message], ground_truth: str, uid: str, group_id: str, extra: dict | None = None) -> Trajectory:
        from openenv.core import GenericEnvClient

        reset_args = ((extra or {}).get("extra_info") or {}).get("reset") or {}
        rec = await recording(self.renderer, self.generate, self.agent, self.rollout, messages, uid, group_id, ground_truth)
        env = GenericEnvClient(base_url=self.url, message_timeout_s=self.agent.max_trajectory_s)
        chat = [{"role": m.role, "content": m.content} for m in messages]
        rewards: list[float] = []
        answer, done, infra, finish = None, False, "", ""
        try:
            async with asyncio.timeout(self.agent.max_trajectory_s):
                try:
                    await env.connect()
                    result = await env.reset(**reset_args)
                    self._show(chat, render_observation(result.observation, self.observation_field))
                except Exception as exc:
                    raise _EnvFailure(exc) from exc
                for _ in range(self.agent.max_turns):
                    reply = await rec.client.chat.completions.create(model=MODEL_NAME, messages=chat)
                    answer = reply.choices[0].message.content or ""
                    chat.append({"role": "assistant", "content": answer})
                    if reply.choices[0].finish_reason == "length" and not answer:
                        finish = "length"  # the trajectory's token budget is spent: the episode cannot go on
                        break
                    try:
                        result = await env.step({self.action_field: answer})
                        observation = render_observation(result.observation, self.observation_field)
                    except Exception as exc:
                        raise _EnvFailure(exc) from exc
                    rewards.append(float(result.reward or 0.0))
                    if result.done:
                        done = True
                        break
                    self._show(chat, observation)
        except _EnvFailure as failure:
            infra = f"env: {first_line(failure.__cause__)}"
        except TimeoutError:
            finish = TIME_LIMIT
        except Exception as exc:  # the gateway's client: the engine or the data plane failed
            infra = f"env rollout: {first_line(exc)}"
        finally:
            try:
                await env.close()
            except Exception as exc:  # the session's server-side end is the server's; the trajectory is kept
                log.debug("closing the OpenEnv session of %s: %s", uid, first_line(exc))
        traj = rec.finish(answer)
        if traj.infra_failure:
            return traj
        if infra:
            traj.infra_failure, traj.finish_reason = infra, "infra_failed"
            return traj
        traj.reward = sum(rewards)
        traj.reward_extra = {"env_steps": float(len(rewards)), "env_done": float(done)}
        traj.finish_reason = "env_done" if done else finish or traj.finish_reason
        return traj

    @staticmethod
    def _show(chat: list[dict], observation: str) -> None:
        """The observation as the model reads it: after the row's last user message, or as a new one."""
        if chat and chat[-1]["role"] == "user" and len(chat) == sum(m["role"] != "assistant" for m in chat):
            chat[-1] = {"role": "user", "content": f"{chat[-1]['content']}\n\n{observation}"}
        else:
            chat.append({"role": "user", "content": observation})


class _EnvFailure(Exception):
    """The environment (its server or session) failed: the trajectory is infra-failed, never scored."""
