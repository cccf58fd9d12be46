"""On-policy distillation's plain logic (raytool.distill), without Ray: the teacher's scores
aligned with the student's tokens and checked, the step's summaries, and the teacher refused at
start when it cannot teach this student."""

import math
from pathlib import Path

import pytest

from raytool.config import ConfigError, load_config
from raytool.distill import check_teacher, first_other_token, reverse_kl, scores_from_answer, teacher_logprobs, tool_turn_agreement


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
    assert check_teacher(cfg, tokenizer) == cfg  # SmolLM2's tokenizer, both
    with pytest.raises(ConfigError, match=r"config key 'distill.teacher': .*/nowhere"):
        check_teacher(load_config(None, ["distill.teacher=/nowhere"]), tokenizer)
    other = AutoTokenizer.from_pretrained(tiny_model_path)
    other.add_tokens(["<teacher_only>"])
    other.save_pretrained(tmp_path / "other")
    (tmp_path / "other" / "config.json").write_text((Path(tiny_model_path) / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"distill.teacher': .*tokenizer is not the student's \(49153 tokens against 49152; 1 of the teacher's differ, first \[\('<teacher_only>', 49152\)\]"):
        check_teacher(load_config(None, [f"distill.teacher={tmp_path / 'other'}"]), tokenizer)


def test_a_teacher_urls_prompt_logprobs_are_read_as_vllm_writes_them():
    ids = [5, 7, 9]
    answer = [None, {"7": {"logprob": -1.5, "rank": 3, "decoded_token": "a"}}, {"9": {"logprob": -0.25, "rank": 1, "decoded_token": "b"}}]
    assert scores_from_answer(ids, answer) == [-1.5, -0.25]
    with pytest.raises(ValueError, match="no prompt_logprobs .got NoneType.*prompt_logprobs: 0"):
        scores_from_answer(ids, None)  # a server that ignores the parameter
    with pytest.raises(ValueError, match="2 entries for a prompt of 3 tokens"):
        scores_from_answer(ids, answer[:2])
    with pytest.raises(ValueError, match=r"prompt_logprobs\[2\] has no log-prob of token 9"):
        scores_from_answer(ids, [None, answer[1], {"8": {"logprob": -3.0}}])  # another token's: not this one's


def test_the_first_token_id_a_teacher_decodes_otherwise_is_found_by_halving(tokenizer):
    calls = []

    def theirs(ids):  # a tokenizer like the student's but for id 30001, which is another token there
        calls.append(len(ids))
        return tokenizer.decode([i if i != 30001 else 17 for i in ids])

    token, their_text, our_text = first_other_token(theirs, tokenizer, len(tokenizer))
    assert token == 30001 and their_text == tokenizer.decode([17]) and our_text == tokenizer.decode([30001])
    assert len(calls) <= 6 + 14  # the chunks up to the one that differs, then about log2(8192) halvings
    assert first_other_token(tokenizer.decode, tokenizer, len(tokenizer)) is None


def test_a_teacher_url_that_does_not_answer_or_is_sized_like_a_model_is_refused_naming_the_key(tokenizer, free_tcp_port):
    url = f"http://127.0.0.1:{free_tcp_port}/v1"  # nothing listens there
    with pytest.raises(ConfigError, match=rf"config key 'distill.teacher': the teacher at {url} does not answer: .*Connection"):
        check_teacher(load_config(None, [f"distill.teacher={url}", "distill.timeout_s=5"]), tokenizer)
    with pytest.raises(ConfigError, match="config key 'distill.num_gpus' sizes raytool's own teacher servers, but distill.teacher is a URL"):
        load_config(None, [f"distill.teacher={url}", "distill.num_gpus=1"])
    with pytest.raises(ConfigError, match="config key 'distill.teacher_model' names the model of a teacher URL, but distill.teacher is 'smollm2"):
        load_config(None, ["distill.teacher=smollm2-135m-instruct", "distill.teacher_model=x"])
    cfg = load_config(None, [f"distill.teacher={url}"])
    assert cfg.distill.url == url and not cfg.distill.has_servers
