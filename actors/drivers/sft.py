"""`raytool sft`: multi-turn SFT on tool-calling conversations (the ReTool cold start) on the
trainer group alone: epochs, validation loss, resumable checkpoints, an HF export at the end.

The result is an HF checkpoint: point `model.path` of the RL run at it.
"""

from __future__ import annotations

import logging
import math
import random
import time
from pathlib import Path

import msgspec

from actors.drivers.compose import check_memory, run_namespace, wait_for_resources
from actors.drivers.checkpoint import checkpoint_root, read_state, remove_earlier_run, save_checkpoint, where_to_run
from actors.drivers.pipeline import reforming
from actors.drivers.session import connect, run_log
from actors.trainer import TrainerGroup
from raytool import storage
from raytool.agent.render import as_in_turn
from raytool.config import RunConfig, to_yaml
from raytool.data.conversations import load_conversations, sft_examples, split_validation
from raytool.errors import RaytoolError
from raytool.models import load_tokenizer, resolve_model
from raytool.tracking import Tracker, keep_lines, validate_backends
from raytool.training import lr_at

log = logging.getLogger(__name__)


class SFTState(msgspec.Struct):
    step: int  # optimizer steps done
    epoch: int  # the epoch that step belongs to
    index: int  # batches of that epoch done


def _load(files: list[str]):
    conversations = []
    for path in files:
        rows, problems = load_conversations(path)
        if problems:
            log.warning("%s: %d rows skipped (see above)", path, len(problems))
        conversations += rows
    return conversations


def _examples(conversations, cfg: RunConfig, tokenizer):
    if cfg.agent.observation_style == "in_turn":
        conversations = [msgspec.structs.replace(c, messages=as_in_turn(c.messages)) for c in conversations]
    return sft_examples(conversations, tokenizer, cfg.sft.max_length, cfg.agent.chat_template_kwargs, cfg.agent.format)[0]  # (it logs its own counts)


def _train(cfg: RunConfig, run_dir: Path, model_path: str, train_examples: list, val_examples: list, checkpoint: str | None) -> None:
    """Start the trainer group and run the epochs (from `checkpoint`, if given) to the final export."""
    s = cfg.sft
    state = read_state(checkpoint, SFTState) if checkpoint is not None else SFTState(step=0, epoch=0, index=0)
    if checkpoint is not None:  # the steps after the checkpoint are done again: each logged once
        keep_lines(run_dir / "sft_metrics.jsonl", lambda entry: entry.get("step", 0) <= state.step)
    per_epoch = math.ceil(len(train_examples) / s.batch_size)
    total = per_epoch * s.epochs
    root = checkpoint_root(cfg, run_dir)
    tracker = Tracker(run_dir, cfg.logging, config=msgspec.to_builtins(cfg))
    trainer = None
    try:
        trainer = TrainerGroup(cfg, model_path, namespace=cfg.cluster.namespace or run_namespace(f"raytool-sft-{run_dir.resolve().name}"))
        if trainer.cfg != cfg:  # the trainer's autos, decided on its device: config.yaml records what the run runs with
            cfg = trainer.cfg
            (run_dir / "config.yaml").write_text(to_yaml(cfg))
        trainer.check_storage(root)
        if checkpoint is not None:
            trainer.load_checkpoint(checkpoint)
            log.info("resumed from %s at step %d", checkpoint, state.step)

        def validate(metrics: dict) -> None:
            if val_examples:
                metrics["val/sft_loss"] = trainer.sft_val_loss(val_examples)

        for epoch in range(state.epoch, s.epochs):
            order = list(range(len(train_examples)))
            random.Random(cfg.trainer.seed * 7919 + epoch).shuffle(order)
            first = state.index if epoch == state.epoch else 0
            for index in range(first, per_epoch):
                start = time.perf_counter()
                batch = [train_examples[i] for i in order[index * s.batch_size : (index + 1) * s.batch_size]]
                metrics = trainer.sft_step(batch, lr_at(state.step, s.lr, s.warmup_steps, total, s.lr_schedule))
                state = SFTState(step=state.step + 1, epoch=epoch, index=index + 1)
                if index + 1 == per_epoch:  # the epoch is done: a resume starts the next one
                    state = SFTState(step=state.step, epoch=epoch + 1, index=0)
                metrics.update(step=state.step, epoch=epoch + (index + 1) / per_epoch, **{"timing/step_s": time.perf_counter() - start})
                if (s.val_every and state.step % s.val_every == 0) or (not s.val_every and index + 1 == per_epoch):
                    validate(metrics)
                tracker.log(metrics, phase="sft")
                if s.save_every and state.step % s.save_every == 0 and state.step != total:
                    save_checkpoint(trainer, root, state, config_yaml=to_yaml(cfg), keep=cfg.trainer.keep_checkpoints, run_dir=run_dir)
        directory = save_checkpoint(trainer, root, state, config_yaml=to_yaml(cfg), keep=cfg.trainer.keep_checkpoints, run_dir=run_dir)
        log.info("final model (HF format): %s", trainer.export_hf(storage.join(directory, "hf")))
    finally:
        tracker.close()
        if trainer is not None:
            trainer.shutdown()


def run_sft(cfg: RunConfig, run_dir: str | Path | None = None, address: str | None = None, resume: str | Path | None = None,
            overwrite: bool = False) -> Path:
    s = cfg.sft
    if not s.train_files:
        raise RaytoolError("config key 'sft.train_files' is empty: give the conversations to train on (jsonl or parquet, messages + tools)")
    checkpoint, run_dir, earlier = where_to_run(cfg, run_dir, resume, overwrite)
    model_path = resolve_model(cfg.model.path)
    validate_backends(cfg.logging)
    tokenizer = load_tokenizer(model_path)
    train = _load(s.train_files)
    val = _load(s.val_files) if s.val_files else []
    if not val and s.val_fraction > 0:
        train, val = split_validation(train, s.val_fraction, seed=cfg.trainer.seed)
    train_examples = _examples(train, cfg, tokenizer)
    val_examples = _examples(val, cfg, tokenizer) if val else []
    remove_earlier_run(run_dir, earlier)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    with run_log(run_dir):
        connect(address or cfg.cluster.address, log_to_driver=cfg.logging.console_level == "all")
        wait_for_resources(cfg, only={"trainer worker"})
        check_memory(cfg, model_path, with_servers=False)
        reforming(cfg, run_dir, checkpoint, lambda checkpoint: _train(cfg, run_dir, model_path, train_examples, val_examples, checkpoint))
    return run_dir
