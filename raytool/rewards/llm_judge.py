"""LLM-judge rewards (`reward.fn: judge`): a judge model behind an OpenAI-compatible API scores each
response by a rubric, for tasks whose answer no program can check. (Not `rewards/judge.py`: the
package's `judge` is the math answer check, which a submodule of that name would shadow.)

The rubric is a Python format string over the trajectory's `prompt` (the row's last user message),
`response` (the final answer, after any reasoning), `reasoning`, the row's `ground_truth` and
`data_source`, and the row's `extra_info` keys; the judge's reply is searched for
`reward.judge.score_pattern` (its last match), and the number found, divided by `max_score`, is the
score. A judge that fails, times out or answers without a score raises a RewardError: the reward
worker retries it and then the trajectory is infra-failed, never scored 0. Verdicts are cached by
the rubric text the judge is sent (question, answer, reference, ...), so a group rolled out again
is not judged twice for the same text.
The client is the `openai` package's, so any server that speaks the API is a judge: `raytool serve`
of a judge model, vLLM's or SGLang's server, a hosted API.
"""

from __future__ import annotations

import hashlib
import os
import re
import string
import threading
from collections import OrderedDict
from typing import Callable

from raytool.config import ConfigError, JudgeConfig
from raytool.errors import RaytoolError, one_line

DEFAULT_RUBRIC = """You are grading an answer to a question.

Question:
{prompt}

Reference answer:
{ground_truth}

Answer to grade:
{response}

Judge whether the answer is correct and complete, compared with the reference. Reply with one short
sentence of reasons, then a last line of the form "Score: N", N from 0 (wrong) to 10 (fully correct)."""

FIELDS = {"prompt", "response", "reasoning", "ground_truth", "data_source"}


class JudgeError(RaytoolError):
    """The judge did not give a score: it failed, timed out or answered without one."""


def rubric_of(cfg: JudgeConfig) -> str:
    return cfg.rubric if cfg.rubric is not None else DEFAULT_RUBRIC


def rubric_fields(rubric: str) -> set[str]:
    """The names a rubric formats (`{prompt}`, `{extra_key}`); a malformed rubric is a ConfigError."""
    try:
        return {name.split(".")[0].split("[")[0] for _, name, _, _ in string.Formatter().parse(rubric) if name}
    except ValueError as exc:
        raise ConfigError(f"reward.judge.rubric: not a format string: {exc}") from None


def check_config(cfg: JudgeConfig, extra_keys: list[set[str]] | None = None) -> None:
    """One line naming the key: no base_url, a score_pattern without a group, a rubric field that is
    neither a standard one nor in every row's extra_info (`extra_keys`: each row's keys)."""
    if not cfg.base_url:
        raise ConfigError("reward.fn=judge needs reward.judge.base_url (the judge's OpenAI-compatible API, e.g. http://host:8000/v1)")
    try:
        if re.compile(cfg.score_pattern).groups < 1:
            raise ConfigError(f"reward.judge.score_pattern={cfg.score_pattern!r} has no group: its first group is the score")
    except re.error as exc:
        raise ConfigError(f"reward.judge.score_pattern={cfg.score_pattern!r}: not a regular expression: {exc}") from None
    unknown = rubric_fields(rubric_of(cfg)) - FIELDS
    for i, keys in enumerate(extra_keys or []):
        missing = sorted(unknown - keys)
        if missing:
            raise ConfigError(f"reward.judge.rubric uses {missing}, which are neither {sorted(FIELDS)} nor in row {i}'s extra_info "
                              f"(its keys: {sorted(keys)})")


def parse_score(reply: str, pattern: str) -> float:
    """The judge's number: the last match of `pattern` in its reply."""
    found = re.findall(pattern, reply or "")
    if not found:
        raise JudgeError(f"the judge's reply has no score matching reward.judge.score_pattern: {one_line(reply or '(empty)')[:200]!r}")
    value = found[-1][0] if isinstance(found[-1], tuple) else found[-1]
    try:
        return float(value)
    except ValueError:
        raise JudgeError(f"the judge's score {value!r} is not a number") from None


SELF = "self"  # reward.judge.base_url: the run's own rollout servers, through its gateway
JUDGE_PRIORITY = -1  # a self-judge's calls, on its servers' engines: scheduled before the rollouts (vLLM: lower first)


