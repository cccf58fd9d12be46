"""An OpenEnv environment for examples/env_openenv_tiny.yaml: guess a number from 1 to 10.

Each session picks a number (from the reset's `seed`); the agent's message is a guess, the
observation says "higher", "lower" or "correct"; reward 1 for the correct guess, episode over
then or after four guesses. Served as an OpenEnv HTTP/WebSocket app: `app` below, which raytool
starts in each agent worker (`agent.environment: examples/openenv_guess.py:app`), or run it
yourself with `uvicorn examples.openenv_guess:app` and give raytool its URL.
"""

from __future__ import annotations

import random
import re

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

MAX_GUESSES = 4


class Guess(Action):
    message: str


class Hint(Observation):
    text: str


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per session: nothing shared

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self.number = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> Hint:
        self.number = random.Random(seed).randint(1, 10)
        self._state = State(episode_id=episode_id, step_count=0)
        return Hint(text=f"I picked a number from 1 to 10. You have {MAX_GUESSES} guesses: answer with one number.")

    def step(self, action: Guess, timeout_s: float | None = None, **kwargs) -> Hint:
        self._state.step_count += 1
        found = re.findall(r"-?\d+", action.message)
        guess = int(found[-1]) if found else None
        left = MAX_GUESSES - self._state.step_count
        if guess == self.number:
            return Hint(text="correct", done=True, reward=1.0)
        hint = "no number in your answer" if guess is None else "higher" if guess < self.number else "lower"
        return Hint(text=f"{hint} ({left} guesses left)", done=left <= 0, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, Guess, Hint, env_name="guess_number", max_concurrent_envs=64)
