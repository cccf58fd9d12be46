"""On-policy distillation (`distill.teacher`): the student samples, a teacher scores every token the
student sampled, and each trained token's advantage is the negative reverse KL of that token,
-(log p_student - log p_teacher), times `distill.kl_coef`, plus `distill.reward_weight` times the
task reward's advantage. Plain logic, no Ray: the teacher's scores arrive through a data plane
(`DataPlane.score`), the advantage is taken by the trainer (`token_advantages`).

The student's log-probs are the rollout engine's, those of the policy that sampled the tokens, so
the signal is the same in the synchronous and the asynchronous mode; the policy loss and its
off-policy corrections apply to it as to a reward's advantage.
"""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING

import msgspec

from raytool.config import ConfigError, DistillConfig, RunConfig
from raytool.errors import one_line
from raytool.types import PromptScores

if TYPE_CHECKING:  # the agent workers import this module in processes that never load torch
    import torch

log = logging.getLogger(__name__)


def teacher_run(cfg: RunConfig) -> RunConfig:
    """The config the teacher's rollout servers are built (and planned, and placed) from: the run's
    rollout settings with the teacher's own count, accelerators and tensor parallelism."""
    r, d = cfg.rollout, cfg.distill
    rollout = msgspec.structs.replace(r, num_servers=d.num_servers, num_gpus=r.num_gpus if d.num_gpus is None else d.num_gpus,
                                      tensor_parallel_size=d.tensor_parallel_size or r.tensor_parallel_size)
    return msgspec.structs.replace(cfg, rollout=rollout)


def teacher_logprobs(prompt_len: int, response_mask: list[int], scores: list[float]) -> list[float]:
    """The teacher's log-probs of a trajectory's response tokens (0.0 on observations), from its
    scores of the whole sequence (aligned with ids[1:]); ValueError saying what is wrong with them."""
    expected = prompt_len + len(response_mask) - 1
    if len(scores) != expected:
        raise ValueError(f"the teacher scored {len(scores)} tokens, expected {expected} (every token after the first)")
    own = scores[prompt_len - 1:]
    bad = next((t for t, (lp, m) in enumerate(zip(own, response_mask)) if m and not math.isfinite(lp)), None)
    if bad is not None:
        raise ValueError(f"the teacher's log-prob of response token {bad} is {own[bad]}")
    return [lp if m else 0.0 for lp, m in zip(own, response_mask)]


def reverse_kl(student: list[float], teacher: list[float], mask: list[int]) -> float | None:
    """The mean over the trained tokens of log p_student - log p_teacher (None: no trained token)."""
    terms = [s - t for s, t, m in zip(student, teacher, mask) if m]
    return sum(terms) / len(terms) if terms else None


def tool_turn_agreement(student: list[float], teacher: list[float], mask: list[int]) -> float | None:
    """On the turns that ended in a tool call (a generated run of tokens followed by an observation),
    the mean over their tokens of min(1, p_teacher / p_student): 1 where the teacher is at least as
    likely as the student to have written each token (None: no such turn)."""
    ends = [t for t in range(len(mask) - 1) if mask[t] and not mask[t + 1]]  # the last token of each turn an observation follows
    if not ends:
        return None
    last = ends[-1]
    terms = [math.exp(min(0.0, te - s)) for s, te, m in zip(student[: last + 1], teacher[: last + 1], mask[: last + 1]) if m]
    return sum(terms) / len(terms)


