"""Training: the policy on one device (FSDP2 across a process group), RL and SFT steps, checkpoints."""

from raytool.training.batching import micro_batches, packed_micro_batches
from raytool.training.export import write_hf
from raytool.training.trainer import Trainer, lr_at

__all__ = ["Trainer", "lr_at", "micro_batches", "packed_micro_batches", "write_hf"]
