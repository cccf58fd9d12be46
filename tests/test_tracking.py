"""The trackers: metrics under verl's names in metrics.jsonl, TensorBoard event files and an offline W&B run."""

from __future__ import annotations

import json

import pytest

from raytool.config import ConfigError, LoggingConfig, load_config
from raytool.tracking import Tracker, validate_backends, verl_names

# What actors/drivers/pipeline.py logs for a GRPO step, under raytool's own names.
_STEP = {
    "reward/mean": 0.5, "acc/mean": 0.25, "response_length/mean": 60.0, "num_turns/mean": 2.0, "tool/calls_per_traj": 1.5,
    "tool/error_rate": 0.1, "tool/errors/timeout": 0.05, "reward/timeouts": 0.0, "actor/pg_loss": -0.02,
    "timing/step_s": 9.0, "timing/rollout_s": 6.0, "timing/train_s": 2.0, "timing/weight_sync_s": 0.5, "timing/validation_s": 3.0,
    "val-core/tool_arith/acc/mean@4": 0.75, "policy_version": 3,
}


def test_pipeline_names_become_verls_and_verls_own_stay():
    m = verl_names({"step": 3, **_STEP})
    assert m["critic/score/mean"] == 0.5 and m["critic/rewards/mean"] == 0.5
    assert m["tool/calls_per_traj"] == 1.5
    assert (m["timing_s/step"], m["timing_s/gen"], m["timing_s/update_actor"], m["timing_s/update_weights"], m["timing_s/testing"]) == (9.0, 6.0, 2.0, 0.5, 3.0)
    for same in ("step", "acc/mean", "response_length/mean", "num_turns/mean", "actor/pg_loss", "tool/errors/timeout", "reward/timeouts",
                 "val-core/tool_arith/acc/mean@4", "policy_version"):
        assert m[same] == {"step": 3, **_STEP}[same]
    assert not any(k.startswith("timing/") or k == "reward/mean" for k in m)
    assert verl_names(m) == m  # already verl's: unchanged (old and new metrics files read alike)
    assert verl_names({"timing/foo_s": 1.0})["timing_s/foo"] == 1.0


def test_rewards_after_a_kl_penalty_are_not_claimed_to_equal_the_scores():
    m = verl_names({"reward/mean": 1.0, "actor/reward_kl_penalty": 0.3})
    assert m["critic/score/mean"] == 1.0 and "critic/rewards/mean" not in m


def test_sft_names_become_verls():
    m = verl_names({"step": 2, "sft/loss": 1.2, "sft/grad_norm": 0.8, "sft/lr": 1e-4, "sft/tokens": 900, "val/sft_loss": 1.4, "timing/step_s": 0.3}, "sft")
    assert m == {"step": 2, "train/loss": 1.2, "train/grad_norm": 0.8, "train/lr": 1e-4, "train/global_tokens": 900, "val/loss": 1.4, "train/time(s)": 0.3}


def test_jsonl_and_console_carry_verls_names(tmp_path, capsys):
    tracker = Tracker(tmp_path, LoggingConfig(logger=["console"]))
    tracker.log({"step": 1, **_STEP, "bad": float("nan")})
    tracker.log({"step": 1, "sft/loss": 2.5}, phase="sft")
    tracker.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["critic/score/mean"] == 0.5 and row["timing_s/update_weights"] == 0.5 and row["bad"] is None
    assert json.loads((tmp_path / "sft_metrics.jsonl").read_text()) == {"step": 1, "train/loss": 2.5}
    err = capsys.readouterr().err
    assert "[grpo step 1] score=0.5 acc=0.25 calls=1.5" in err and "tool_arith/acc/mean@4=0.750" in err and "[sft step 1] loss=2.5" in err
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "wandb").exists()


def test_tensorboard_event_file_holds_each_steps_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracker(tmp_path, LoggingConfig(logger=["tensorboard"]))
    for step in (1, 2, 3):
        tracker.log({"step": step, "reward/mean": step / 4, "timing/weight_sync_s": 0.1 * step, "finish/answer": 1.0})
    tracker.log({"step": 1, "sft/loss": 3.0}, phase="sft")
    tracker.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"critic/score/mean", "timing_s/update_weights", "train/loss"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [e.step for e in events.Scalars("timing_s/update_weights")] == [1, 2, 3]
    assert events.Scalars("timing_s/update_weights")[2].value == pytest.approx(0.3)
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 3.0)]


def _wandb_records(path):
    """The records of a .wandb file, decoded by wandb's own protobuf classes. The file is ':W&B',
    a 2-byte magic and a version byte, then a LevelDB log: 32 KiB blocks of chunks, each with a
    7-byte header (CRC32C, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def _items(items) -> dict:
    """A history/summary/config record's items as {name: value}; W&B writes a name as `key` or as `nested_key`."""
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def test_wandb_offline_run_in_the_run_dir_holds_history_summary_and_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, ["logging.logger=[wandb]", "logging.project_name=rt-test", "logging.experiment_name=tiny"])
    tracker = Tracker(tmp_path, cfg.logging, config={"trainer": {"total_steps": 3}})
    tracker.log({"step": 1, "sft/loss": 3.0}, phase="sft")
    for step in (1, 2, 3):
        tracker.log({"step": step, "reward/mean": step / 4, "timing/step_s": 2.0})
    tracker.close()

    (log_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(_wandb_records(log_file))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "rt-test" and run.display_name == "tiny"
    assert _items(run.config.update)["trainer"] == {"total_steps": 3}
    history = [_items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    grpo = [h for h in history if "critic/score/mean" in h]
    assert [(h["training/global_step"], h["critic/score/mean"], h["timing_s/step"]) for h in grpo] == [(1, 0.25, 2.0), (2, 0.5, 2.0), (3, 0.75, 2.0)]
    assert [(h["train/global_step"], h["train/loss"]) for h in history if "train/loss" in h] == [(1, 3.0)]
    steps = {m.metric.name: m.metric.step_metric for m in records if m.WhichOneof("record_type") == "metric"}
    assert steps["critic/score/mean"] == "training/global_step" and steps["train/loss"] == "train/global_step"
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(_items(r.summary.update))
    assert summary["critic/score/mean"] == 0.75 and summary["train/loss"] == 3.0


def test_a_selected_tracker_without_its_package_fails_naming_the_key(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"config key 'logging.logger': the 'wandb' tracker needs the wandb package"):
        validate_backends(LoggingConfig(logger=["console", "wandb"]))
    validate_backends(LoggingConfig(logger=["console", "tensorboard"]))
    with pytest.raises(ConfigError, match="logging.logger"):
        load_config(None, ["logging.logger=[console,mlflow]"])


def test_a_resume_cuts_the_steps_after_its_checkpoint_and_a_torn_last_line(tmp_path):
    """The driver died after logging steps 3 and 4 (and half a line) past its step-2 checkpoint:
    the resumed run logs 3 and 4 again, so they must go first, each step then written once."""
    import json

    from raytool.tracking import cut_after_step

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "x"')
    (tmp_path / "traces.jsonl").write_text("".join(json.dumps({"step": s, "uid": f"u{s}"}) + "\n" for s in (2, 3)))
    cut_after_step(tmp_path, 2)
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert [json.loads(line)["uid"] for line in (tmp_path / "traces.jsonl").read_text().splitlines()] == ["u2"]
    cut_after_step(tmp_path / "missing", 2)  # nothing logged yet: nothing to cut