def token_advantages(seq_adv: torch.Tensor, rollout: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
                     kl_coef: float, reward_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] advantages: reward_weight * the sequence's advantage - kl_coef * (log p_student - log
    p_teacher) on trained tokens (0 elsewhere); and the reverse KL of each token ([B, T], 0 off the mask)."""
    kl = (rollout - teacher) * mask
    return (reward_weight * seq_adv - kl_coef * kl) * mask, kl


def check_teacher(cfg: RunConfig, student_tokenizer, source: str = "config") -> RunConfig:
    """Before anything starts: the run's config with the teacher settled (a teacher URL's model name
    filled in); a teacher that cannot be found or does not answer, whose tokenizer is not the
    student's (its log-probs would be of other tokens), or a URL that does not return prompt
    log-probs, is refused in one line naming the key."""
    from raytool.models import load_tokenizer, resolve_model

    if cfg.distill.url is not None:
        return check_teacher_url(cfg, student_tokenizer, source)
    try:
        teacher_path = resolve_model(cfg.distill.teacher)
    except FileNotFoundError as exc:
        raise ConfigError(f"{source}: config key 'distill.teacher': {exc}") from None
    ours, theirs = student_tokenizer.get_vocab(), load_tokenizer(teacher_path).get_vocab()
    conflicts = sorted(set(theirs.items()) - set(ours.items()), key=lambda kv: kv[1])
    if conflicts:
        raise ConfigError(f"{source}: config key 'distill.teacher': {cfg.distill.teacher}'s tokenizer is not the student's "
                          f"({len(theirs)} tokens against {len(ours)}; {len(conflicts)} of the teacher's differ, first {conflicts[:3]}): "
                          "a teacher scores the student's own token ids, so it must share the student's tokenizer")
    extra = sorted(set(ours) - set(theirs), key=ours.get)
    if extra:  # e.g. Qwen3's <think> and <tool_response> beside a Qwen2.5 teacher: the same ids for every token they share
        log.warning("distill.teacher: %s's tokenizer lacks %d of the student's tokens (%s); the teacher scores those ids with "
                    "embeddings it never trained", cfg.distill.teacher, len(extra), ", ".join(extra[:6]))
    return cfg


# -- a teacher behind an OpenAI-compatible URL ----------------------------------------------------

PROBE = "A teacher scores every token the student wrote: 12 * 7 = 84."  # the start check's scoring call
VOCAB_CHUNK = 8192  # token ids per /detokenize call of the start's vocabulary check


def scores_from_answer(ids: list[int], prompt_logprobs) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1 from a completions answer's `prompt_logprobs` (vLLM's: one
    entry per prompt token, None for the first, then {"<token id>": {"logprob": ...}, ...});
    ValueError saying what is missing."""
    if not isinstance(prompt_logprobs, list):
        raise ValueError(f"the answer has no prompt_logprobs (got {type(prompt_logprobs).__name__}): the server must return the "
                         "prompt's log-probs for `prompt_logprobs: 0` in a completions call, as vLLM's does")
    if len(prompt_logprobs) != len(ids):
        raise ValueError(f"the answer's prompt_logprobs has {len(prompt_logprobs)} entries for a prompt of {len(ids)} tokens")
    out = []
    for t in range(1, len(ids)):
        try:
            out.append(float(prompt_logprobs[t][str(ids[t])]["logprob"]))
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"the answer's prompt_logprobs[{t}] has no log-prob of token {ids[t]}: {str(prompt_logprobs[t])[:160]}") from None
    return out


def scoring_request(model: str, ids: list[int]) -> dict:
    """The completions request that scores `ids` (one prefill, one token generated), the start's
    check and every trajectory's call alike."""
    return dict(model=model, prompt=list(ids), max_tokens=1, temperature=0.0, extra_body={"prompt_logprobs": 0})


def answer_scores(ids: list[int], answer) -> list[float]:
    """`scores_from_answer` of an `openai` completions answer (the field is vLLM's, an extra one)."""
    return scores_from_answer(ids, getattr(answer.choices[0], "prompt_logprobs", None))


def _api_key(d: DistillConfig) -> str:
    return os.environ.get(d.api_key_env) or "EMPTY"


class TeacherEndpoint:
    """distill.teacher as a URL: `score` is one completions call per trajectory on the teacher's
    OpenAI-compatible API (its whole token sequence as the prompt, `prompt_logprobs: 0`, one token
    generated), with `distill.timeout_s` per call and `distill.retries` retries with back-off on a
    connection failure, a timeout or a 408/429/5xx (the `openai` client's, which honours
    Retry-After). The API does its own load balancing; what still fails raises, and the agent worker
    infra-fails the trajectory with the cause. The same interface as the teacher servers' data
    plane (`DataPlane.score`)."""

    def __init__(self, d: DistillConfig):
        if d.url is None or d.teacher_model is None:
            raise ValueError("TeacherEndpoint wants distill.teacher a URL and distill.teacher_model settled (raytool.distill.check_teacher)")
        self.cfg = d
        self._client = None  # made in the caller's event loop, on the first call

    async def score(self, ids: list[int], request_id: str, session: str | None = None) -> PromptScores:
        d = self.cfg
        if self._client is None:
            import openai

            self._client = openai.AsyncOpenAI(base_url=d.url, api_key=_api_key(d), timeout=d.timeout_s, max_retries=d.retries)
        answer = await self._client.completions.create(**scoring_request(d.teacher_model, ids), extra_headers={"X-Request-Id": request_id})
        return PromptScores(logprobs=answer_scores(ids, answer), server=d.url)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


