"""TrainerWorker (one per device) and TrainerGroup (its placement group and process group)."""

from __future__ import annotations

import os
import socket

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.common import actor_options
from raytool.config import RunConfig
from raytool.device import detect, set_torch_threads
from raytool.training import Trainer, TrainerSettings
from raytool.types import SFTExample
from raytool.weightsync import WeightSender


@ray.remote
class TrainerWorker:
    def __init__(self, rank: int, world_size: int, model_path: str, settings: TrainerSettings, dtype: str, torch_threads: int):
        set_torch_threads(torch_threads)
        self.rank, self.world_size = rank, world_size
        self.model_path, self.settings, self.dtype = model_path, settings, dtype
        self.trainer: Trainer | None = None
        self.sender: WeightSender | None = None
        self._sender_key: tuple = ()

    def rendezvous_address(self) -> str:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def setup(self, init_method: str | None) -> None:
        device = detect()
        if self.world_size > 1:
            import torch.distributed as dist

            dist.init_process_group(device.dist_backend, init_method=init_method, rank=self.rank, world_size=self.world_size)
        local = "cuda" if device.kind == "cuda" else device.kind
        self.trainer = Trainer(self.model_path, self.settings, dtype=self.dtype, device=local, rank=self.rank, world_size=self.world_size)

    def rl_step(self, trajectory_refs: list) -> dict:
        groups = ray.get(trajectory_refs)
        return self.trainer.rl_step([t for group in groups for t in group])

    def sft_step(self, examples: list[SFTExample], lr: float) -> dict:
        return self.trainer.sft_step(examples, lr)

    def send_weights(self, addresses: list[str], version: int, bucket_bytes: int) -> dict:
        """Rank 0 streams; the other ranks take part in gathering full tensors from their shards."""
        weights = self.trainer.named_weights()
        if self.rank != 0:
            for _ in weights:  # each step of the iteration is an all-gather rank 0 waits on
                continue
            return {}
        key = (tuple(addresses), bucket_bytes)
        if self.sender is None or self._sender_key != key:
            if self.sender is not None:
                self.sender.close()
            self.sender, self._sender_key = WeightSender(addresses, bucket_bytes), key
        return self.sender.send(weights, version)

    def save(self, directory: str) -> str:
        return str(self.trainer.save(directory))


class TrainerGroup:
    """N TrainerWorkers in one placement group, joined in a torch process group when N > 1."""

    def __init__(self, cfg: RunConfig, model_path: str):
        t, a = cfg.trainer, cfg.algorithm
        settings = TrainerSettings(
            lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip, micro_batch_tokens=t.micro_batch_tokens,
            adv_estimator=a.adv_estimator, norm_adv_by_std=a.norm_adv_by_std, policy_loss=a.policy_loss,
            clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high, loss_agg=a.loss_agg,
            ppo_epochs=a.ppo_epochs, mini_batches=a.mini_batches, seed=t.seed, temperature=cfg.rollout.temperature,
        )
        bundle = {"CPU": t.num_cpus} | ({"GPU": t.num_gpus} if t.num_gpus else {})
        self.pg = None
        strategy = None
        if any(bundle.values()):
            self.pg = placement_group([dict(bundle) for _ in range(t.num_workers)], strategy="PACK")
            ray.get(self.pg.ready())
        self.workers = []
        for rank in range(t.num_workers):
            if self.pg is not None:
                strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=rank)
            opts = actor_options(t.num_cpus, t.num_gpus, scheduling_strategy=strategy)
            self.workers.append(
                TrainerWorker.options(**opts).remote(rank, t.num_workers, model_path, settings, cfg.model.dtype, cfg.cluster.torch_threads)
            )
        init = ray.get(self.workers[0].rendezvous_address.remote()) if t.num_workers > 1 else None
        ray.get([w.setup.remote(init) for w in self.workers])

    def rl_step(self, trajectory_refs: list) -> dict:
        return ray.get([w.rl_step.remote(trajectory_refs) for w in self.workers])[0]

    def sft_step(self, examples: list[SFTExample], lr: float) -> dict:
        return ray.get([w.sft_step.remote(examples, lr) for w in self.workers])[0]

    def send_weights(self, addresses: list[str], version: int, bucket_bytes: int) -> list:
        """Object refs of the sending calls (the receivers must be listening concurrently)."""
        return [w.send_weights.remote(addresses, version, bucket_bytes) for w in self.workers]

    def save(self, directory: str) -> str:
        return ray.get([w.save.remote(os.fspath(directory)) for w in self.workers])[0]

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        if self.pg is not None:
            remove_placement_group(self.pg)
