"""The Tinker API served by raytool (raytool.tinker), driven by the unmodified `tinker` client (0.38)
on loopback, and the tinker-cookbook's own sl_loop and rl_loop run against it as they ship.

One service per module, in a thread of this process: the tiny random model as `tiny` and
SmolLM2-135M-Instruct under the name the cookbook's loops ask for (its chat format is the one the
cookbook's qwen3_instruct renderer writes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from helpers.net import free_port  # noqa: E402
from raytool.config import load_config  # noqa: E402
from raytool.models import resolve_model  # noqa: E402
from raytool.tinker.server import serve  # noqa: E402
from raytool.tinker.service import TinkerService  # noqa: E402

pytestmark = pytest.mark.integration

COOKBOOK_MODEL = "Qwen/Qwen3-4B-Instruct-2507"
KEY = "tml-raytool-test"


def _serving(models: dict, root, engine: str):
    cfg = load_config(None, ["trainer.compute_dtype=float32", "model.dtype=float32", f"rollout.engine={engine}"])
    service = TinkerService(models, root, cfg, poll_s=5.0)
    stop, ready, bound = threading.Event(), threading.Event(), []
    thread = threading.Thread(target=serve, args=(service, "127.0.0.1", 0), kwargs=dict(api_key=KEY, stop=stop, ready=ready, bound=bound),
                              daemon=True)
    thread.start()
    assert ready.wait(60)
    yield service, f"http://127.0.0.1:{bound[0]}"
    stop.set()
    thread.join(60)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    models = {"tiny": resolve_model("tiny-random"), COOKBOOK_MODEL: resolve_model("smollm2-135m-instruct")}
    yield from _serving(models, tmp_path_factory.mktemp("tinker"), "hf")


@pytest.fixture
def client(server):
    """A session per test, finished at its end: the service releases its training models then."""
    with tinker.ServiceClient(base_url=server[1], api_key=KEY) as c:
        yield c


def _datum(tokens: list[int], **inputs) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], **inputs})


TOKENS = [1, 9690, 198, 2683, 314, 253, 5356, 30, 2, 198, 1, 520, 9531, 198, 504, 3, 40, 800, 23313, 429]


def test_lora_training_client_trains_with_cross_entropy(client):
    tc = client.create_lora_training_client(base_model="tiny", rank=8).result()
    info = tc.get_info()
    assert (info.model_name, info.is_lora, info.lora_rank, info.model_data.arch) == ("tiny", True, 8, "llama")
    assert tc.get_tokenizer().encode("hello")  # the served model's own tokenizer, from its local directory
    weights = [0.0] * 5 + [1.0] * (len(TOKENS) - 6)
    data = [_datum(TOKENS, weights=weights), _datum(TOKENS[:12])]
    losses = []
    for _ in range(4):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=2e-2))
        out = fb.result()
        assert opt.result().metrics["optim/grad_norm"] > 0
        logprobs = [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]
        assert [len(x) for x in logprobs] == [len(TOKENS) - 1, 11]
        # the loss is the sum the client computes from the log-probs it got back
        expected = -(logprobs[0] * np.array(weights)).sum() - logprobs[1].sum()
        assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < losses[0] * 0.97, losses
    # forward only: the same log-probs twice, nothing accumulated
    a = tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    b = tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_array_equal(a, b)


def _rl_expected(loss, logp, sampled, adv, config):
    ratio = np.exp(logp - sampled)
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    if loss == "importance_sampling":
        return -(ratio * adv).sum()
    if loss == "ppo":
        return -np.minimum(ratio * adv, np.clip(ratio, low, high) * adv).sum()
    if loss == "cispo":
        return -(np.clip(ratio, low, high) * adv * logp).sum()
    return -(adv * logp - 0.5 * config["beta"] * (logp - sampled) ** 2).sum()


@pytest.mark.parametrize("loss,config", [("importance_sampling", {}), ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
                                         ("cispo", {}), ("dro", {"beta": 0.5})])
def test_rl_losses_are_the_documented_sums(client, loss, config):
    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
    n = len(TOKENS) - 1
    rng = np.random.default_rng(0)
    sampled = (-rng.uniform(8.0, 12.0, n)).astype(np.float32)  # the tiny model's log-probs are near -ln(49152) = -10.8
    adv = np.where(np.arange(n) < 6, 0.0, rng.normal(0, 1, n)).astype(np.float32)
    out = tc.forward_backward([_datum(TOKENS, logprobs=sampled.tolist(), advantages=adv.tolist())], loss, config or None).result()
    logp = out.loss_fn_outputs[0]["logprobs"].to_numpy().astype(np.float64)
    assert out.metrics["loss:sum"] == pytest.approx(_rl_expected(loss, logp, sampled.astype(np.float64), adv, config), rel=1e-4, abs=1e-4)
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["optim/grad_norm"] > 0


def test_custom_loss_runs_on_the_client_through_forward_and_cross_entropy(client):
    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()

    def loss_fn(data, logprobs):  # the mean log-prob, maximised
        total = sum(lp.sum() for lp in logprobs) / sum(len(lp) for lp in logprobs)
        return -total, {"mean_logprob": float(total)}

    out = tc.forward_backward_custom([_datum(TOKENS)], loss_fn).result()
    assert out.metrics["mean_logprob"] < 0
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["optim/grad_norm"] > 0


def test_sampler_samples_the_trained_weights_and_scores_prompts_as_the_trainer(client):
    tc = client.create_lora_training_client(base_model="tiny", rank=8).result()
    tc.forward_backward([_datum(TOKENS)], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    res = sampler.sample(prompt=types.ModelInput.from_ints(TOKENS[:6]), num_samples=3,
                         sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0)).result()
    assert len(res.sequences) == 3
    for seq in res.sequences:
        assert 1 <= len(seq.tokens) <= 5 and len(seq.logprobs) == len(seq.tokens)
        assert seq.stop_reason in ("stop", "length") and seq.sequence_id
    # the sampler's prompt log-probs are the trainer's (LoRA merged into the sampler's snapshot)
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    assert scored[0] is None
    trained = tc.forward([_datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(np.array(scored[1:], dtype=np.float32), trained, atol=2e-4)
    # the base model samples with its own weights, not the trained ones
    base = client.create_sampling_client(base_model="tiny")
    base_scored = base.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    assert not np.allclose(np.array(base_scored[1:]), trained, atol=1e-3)
    # and the trained sampler still gets its own back (the engine swaps weights per request)
    np.testing.assert_allclose(np.array(sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()[1:]), trained, atol=2e-4)


def test_a_vllm_sampler_holds_the_trained_weights_swapped_in_by_raytools_weight_sync(tmp_path):
    """`raytool serve --tinker` with rollout.engine=vllm, in a process of its own (vLLM's engine core
    and its sockets stay out of this one): the samplers' engine takes each snapshot through its
    weight receivers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "raytool.cli", "serve", "--tinker", "--model", "tiny=tiny-random", "--port", str(port),
                             "--api-key", KEY, "--checkpoints", str(tmp_path / "checkpoints"), "rollout.engine=vllm",
                             "trainer.compute_dtype=float32", "model.dtype=float32"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "Tinker API at" in proc.stdout.readline()
        with tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=KEY) as client:
            tc = client.create_lora_training_client(base_model="tiny", rank=8).result()
            tc.forward_backward([_datum(TOKENS)], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
            sampler = tc.save_weights_and_get_sampling_client().result()
            res = sampler.sample(prompt=types.ModelInput.from_ints(TOKENS[:6]), num_samples=2,
                                 sampling_params=types.SamplingParams(max_tokens=4)).result()
            assert [len(s.tokens) for s in res.sequences] == [4, 4] and all(len(s.logprobs) == 4 for s in res.sequences)
            trained = tc.forward([_datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
            scored = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
            np.testing.assert_allclose(np.array(scored[1:], dtype=np.float32), trained, atol=1e-4)
            base = client.create_sampling_client(base_model="tiny").compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
            assert not np.allclose(np.array(base[1:]), trained, atol=1e-3)
            again = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()  # swapped back in
            np.testing.assert_allclose(np.array(again[1:], dtype=np.float32), trained, atol=1e-4)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_checkpoints_restore_the_weights_and_the_optimizer(client):
    tc = client.create_lora_training_client(base_model="tiny", rank=8).result()
    for _ in range(2):
        tc.forward_backward([_datum(TOKENS)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    state = tc.save_state("after-two").result()
    assert state.path.endswith("/weights/after-two") and state.path.startswith("tinker://")
    before = tc.forward([_datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    restored = client.create_training_client_from_state_with_optimizer(state.path).result()
    again = restored.forward([_datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(again, before, atol=1e-6)
    # the same next step on both: the Adam moments came back too
    steps = []
    for c in (tc, restored):
        c.forward_backward([_datum(TOKENS)], "cross_entropy")
        c.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        steps.append(c.forward([_datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy())
    np.testing.assert_allclose(steps[0], steps[1], atol=1e-5)
    sampler_path = tc.save_weights_for_sampler("for-sampling").result().path
    assert sampler_path.endswith("/sampler_weights/for-sampling")
    res = client.create_sampling_client(model_path=sampler_path).sample(
        prompt=types.ModelInput.from_ints(TOKENS[:4]), num_samples=1, sampling_params=types.SamplingParams(max_tokens=3)).result()
    assert len(res.sequences[0].tokens) >= 1


def test_refusals_are_the_clients_own_errors_naming_the_cause(server, client):
    service, _ = server
    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="loss_fn 'no_such_loss' is not served"):
        tc.forward_backward([_datum(TOKENS)], "no_such_loss").result()
    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()  # a failed request poisons its client
    short = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs={"target_tokens": TOKENS[1:5]})
    with pytest.raises(tinker.BadRequestError, match=r"datum 0: loss_fn_inputs\['target_tokens'\] has 4 values for 19"):
        tc.forward_backward([short], "cross_entropy").result()
    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match=r"needs loss_fn_inputs \['logprobs', 'advantages'\]"):
        tc.forward_backward([_datum(TOKENS)], "ppo").result()
    with pytest.raises(tinker.NotFoundError, match="base model 'no/such-model' is not served here"):
        client.create_lora_training_client(base_model="no/such-model", rank=4).result()
    sampler = client.create_sampling_client(base_model="tiny")
    with pytest.raises(tinker.BadRequestError, match="topk_prompt_logprobs is not served"):
        sampler.sample(prompt=types.ModelInput.from_ints(TOKENS[:4]), num_samples=1, sampling_params=types.SamplingParams(max_tokens=2),
                       topk_prompt_logprobs=3).result()
    # a released session: its models are gone, and the next call says so
    tc = client.create_lora_training_client(base_model="tiny", rank=4).result()
    owner = service.training[tc.model_id].session
    service.sessions[owner].seen -= service.session_ttl_s + 1
    assert owner in service.release_idle()
    with pytest.raises(tinker.NotFoundError, match="unknown model_id .* its session was released"):
        tc.forward_backward([_datum(TOKENS)], "cross_entropy").result()
    with pytest.raises(tinker.NotFoundError, match=f"unknown session '{owner}'"):
        client.create_lora_training_client(base_model="tiny", rank=4).result()


def test_a_wrong_key_is_refused(server):
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=server[1], api_key="tml-wrong").get_server_capabilities()


# -- the cookbook's own loops -----------------------------------------------------------------------


def _cookbook_dir(root: Path) -> Path:
    """What the cookbook's loops load by their Hub names, as local copies in the directory they run
    in: the tokenizer (the served model's own) and data sets in the real schemas of no_robots and
    GSM8K (`main` config), written here (nothing is downloaded)."""
    (root / "Qwen").mkdir(parents=True)
    (root / COOKBOOK_MODEL).symlink_to(resolve_model("smollm2-135m-instruct"))
    facts = [("What is the capital of France?", "The capital of France is Paris."), ("Name a primary color.", "Red is a primary color."),
             ("What do bees make?", "Bees make honey."), ("How many legs does a spider have?", "A spider has eight legs.")]
    robots = root / "HuggingFaceH4" / "no_robots"
    robots.mkdir(parents=True)
    with open(robots / "train.jsonl", "w") as f:
        for i in range(16):
            q, a = facts[i % 4]
            f.write(json.dumps({"prompt": q, "prompt_id": f"p{i}", "messages": [{"content": q, "role": "user"},
                                                                                {"content": a, "role": "assistant"}], "category": "Open QA"}) + "\n")
    gsm8k = root / "openai" / "gsm8k"
    (gsm8k / "main").mkdir(parents=True)
    (gsm8k / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n"
                                     "  - split: test\n    path: main/test.jsonl\n---\n")
    for split, rows in (("train", 4), ("test", 2)):
        with open(gsm8k / "main" / f"{split}.jsonl", "w") as f:
            for i in range(rows):  # rl_loop's own few-shot question (SmolLM2-135M sometimes copies its \boxed{3}), and sums
                question, answer = ("How many r's are in strawberry?", 3) if i % 2 == 0 else (f"What is {i} plus 2?", i + 2)
                f.write(json.dumps({"question": question, "answer": f"The answer is <<{answer}={answer}>>{answer}.\n#### {answer}"}) + "\n")
    return root


def _recipe(name: str, url: str, cwd: Path, *args: str) -> list[dict]:
    env = {**os.environ, "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled",
           "HF_DATASETS_CACHE": str(cwd / "datasets-cache")}  # its own: datasets' cache would serve another test's copy
    log_path = cwd / f"{name}-run"
    proc = subprocess.run([sys.executable, "-m", f"tinker_cookbook.recipes.{name}", f"base_url={url}", f"model_name={COOKBOOK_MODEL}",
                           f"log_path={log_path}", "lora_rank=8", "save_every=0", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Training completed" in proc.stdout + proc.stderr
    assert "sampler_weights/final" in (log_path / "checkpoints.jsonl").read_text()
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_cookbook_sl_loop_runs_unmodified_and_its_loss_falls(server, tmp_path):
    rows = _recipe("sl_loop", server[1], _cookbook_dir(tmp_path), "batch_size=4", "max_steps=4", "learning_rate=1e-3")
    nll = [r["train_mean_nll"] for r in rows]
    assert len(nll) == 4 and nll[-1] < nll[0] * 0.7, nll


def test_cookbook_rl_loop_runs_unmodified_and_computes_rewards(server, tmp_path):
    rows = _recipe("rl_loop", server[1], _cookbook_dir(tmp_path), "batch_size=2", "group_size=4", "max_tokens=32", "max_steps=2",
                   "loss_fn=importance_sampling")
    assert len(rows) == 2
    assert all(0.0 <= r["reward/total"] <= 1.0 for r in rows)


def test_cookbook_rl_trainer_trains_on_its_math_environment(server, tmp_path):
    """rl_basic: the cookbook's own RL trainer (tinker_cookbook.rl.train) over its GSM8K MathEnv."""
    rows = _recipe("rl_basic", server[1], _cookbook_dir(tmp_path), "dataset_builder=tinker_cookbook.recipes.math_rl.math_env:Gsm8kDatasetBuilder",
                   "dataset_builder.batch_size=2", "dataset_builder.group_size=4", "dataset_builder.renderer_name=qwen3_instruct",
                   f"dataset_builder.model_name_for_tokenizer={COOKBOOK_MODEL}", "max_tokens=24", "eval_every=0")
    steps = [r for r in rows if "env/all/reward/total" in r]
    assert len(steps) == 2  # 4 rows in batches of 2
    # the trainer's log-probs of the sampled tokens are the sampler's: each sampler holds the weights just trained
    # (whether a step trains depends on its samples: a group whose rewards are all equal is dropped by the cookbook)
    assert all(abs(r["optim/kl_sample_train_v1"]) < 1e-3 for r in steps)
