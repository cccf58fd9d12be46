"""`raytool bench tinker`: one GRPO update through the Tinker API (`raytool serve --tinker` on
loopback, driven by the real `tinker` client: forward_backward with `importance_sampling`, then
optim_step) against raytool's own RL step (`Trainer.rl_step`) on the same batch, the same model and
the same LoRA rank, alternating (A B A B ...) in one process so that a noisy machine hits both alike.

The API's update carries what the client sends (each sequence whole, its advantages per position,
protobuf over HTTP, the futures it polls) and trains each sequence on its own row; the RL step
shares each group's prompt (trainer.prefix_sharing) and takes the batch as objects.
"""

from __future__ import annotations

import tempfile
import threading
import time

import msgspec
import torch

from raytool.config import RunConfig
from raytool.types import TrainBatch

RANK = 16
LR = 1e-5


def bench(cfg: RunConfig, repeats: int = 3) -> tuple[str, dict]:
    import tinker
    from tinker import types

    from raytool.algos import get_adv_estimator
    from raytool.bench.trainer import _batch
    from raytool.models import resolve_model
    from raytool.tinker.server import serve
    from raytool.tinker.service import TinkerService
    from raytool.training import Trainer

    model_path = resolve_model(cfg.model.path)
    cfg = msgspec.structs.replace(cfg, trainer=msgspec.structs.replace(cfg.trainer, lora_rank=RANK))
    trainer = Trainer(cfg, model_path)
    trajectories = _batch(trainer.lm.config.vocab_size, 8, 96, (64, 320))
    batch = TrainBatch.whole(trajectories)
    adv = get_adv_estimator("grpo")(torch.tensor(batch.rewards), batch.groups).tolist()
    data = []
    for t, a in zip(trajectories, adv):
        ids = t.prompt_ids + t.response_ids
        scored = [0] * (len(t.prompt_ids) - 1) + list(t.response_mask)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                loss_fn_inputs={"target_tokens": ids[1:], "logprobs": [-1.0 if m else 0.0 for m in scored],
                                                "advantages": [a if m else 0.0 for m in scored]}))
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
    with tempfile.TemporaryDirectory() as root:
        service = TinkerService({"policy": model_path}, root, cfg)
        stop, ready, bound = threading.Event(), threading.Event(), []
        thread = threading.Thread(target=serve, args=(service, "127.0.0.1", 0), kwargs=dict(stop=stop, ready=ready, bound=bound), daemon=True)
        thread.start()
        ready.wait(120)
        try:
            with tinker.ServiceClient(base_url=f"http://127.0.0.1:{bound[0]}", api_key="tml-bench") as client:
                tc = client.create_lora_training_client(base_model="policy", rank=RANK).result()

                def api_step():
                    fb = tc.forward_backward(data, "importance_sampling")
                    opt = tc.optim_step(types.AdamParams(learning_rate=LR))
                    fb.result(), opt.result()

                def rl_step():
                    trainer.rl_step(batch)

                api_step(), rl_step()  # warm-up: first allocations, the client's connection
                api, ours = [], []
                for _ in range(repeats):
                    for fn, times in ((api_step, api), (rl_step, ours)):
                        start = time.perf_counter()
                        fn()
                        times.append(time.perf_counter() - start)
        finally:
            stop.set()
            thread.join(30)
    api_s, ours_s = min(api), min(ours)
    result = {"tinker_step_s": api_s, "rl_step_s": ours_s, "tinker_vs_rl_step": api_s / ours_s, "tokens": tokens,
              "sequences": len(trajectories), "lora_rank": RANK, "compute_dtype": str(trainer.dtype).removeprefix("torch."), "repeats": repeats}
    table = "\n".join([
        f"tinker bench: {len(trajectories)} sequences, {tokens} tokens, LoRA rank {RANK}, {result['compute_dtype']} on the CPU, best of {repeats}",
        f"{'':44} {'s/step':>8} {'tokens/s':>10}",
        f"{'Tinker API (forward_backward + optim_step)':44} {api_s:8.3f} {tokens / api_s:10.0f}",
        f"{'raytool RL step (Trainer.rl_step)':44} {ours_s:8.3f} {tokens / ours_s:10.0f}",
        f"tinker_vs_rl_step = {api_s / ours_s:.2f}",
    ])
    return table, result
