"""On-policy distillation on the shared Ray cluster (examples/distill_tiny.yaml): a student that is
SmolLM2-135M-Instruct with its weights perturbed (a degraded copy, made here) learns from SmolLM2
itself as the teacher, in the asynchronous mode: the teacher's own rollout server scores every
token the student sampled, the student's reverse KL to the teacher falls over six steps, and the
off-policy correction applies to the distillation's advantages as to a reward's. A `slow` test
(pytest -m slow) shows a weak student's held-out accuracy rising, taught by a cold-started teacher
served by vLLM's own server and named by its URL."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from raytool.config import load_config

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def degraded_student(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct with Gaussian noise of 0.3 times each matrix's own std added to it."""
    import torch
    from transformers import AutoModelForCausalLM

    from raytool.models import resolve_model

    source, out = Path(resolve_model("smollm2-135m-instruct")), tmp_path_factory.mktemp("degraded")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=noise) * p.std() * 0.3)
    model.save_pretrained(out)
    for f in source.iterdir():
        if "token" in f.name or f.suffix == ".jinja":
            shutil.copy(f, out / f.name)
    return out


def test_the_students_reverse_kl_to_the_teacher_falls_in_the_asynchronous_mode(ray_cluster, tmp_path, degraded_student):
    from actors.drivers.pipeline import run

    cfg = load_config(REPO / "examples" / "distill_tiny.yaml", [
        f"model.path={degraded_student}", "trainer.lr=2e-5", "trainer.total_steps=6", "data.prompts_per_step=2",
        "async.max_staleness=1", "async.partial_rollout=wait", "rollout.seed=3", "logging.logger=[]", "logging.progress=false"])
    assert cfg.distill.teacher == "smollm2-135m-instruct" and cfg.distill.reward_weight == 0.0
    steps = [json.loads(line) for line in (run(cfg, tmp_path / "distilled") / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5, 6] and all(m["rollout/trajectories"] == 8 for m in steps)
    # On the student's own samples of each step, 8 trajectories: about 0.4 nats of noise a step. With
    # max_staleness=1 a step's samples may come from the policy one update behind, so the first two
    # steps are compared with the last two (synchronous, the same run fell 5.71, 4.87 -> 3.78, 3.50;
    # four steps against the first alone failed beside other work: 5.50 -> 5.11, 5.21).
    kl = [m["distill/rollout_reverse_kl"] for m in steps]
    assert all(k > 0 for k in kl) and (kl[4] + kl[5]) < 0.85 * (kl[0] + kl[1]), kl
    assert all(0.0 < m["distill/teacher_share"] < 1.0 and m["stage/teacher/service_s"] > 0 for m in steps)
    assert all("distill/reverse_kl" in m and "rollout_corr/is_mean" in m for m in steps)  # the trainer's, with the off-policy weights
    assert any(m["staleness/token_max"] >= 1 for m in steps[1:]), [m.get("staleness/token_max") for m in steps]  # some tokens came from the policy before


@pytest.mark.slow
def test_held_out_accuracy_rises_distilled_from_a_cold_started_teacher_behind_vllms_server(ray_cluster, tmp_path):
    """The ReTool cold start's second stage on the CPU: the teacher is SmolLM2 after the default run's
    cold start (12 SFT warm-up steps, one GRPO step), served by vLLM's own OpenAI server and named
    by its URL; the student is SmolLM2 after 3 of those warm-up steps. Six steps of the teacher's
    word alone, in the asynchronous mode: the student's held-out accuracy rises. `slow` (9.5 min
    here: two runs and a server; `pytest -m slow`); its figures are in docs/distillation.md. (At
    trainer.lr=5e-5 the same student fell, 0.34 -> 0.16: measured.)"""
    from actors.drivers.pipeline import run
    from helpers.vllm_api import vllm_api

    quiet = ["logging.logger=[]", "logging.progress=false"]
    teacher = run(load_config(None, ["trainer.total_steps=1", "eval.before_train=false", "eval.after_train=false", *quiet]), tmp_path / "teacher")
    with vllm_api(str(teacher / "checkpoints" / "step_1" / "hf"), "teacher", tmp_path / "teacher-server.log", max_model_len=2048) as url:
        student = run(load_config(None, [f"distill.teacher={url}", "trainer.sft_warmup_steps=3", "trainer.total_steps=6", "trainer.lr=2e-5",
                                         "eval.max_prompts=32", "eval.n=4", "async.max_staleness=1", *quiet]), tmp_path / "student")
    steps = [json.loads(line) for line in (student / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [0, 1, 2, 3, 4, 5, 6]
    # This student starts about 0.2 nats a token from the teacher: over 16 trajectories a step its
    # reverse KL is mostly noise (0.19, 0.32, 0.27, 0.21, 0.22, 0.19 and 0.27, 0.23, 0.29, 0.56,
    # 0.16, 0.16 measured), so only a blow-up is caught here; the degraded student above, 5 nats
    # away, is where the fall is asserted.
    kl = [m["distill/rollout_reverse_kl"] for m in steps[1:]]
    assert all(0.0 < k < 3 * (kl[0] + kl[1]) / 2 for k in kl), kl
    # the held-out samples answered right, both sources (20 and 12 prompts, 4 samples each): 0.34 and 0 -> 0.62 and 0.21 measured
    before, after = (sum(m[f"val-core/{src}/acc/mean@4"] * k for src, k in (("tool_arith", 80), ("tool_arith_unseen", 48))) for m in (steps[0], steps[-1]))
    assert after > before, (before, after)
