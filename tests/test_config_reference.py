"""The config reference is generated from raytool/config.py and docs/config.md is that output."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytool.cli import main
from raytool.config_reference import explain, knobs, reference

PAGE = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_the_docs_page_is_the_generated_reference():
    assert PAGE.read_text() == reference(), "docs/config.md is out of date: run `raytool config --reference > docs/config.md`"


def test_every_knob_has_its_help_type_and_default():
    found = {k.key: k for k in knobs()}
    assert len(found) > 150 and [k for k, v in found.items() if not v.help] == []
    top_p = found["rollout.top_p"]
    assert (top_p.type, top_p.default, top_p.range, top_p.verl) == ("float", "1.0", "> 0, <= 1", ("actor_rollout_ref.rollout.top_p",))
    assert found["async.max_staleness"].range == ">= 0"  # the YAML name, not the field's async_
    assert "algorithm.rollout_correction.rollout_is" in found and found["algorithm.rollout_correction.rollout_is"].default == "'auto'"


def test_explain_prints_one_knob_and_names_the_closest_to_a_typo(capsys):
    assert main(["config", "--explain", "rollout.n"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rollout.n: int\n  default: 4\n  range: >= 1\n") and "verl: actor_rollout_ref.rollout.n" in out
    assert main(["config", "--explain", "rollout.temprature"]) == 2
    assert "did you mean 'rollout.temperature'?" in capsys.readouterr().err
    with pytest.raises(Exception, match="unknown config key"):
        explain("nope.nothing")


def test_explain_takes_verl_key_names_too():
    assert explain("actor_rollout_ref.rollout.n").startswith("actor_rollout_ref.rollout.n (verl) is raytool's rollout.n\nrollout.n: int")
    assert explain("actor_rollout_ref.actor.ppo_mini_batch_size").startswith(
        "actor_rollout_ref.actor.ppo_mini_batch_size (verl): raytool derives its own from it: algorithm.mini_batches")
    assert "accepted as True" in explain("data.return_raw_chat") and "raytool cannot honour it" in explain("trainer.val_only")
