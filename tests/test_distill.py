"""On-policy distillation's plain logic (raytool.distill), without Ray: the teacher's scores
aligned with the student's tokens and checked, the step's summaries, and the teacher refused at
start when it cannot teach this student."""

import math
from pathlib import Path

import pytest

from raytool.config import ConfigError, load_config
from raytool.distill import check_teacher, reverse_kl, teacher_logprobs, tool_turn_agreement


def test_the_teachers_scores_are_aligned_checked_and_summarised():
    # prompt of 2 tokens, response [gen, gen, obs, gen]: the scores cover ids[1:], 5 of them
    assert teacher_logprobs(2, [1, 1, 0, 1], [-9.0, -1.0, -2.0, -3.0, -4.0]) == [-1.0, -2.0, 0.0, -4.0]
    with pytest.raises(ValueError, match="scored 4 tokens, expected 5"):
        teacher_logprobs(2, [1, 1, 0, 1], [-1.0] * 4)
    with pytest.raises(ValueError, match="response token 1 is -inf"):
        teacher_logprobs(2, [1, 1, 0, 1], [-9.0, -1.0, float("-inf"), -3.0, -4.0])
    assert teacher_logprobs(2, [1, 1, 0, 1], [-9.0, -1.0, -2.0, float("nan"), -4.0])[2] == 0.0  # an observation's score is not used
    student, teacher, mask = [-1.0, -1.0, 0.0, -2.0], [-1.0, -3.0, 0.0, -1.0], [1, 1, 0, 1]
    assert reverse_kl(student, teacher, mask) == pytest.approx((0.0 + 2.0 - 1.0) / 3)
    assert tool_turn_agreement(student, teacher, mask) == pytest.approx((1.0 + math.exp(-2.0)) / 2)  # the turn before the observation
    assert tool_turn_agreement(student, teacher, [1, 1, 1, 1]) is None and reverse_kl(student, teacher, [0, 0, 0, 0]) is None


def test_a_teacher_that_is_missing_or_speaks_another_tokenizer_is_refused_naming_the_key(tiny_model_path, tokenizer, tmp_path):
    from transformers import AutoTokenizer

    cfg = load_config(None, ["model.path=tiny-random", "distill.teacher=smollm2-135m-instruct"])
    assert check_teacher(cfg, tokenizer).endswith("smollm2-135m-instruct")  # SmolLM2's tokenizer, both
    with pytest.raises(ConfigError, match=r"config key 'distill.teacher': .*/nowhere"):
        check_teacher(load_config(None, ["distill.teacher=/nowhere"]), tokenizer)
    other = AutoTokenizer.from_pretrained(tiny_model_path)
    other.add_tokens(["<teacher_only>"])
    other.save_pretrained(tmp_path / "other")
    (tmp_path / "other" / "config.json").write_text((Path(tiny_model_path) / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"distill.teacher': .*tokenizer is not the student's \(49153 tokens against 49152; 1 of the teacher's differ, first \[\('<teacher_only>', 49152\)\]"):
        check_teacher(load_config(None, [f"distill.teacher={tmp_path / 'other'}"]), tokenizer)
