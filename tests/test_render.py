"""Token-exactness of the rendered conversation: what the loop builds is what the template renders."""

from raytool.data import make_splits, sft_messages
from raytool.types import Message


def test_observation_delta_matches_the_chat_template(renderer, tokenizer):
    msgs = [Message("system", "s"), Message("user", "What is 2*3?")]
    call = "<code>\n```python\nprint(2*3)\n```\n</code>"
    answer = "The answer is \\boxed{6}."
    ids = renderer.prompt_ids(msgs) + renderer.assistant_ids(call)
    ids += renderer.observation_ids([Message("tool", "6")]) + renderer.assistant_ids(answer)
    full = [*msgs, Message("assistant", call), Message("tool", "6"), Message("assistant", answer)]
    expected = tokenizer.encode(renderer.conversation_text(full), add_special_tokens=False)
    # The template ends the last assistant turn with eos + "\n"; the loop stops at eos.
    assert ids == expected[: len(ids)]
    assert tokenizer.decode(expected[len(ids):]) == "\n"


def test_sft_example_masks_only_assistant_turns(renderer, tokenizer):
    problem = make_splits(3, 1, seed=0)[0][0]
    msgs = sft_messages(problem)
    ex = renderer.sft_example(msgs)
    assert len(ex.input_ids) == len(ex.loss_mask)
    learned = tokenizer.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])
    eos = tokenizer.eos_token
    assert learned == msgs[2].content + eos + msgs[4].content + eos
    ignored = tokenizer.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if not m])
    assert problem.question in ignored and f"tool\n{problem.answer}" in ignored
