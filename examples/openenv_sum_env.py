"""An OpenEnv environment as its authors would ship it (a stand-in for one from the hub): a
FastAPI server made by `openenv.core.env_server.create_app`, reached over its WebSocket by any
OpenEnv client. miles drives it through `openenv.core.GenericEnvClient` and knows nothing of
its classes (rollout/envs/openenv_env.py).

The episode: reset(seed) poses "What is a + b?" (one-digit a, b drawn from the seed); each step
takes the model's reply as `message`; the last number in it equal to a + b ends the episode
with reward 1, anything else gets "Not quite, try again." and reward 0, and the third miss
ends the episode.

    pip install 'miles[openenv]'
    python examples/openenv_sum_env.py --port 8011    # serves http://127.0.0.1:8011
"""

from __future__ import annotations

import argparse
import random
import re
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

MAX_TRIES = 3


class SumAction(Action):
    message: str = Field(..., description="the model's reply")


class SumObservation(Observation):
    prompt: str = Field(default="", description="what the model reads next")


class SumEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each WebSocket session gets its own instance

    def __init__(self) -> None:
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._answer = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: object) -> SumObservation:
        rng = random.Random(seed)
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        self._answer = a + b
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return SumObservation(prompt=f"What is {a} + {b}? Reply with the number.", done=False, reward=0.0)

    def step(self, action: SumAction, timeout_s: float | None = None, **kwargs: object) -> SumObservation:  # type: ignore[override]
        self._state.step_count += 1
        nums = re.findall(r"-?\d+", action.message)
        if nums and int(nums[-1]) == self._answer:
            return SumObservation(prompt="Correct.", done=True, reward=1.0)
        done = self._state.step_count >= MAX_TRIES
        return SumObservation(prompt="Not quite, try again.", done=done, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(SumEnvironment, SumAction, SumObservation, env_name="sum_env", max_concurrent_envs=256)


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8011)
    args = ap.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
