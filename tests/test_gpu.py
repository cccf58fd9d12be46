"""GPU checks of the torch-level parts (skipped without CUDA): the engine and trainer agree in bf16."""

import asyncio

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_engine_and_trainer_on_cuda(tiny_model_path):
    from raytool.config import load_config
    from raytool.engines.hf import HFEngine
    from raytool.training import Trainer
    from raytool.training.batching import layout
    from raytool.types import SamplingParams, Trajectory

    engine = HFEngine(tiny_model_path, dtype="bfloat16", device="cuda")
    prompt = [1, 4093, 198, 2020]
    out = asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=8), "r0"))
    # compute_dtype auto: bf16 forward/backward on the GPU, fp32 master weights.
    trainer = Trainer(load_config(None, ["trainer.lr=1e-3"]), tiny_model_path, device="cuda")
    ids = prompt + out.token_ids
    lay = layout([ids], [list(range(len(prompt) - 1, len(ids) - 1))], trainer.pad_id, packed=False, device="cuda")
    with torch.no_grad():
        logp, _ = trainer.policy(lay.input_ids, lay.select, lay.labels)
    assert torch.allclose(logp.cpu(), torch.tensor(out.logprobs), atol=5e-2)  # bf16 tolerance

    batch = [Trajectory(uid=str(i), group_id="g", prompt_ids=prompt, response_ids=out.token_ids, response_mask=[1] * len(out.token_ids),
                        rollout_logprobs=out.logprobs, messages=[], ground_truth="", reward=float(i)) for i in range(2)]
    assert trainer.rl_step(batch)["actor/grad_norm"] > 0
    engine.load_weights(trainer.named_weights(torch.bfloat16))


def test_offloaded_checkpointed_bf16_step_on_cuda(tiny_model_path):
    """CPU offload (FSDP2 keeps parameters and optimizer state in host memory), activation
    checkpointing and chunked log-probs together, on one GPU."""
    from raytool.config import load_config
    from raytool.training import Trainer
    from raytool.types import Trajectory

    cfg = load_config(None, ["trainer.cpu_offload=true", "trainer.num_gpus=1", "trainer.activation_checkpointing=true", "trainer.logprob_chunk_tokens=4",
                             "trainer.lr=1e-6"])
    trainer = Trainer(cfg, tiny_model_path, device="cuda")
    before = {n: w.clone() for n, w in trainer.named_weights()}
    # Different responses: two copies of one sequence with opposite advantages would cancel to a zero gradient.
    batch = [Trajectory(uid=str(i), group_id="g", prompt_ids=[1, 2, 3], response_ids=list(range(5 + 20 * i, 17 + 20 * i)), response_mask=[1] * 12,
                        rollout_logprobs=[0.0] * 12, messages=[], ground_truth="", reward=float(i)) for i in range(2)]
    assert trainer.rl_step(batch)["actor/grad_norm"] > 0
    changed = sum(int((w != before[n]).sum()) for n, w in trainer.named_weights())
    assert changed / sum(w.numel() for w in before.values()) > 0.99
