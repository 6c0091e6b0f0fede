"""One turn without a session: the prompt ids a new session's first turn would get, and the
sample its export would give, with nothing stored in between.

`prepare` + `commit` give the sample that create, prepare_turn, commit_turn, export and close
give for a session of one turn (without its `session_id`): what the rollout's default
single-turn agent needs, at ~a third of the CPU. `SessionStore.prepare_one` / `commit_one` are
its public face.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from miles.rollout.tito.assistant import AssistantParser, openai_message
from miles.rollout.tito.output_check import checked_output
from miles.rollout.tito.render import TurnRenderer
from miles.rollout.tito.tree import Node, trajectory
from miles.rollout.tito.turns import OneTurn
from miles.rollout.tokens.messages import Message, check_ends_for_generation, normalize
from miles.rollout.tokens.vl_placeholders import turn_images
from miles.rollout.types import Sample

# token ids of new messages -> the ids with each image's placeholder expanded (SessionStore._expand)
Expand = Callable[[list[int], list[Message]], list[int]]


class OneTurnPath:
    """The session-less path for one turn, over the store's renderer and assistant parser."""

    def __init__(self, renderer: TurnRenderer, assistant: AssistantParser, expand: Expand) -> None:
        self._renderer = renderer
        self._assistant = assistant
        self._expand = expand

    def prepare(self, messages: Any, tools: list[dict[str, Any]] | None, metadata: dict[str, Any] | None,
                temperature: float) -> OneTurn:
        msgs = normalize(messages)
        check_ends_for_generation(msgs)
        text = self._renderer.render(msgs, tools, True)
        return OneTurn(self._expand(self._renderer.tok.encode(text), msgs), dict(metadata or {}),
                       turn_images([], msgs), temperature)

    def commit(self, turn: OneTurn, sampled_ids: list[int], logprobs: list[float],
               routed_experts: np.ndarray | None, versions: int | list[int],
               finish_reason: str) -> tuple[Sample, dict[str, Any], str]:
        """(the trajectory's sample, the assistant message in OpenAI form, its OpenAI finish_reason)."""
        n_prompt = len(turn.prompt_ids)
        sampled, vers, experts = checked_output("one turn", n_prompt, n_prompt, sampled_ids, logprobs,
                                                routed_experts, versions, finish_reason)
        message, oa_finish = self._assistant.message(self._renderer.tok.decode(sampled), finish_reason)
        node = Node(id=1, parent=Node(id=0, parent=None, messages=[]), messages=[message], n_spliced=n_prompt,
                    ids=turn.prompt_ids + sampled, logprobs=[float(x) for x in logprobs], versions=vers,
                    experts=experts, finish_reason=finish_reason, temperature=turn.temperature)
        sample = trajectory(node, turn.metadata)
        sample.images = turn.images
        return sample, openai_message(message), oa_finish
