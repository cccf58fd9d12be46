"""verifiers environments for the tests, written as environment authors write them (the real
`verifiers` package's SingleTurnEnv, ToolEnv and MultiTurnEnv with rubrics); raytool rolls them
out with `agent.environment: helpers.vf_envs:load_...`."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

QUESTIONS = [(f"What is {a} + {b}?", str(a + b)) for a, b in ((2, 3), (17, 25), (40, 2), (7, 8), (11, 31), (6, 9), (12, 30), (1, 1))]


def _dataset(n: int) -> Dataset:
    return Dataset.from_list([{"question": q, "answer": a, "info": {"index": i}} for i, (q, a) in enumerate(QUESTIONS[:n])])


def exact(completion, answer) -> float:
    """1.0 when the last assistant message's stripped text is the answer."""
    text = completion[-1].content if completion else ""
    return float((text or "").strip() == answer)


def mentions_answer(completion, answer) -> float:
    return float(any(answer in (m.content or "") for m in completion if m.role == "assistant"))


def distinct(completions) -> list[float]:
    """A group-level reward function: the share of distinct answers in the group, for each."""
    texts = [c[-1].content if c else "" for c in completions]
    share = len(set(texts)) / len(texts)
    return [share] * len(texts)


def load_single_turn(n: int = 8, system_prompt: str = "Answer with the number only.") -> vf.Environment:
    rubric = vf.Rubric(funcs=[exact, mentions_answer, distinct], weights=[1.0, 0.5, 0.25])
    return vf.SingleTurnEnv(dataset=_dataset(n), eval_dataset=_dataset(4), system_prompt=system_prompt, rubric=rubric)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def load_tool_env(n: int = 8) -> vf.Environment:
    return vf.ToolEnv(dataset=_dataset(n), tools=[add], max_turns=3, system_prompt="Use the add tool, then answer with the number.",
                      rubric=vf.Rubric(funcs=[mentions_answer]))


class GuessEnv(vf.MultiTurnEnv):
    """A stateful game: the model guesses the answer; the environment says higher or lower until it
    is right or four guesses are spent."""

    async def setup_state(self, state):
        state["guesses"] = []
        return state

    async def env_response(self, messages, state, **kwargs):
        guess = (messages[-1].content or "").strip()
        state["guesses"].append(guess)
        if guess == state["answer"]:
            state["final_env_response"] = [vf.UserMessage(content="Right.")]
            return state["final_env_response"]
        try:
            hint = "higher" if int(guess) < int(state["answer"]) else "lower"
        except ValueError:
            hint = "a number, please"
        return [vf.UserMessage(content=f"No: {hint}.")]


def guessed(state) -> float:
    return float(state["answer"] in state.get("guesses", []))


def guesses(state) -> float:
    return float(len(state.get("guesses", [])))


def load_guess(n: int = 8) -> vf.Environment:
    return GuessEnv(dataset=_dataset(n), max_turns=4, system_prompt="Guess the number.",
                    rubric=vf.Rubric(funcs=[guessed, guesses], weights=[1.0, 0.0]))


def failing_reward(completion) -> float:
    raise ValueError("the grader is down")


def load_failing_rubric(n: int = 4) -> vf.Environment:
    return vf.SingleTurnEnv(dataset=_dataset(n), rubric=vf.Rubric(funcs=[exact, failing_reward]))


def load_broken(**kwargs) -> vf.Environment:
    raise RuntimeError("the environment's data is missing")


def add_to_total(x: int, total: int) -> int:
    """Add x to the running total.

    Args:
        x: The number to add.
        total: The running total (kept by the environment, hidden from the model).
    """
    return total + x


class TotalEnv(vf.StatefulToolEnv):
    """A StatefulToolEnv: the tool's `total` argument is hidden from the model and injected from
    the rollout's state, which each call updates."""

    def __init__(self, **kwargs):
        super().__init__(tools=[], **kwargs)
        self.add_tool(add_to_total, args_to_skip=["total"])

    async def setup_state(self, state, **kwargs):
        state["total"] = 40
        return await super().setup_state(state, **kwargs)

    def update_tool_args(self, tool_name, tool_args, messages, state, **kwargs):
        state["total"] = add_to_total(int(tool_args["x"]), state["total"])
        return {**tool_args, "total": state["total"] - int(tool_args["x"])}


def total_reached(state) -> float:
    return float(state.get("total") == 42)


def load_stateful_tool_env(n: int = 4) -> vf.Environment:
    return TotalEnv(dataset=_dataset(n), max_turns=3, system_prompt="Bring the total to 42 with add_to_total.",
                    rubric=vf.Rubric(funcs=[total_reached]))


def load_group(n: int = 4) -> vf.Environment:
    """An EnvGroup of the single-turn and the tool environment: each row is routed to its own."""
    return vf.EnvGroup(envs=[load_single_turn(n), load_tool_env(n)], env_names=["single", "tool"])
