"""A teacher behind an OpenAI-compatible URL (distill.teacher: http://host:port/v1), against vLLM's
own server on loopback: accepted at start with its model name settled, its scores those of the
same model computed here, and refused in one line naming the key when it cannot teach this student
(another tokenizer, a model it does not serve, sequences longer than it holds)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from raytool.config import ConfigError, load_config
from raytool.distill import TeacherEndpoint, check_teacher

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def teacher_url(tiny_model_path, tmp_path_factory):
    from helpers.vllm_api import vllm_api

    with vllm_api(tiny_model_path, "tiny-teacher", tmp_path_factory.mktemp("vllm") / "server.log") as url:
        yield url


def test_vllms_server_as_the_teacher_is_accepted_and_scores_as_the_model_does(teacher_url, tiny_model_path, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    cfg = load_config(None, ["model.path=tiny-random", f"distill.teacher={teacher_url}", "agent.max_response_tokens=512"])
    settled = check_teacher(cfg, tokenizer)
    assert settled.distill.teacher_model == "tiny-teacher" and cfg.distill.teacher_model is None  # the only model it serves
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 * 7?"}, {"role": "assistant", "content": "84, by the tool."}], tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)

    async def score():
        endpoint = TeacherEndpoint(settled.distill)
        try:
            return await endpoint.score(ids, "traj-0-teacher")
        finally:
            await endpoint.close()

    scores = asyncio.run(score())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert scores.server == teacher_url and len(scores.logprobs) == len(ids) - 1
    assert max(abs(a - b) for a, b in zip(scores.logprobs, expected.tolist())) < 1e-3


def test_a_teacher_url_that_cannot_teach_this_student_is_refused_naming_the_key(teacher_url, tiny_model_path, tokenizer, tmp_path):
    from transformers import AutoTokenizer

    base = ["model.path=tiny-random", f"distill.teacher={teacher_url}"]
    with pytest.raises(ConfigError, match=r"config key 'distill.teacher_model': the teacher at .* serves \['tiny-teacher'\]: set distill.teacher_model='big'"):
        check_teacher(load_config(None, [*base, "distill.teacher_model=big"]), tokenizer)
    with pytest.raises(ConfigError, match=r"config key 'distill.teacher': tiny-teacher at .* holds 1024 tokens a sequence, fewer than the student's 2048"):
        check_teacher(load_config(None, [*base, "agent.max_response_tokens=2048"]), tokenizer)
    # A student whose tokenizer numbers two tokens the other way round: the same size, other ids.
    spec = json.loads((Path(tiny_model_path) / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "tokenizer_config.json").write_text((Path(tiny_model_path) / "tokenizer_config.json").read_text())
    swapped = AutoTokenizer.from_pretrained(tmp_path)
    first = min(vocab["hello"], vocab["world"])
    with pytest.raises(ConfigError, match=rf"config key 'distill.teacher': tiny-teacher at .* has another tokenizer than the student's: token id {first} is"):
        check_teacher(load_config(None, base), swapped)
    # A student with a token the teacher never had (Qwen3's <think> beside a Qwen2.5 teacher): refused too, by its id.
    extra = AutoTokenizer.from_pretrained(tiny_model_path)
    extra.add_tokens(["<student_only>"])
    with pytest.raises(ConfigError, match=r"token id 49152 is '' there and '<student_only>' here"):
        check_teacher(load_config(None, base), extra)


def test_a_run_distils_from_the_teacher_url_as_a_user_runs_it(teacher_url, tmp_path, logprob_tolerance):
    """`raytool train -c examples/distill_tiny.yaml distill.teacher=URL` on a local Ray instance of
    its own (this file's tests stay out of the session cluster's unit): every trajectory scored by
    vLLM's server (tiny-random, the student's own starting weights), no teacher server of raytool's
    own started, the settled model name recorded."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([str(Path(sys.executable).parent / "raytool"), "train", "-c", str(Path(__file__).resolve().parents[2] / "examples" / "distill_tiny.yaml"),
                           f"distill.teacher={teacher_url}", "trainer.total_steps=2", "data.prompts_per_step=2", "rollout.n=2",
                           "logging.logger=[]", "logging.progress=false", "--run-dir", str(run_dir)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2] and all(m["rollout/trajectories"] == 4 for m in steps)
    assert all(m["stage/teacher/service_s"] > 0 and math.isfinite(m["distill/reverse_kl"]) for m in steps)
    # The teacher serves the student's own starting weights: the first step's reverse KL is zero but
    # for the two engines' rounding (8e-5 measured); a token scored one place off would be nats away.
    assert abs(steps[0]["distill/rollout_reverse_kl"]) < logprob_tolerance, steps[0]["distill/rollout_reverse_kl"]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["distill"]["teacher_model"] == "tiny-teacher"
    assert re.search(r"on \S+: 1 rollout server, .*, 1 LLM manager$", done.stdout + done.stderr, re.M), done.stderr[-2000:]  # the student's; with a teacher model, 2 of each
