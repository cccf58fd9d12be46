"""GPU checks of the torch-level parts (skipped without CUDA): the engine and trainer agree in bf16."""

import asyncio

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_engine_and_trainer_on_cuda(tiny_model_path):
    from raytool.engines.hf import HFEngine
    from raytool.training import Trainer, TrainerSettings
    from raytool.training.trainer import _token_logprobs
    from raytool.types import SamplingParams, Trajectory

    engine = HFEngine(tiny_model_path, dtype="bfloat16", device="cuda")
    prompt = [1, 4093, 198, 2020]
    out = asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=8), "r0"))
    ids = torch.tensor([prompt + out.token_ids], device="cuda")
    logp = _token_logprobs(engine.model, ids, torch.ones_like(ids))[0, len(prompt) - 1 :].cpu()
    assert torch.allclose(logp, torch.tensor(out.logprobs), atol=5e-2)  # bf16 tolerance

    trainer = Trainer(tiny_model_path, TrainerSettings(lr=1e-3), dtype="bfloat16", device="cuda")
    batch = [Trajectory(uid=str(i), group_id="g", prompt_ids=prompt, response_ids=out.token_ids, response_mask=[1] * len(out.token_ids),
                        rollout_logprobs=out.logprobs, messages=[], ground_truth="", reward=float(i)) for i in range(2)]
    assert trainer.rl_step(batch)["actor/grad_norm"] > 0
    engine.load_weights(trainer.named_weights())
