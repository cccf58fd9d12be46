"""A verl-style reward that encourages tool use, as the Ascend ReTool sample changed its reward:
+1 for a correct final answer; a wrong one scores -1 plus 0.1 per tool round the model took
(read from verl's `extra_info["num_turns"]`), capped at -0.6, so trying code pays but never
outscores a correct answer.

It keeps verl's signature, so the same file serves verl (`custom_reward_function.path`) and
raytool (`reward.fn=examples/rewards/verl_tool_bonus.py:compute_score`); raytool calls it as verl
does (see raytool.rewards).
"""

from raytool.rewards.math import extract_answer, normalize_answer


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer = extract_answer(solution_str, data_source)
    correct = answer is not None and normalize_answer(answer) == normalize_answer(str(ground_truth))
    if correct:
        return {"score": 1.0, "acc": 1.0, "pred": answer}
    # verl counts the prompt, each assistant turn and each round of tool responses: a conversation
    # with k tool rounds and a final answer has 2 + 2k turns.
    num_turns = (extra_info or {}).get("num_turns") or 2
    tool_rounds = max(0, (num_turns - 2) // 2)
    return {"score": min(-0.6, -1.0 + 0.1 * tool_rounds), "acc": 0.0, "pred": answer or ""}
