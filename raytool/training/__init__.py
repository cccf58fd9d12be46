"""Training: the HF model on one device (FSDP2 across a process group), RL and SFT steps, checkpoints."""

from raytool.training.batching import micro_batches
from raytool.training.trainer import Trainer, TrainerSettings

__all__ = ["Trainer", "TrainerSettings", "micro_batches"]