class Judge:
    """`reward.fn: judge` as a reward fn `(view, ground_truth, extra) -> dict` (thread-safe: a
    reward worker runs up to `concurrency` of them at once). With base_url `self`, `own_api()`
    gives the run's gateway's API URL, asked on first use and again after a call failed (a
    restarted gateway on port 0 listens elsewhere)."""

    def __init__(self, cfg: JudgeConfig, own_api: Callable[[], str] | None = None):
        check_config(cfg)
        self.cfg = cfg
        self.rubric = rubric_of(cfg)
        self.own_api = own_api
        self.base_url = None if cfg.base_url == SELF else cfg.base_url
        self._client = None if cfg.base_url == SELF else self._connect(cfg.base_url)
        self.model = cfg.model
        self.cache: OrderedDict[bytes, float] = OrderedDict()  # the judge's number by the digest of the text it was sent
        self.lock = threading.Lock()
        self.concurrency = cfg.concurrency

    def _connect(self, base_url: str):
        import openai

        return openai.OpenAI(base_url=base_url, api_key=os.environ.get(self.cfg.api_key_env) or "EMPTY", timeout=self.cfg.timeout_s,
                             max_retries=0)  # the reward worker retries, on another worker

    @property
    def client(self):
        if self._client is None:  # base_url self: the run's gateway
            if self.own_api is None:
                raise JudgeError("judge_error: reward.judge.base_url is self, but this process belongs to no run whose gateway could judge")
            try:
                self.base_url = self.own_api()
            except Exception as exc:
                raise JudgeError(f"judge_error: the run's gateway (reward.judge.base_url self) is not reachable: {one_line(exc)}") from None
            self._client = self._connect(self.base_url)
        return self._client

    def served_model(self) -> str:
        """reward.judge.model, else the first model the judge's API lists; a judge that does not answer raises."""
        if self.model is None:
            models = self.client.models.list().data
            if not models:
                raise JudgeError(f"the judge at {self.base_url} serves no model")
            self.model = models[0].id
        return self.model

    def __call__(self, view: dict, ground_truth: str, extra: dict) -> dict:
        fields = {**(extra.get("extra_info") or {}), "prompt": view.get("prompt", ""), "response": view.get("response", ""),
                  "reasoning": view.get("reasoning", ""), "ground_truth": ground_truth, "data_source": extra.get("data_source", "")}
        text = self.rubric.format_map(fields)
        key = hashlib.sha256(text.encode()).digest()  # the same rubric text (question, answer, reference): the same verdict
        with self.lock:
            raw = self.cache.get(key)
        if raw is not None:
            return self._scored(raw, cached=True)
        try:
            # The run's own servers, through its gateway: ahead of the rollouts, which wait for its verdicts.
            extra = {"extra_body": {"priority": JUDGE_PRIORITY}} if self.cfg.base_url == SELF else {}
            reply = self.client.chat.completions.create(model=self.served_model(), messages=[{"role": "user", "content": text}],
                                                        temperature=self.cfg.temperature, max_tokens=self.cfg.max_tokens, **extra)
        except JudgeError:
            raise
        except Exception as exc:  # the openai client's errors, a connection refused, a timeout
            failed_at = self.base_url
            if self.cfg.base_url == SELF:
                self._client = None  # ask the run where its gateway is before the next call
            raise JudgeError(f"judge_error: the judge at {failed_at} failed: {one_line(exc)}") from None
        raw = parse_score(reply.choices[0].message.content, self.cfg.score_pattern)
        if self.cfg.cache_size:
            with self.lock:
                self.cache[key] = raw
                while len(self.cache) > self.cfg.cache_size:
                    self.cache.popitem(last=False)
        return self._scored(raw, cached=False)

    def _scored(self, raw: float, cached: bool) -> dict:
        """The judge's number over reward.judge.max_score as the score, the number itself as a metric."""
        return {"score": raw / self.cfg.max_score if self.cfg.max_score else raw, "judge_raw": raw, "judge_cached": float(cached)}


def probe(cfg: JudgeConfig) -> None:
    """At start, before any actor: the judge answers and serves reward.judge.model -> else one line.
    The run's own servers (base_url self) start with the run: nothing to ask yet."""
    if cfg.base_url == SELF:
        return
    judge = Judge(cfg)
    try:
        listed = [m.id for m in judge.client.models.list().data]
        if not listed:
            raise JudgeError(f"the judge at {cfg.base_url} serves no model")
        if cfg.model is not None and cfg.model not in listed:
            raise ConfigError(f"reward.judge.model={cfg.model!r}: the judge at {cfg.base_url} serves {listed}")
    except (ConfigError, JudgeError):
        raise
    except Exception as exc:
        raise ConfigError(f"reward.judge.base_url={cfg.base_url}: the judge does not answer: {one_line(exc)}") from None
    finally:
        judge.client.close()