def check_teacher_url(cfg: RunConfig, tokenizer, source: str) -> RunConfig:
    """A teacher URL, before anything starts: it answers, serves the model (distill.teacher_model, or
    its only one), holds the student's sequences, returns prompt log-probs, and maps every token id
    of the student's tokenizer to the same text (`/detokenize`, vLLM's) -> the config with
    distill.teacher_model set; else one line naming the key."""
    import httpx
    import openai

    d = cfg.distill
    key = f"{source}: config key 'distill.teacher'"
    with openai.OpenAI(base_url=d.url, api_key=_api_key(d), timeout=min(d.timeout_s, 60.0), max_retries=0) as client:
        try:
            listed = {m.id: m for m in client.models.list().data}
        except Exception as exc:
            raise ConfigError(f"{key}: the teacher at {d.url} does not answer: {one_line(exc)}") from None
        model = d.teacher_model or (next(iter(listed)) if len(listed) == 1 else None)
        if model not in listed:
            which = f"distill.teacher_model={d.teacher_model!r}" if d.teacher_model else "distill.teacher_model (which model?)"
            raise ConfigError(f"{source}: config key 'distill.teacher_model': the teacher at {d.url} serves {sorted(listed)}: set {which} to one of them")
        budget = (cfg.data.max_prompt_tokens or 0) + cfg.agent.max_response_tokens
        limit = getattr(listed[model], "max_model_len", None)  # vLLM's, an extra field
        if isinstance(limit, int) and limit < budget:
            raise ConfigError(f"{key}: {model} at {d.url} holds {limit} tokens a sequence, fewer than the student's "
                              f"{budget} (data.max_prompt_tokens + agent.max_response_tokens): it could not score them")
        ids = tokenizer.encode(PROBE, add_special_tokens=False)
        try:
            scores = answer_scores(ids, client.completions.create(**scoring_request(model, ids)))
        except ValueError as exc:
            raise ConfigError(f"{key}: {model} at {d.url} does not return prompt log-probs: {exc}") from None
        except Exception as exc:
            raise ConfigError(f"{key}: {model} at {d.url} refused a scoring call (prompt_logprobs: 0): {one_line(exc)}") from None
        if not all(math.isfinite(lp) for lp in scores):
            raise ConfigError(f"{key}: {model} at {d.url} returned non-finite prompt log-probs: {scores[:8]}")
    root = d.url.rstrip("/").removesuffix("/v1")
    with httpx.Client(timeout=min(d.timeout_s, 60.0), headers={"Authorization": f"Bearer {_api_key(d)}"}) as http:
        differs = first_other_token(lambda chunk: detokenize(http, root, model, chunk), tokenizer, len(tokenizer))
    if differs is not None:
        token, theirs, ours = differs
        raise ConfigError(f"{key}: {model} at {d.url} has another tokenizer than the student's: token id {token} is {theirs!r} "
                          f"there and {ours!r} here; a teacher scores the student's own token ids, so it must share the student's tokenizer")
    log.info("distill.teacher: %s at %s scores the student's tokens (prompt log-probs; the student's %d token ids decode alike)", model, d.url, len(tokenizer))
    return msgspec.structs.replace(cfg, distill=msgspec.structs.replace(d, teacher_model=model))


def detokenize(http, root: str, model: str, ids: list[int]) -> str:
    """The teacher server's text of `ids` (vLLM's /detokenize); a ConfigError where it has none."""
    try:
        reply = http.post(f"{root}/detokenize", json={"model": model, "tokens": ids})
    except Exception as exc:
        raise ConfigError(f"config key 'distill.teacher': {root}/detokenize does not answer: {one_line(exc)}") from None
    if reply.status_code == 404:
        raise ConfigError(f"config key 'distill.teacher': the teacher at {root} has no /detokenize (vLLM's server has it), so its "
                          "tokenizer cannot be checked against the student's; serve the teacher with vLLM")
    try:
        text = reply.json()["prompt"] if reply.status_code == 200 else None
    except (ValueError, KeyError, TypeError):
        text = None
    if not isinstance(text, str):
        raise ConfigError(f"config key 'distill.teacher': {root}/detokenize answered {reply.status_code}: {reply.text[:200]}")
    return text


def first_other_token(theirs, tokenizer, vocab: int, chunk: int = VOCAB_CHUNK) -> tuple[int, str, str] | None:
    """The first token id below `vocab` whose text differs between `theirs(ids) -> str` and the
    student's tokenizer, with both texts (None: every id decodes alike): chunks of ids compared
    whole, a chunk that differs halved until one id is left."""
    for start in range(0, vocab, chunk):
        ids = list(range(start, min(start + chunk, vocab)))
        if theirs(ids) == tokenizer.decode(ids):
            continue
        while len(ids) > 1:
            half = ids[: len(ids) // 2]
            ids = ids[len(ids) // 2:] if theirs(half) == tokenizer.decode(half) else half
        return ids[0], theirs(ids), tokenizer.decode(ids)
    return None
