"""The text a turn tokenizes: the chat-template rendering of the request after the stored
checkpoint's rendering, so only the appended messages are encoded.

The fast path renders the request whole and cuts the checkpoint's covered text off its front.
A template that writes the stored turn differently from how the model sampled it (tool-call
JSON spacing, a truncated turn, a leniently matched message) gets the stored turn closed with
the template's own end-of-turn text (`_gap`) and the new messages' rendering after it. Templates
verified local (`render_mode = "local"`) render only the last turn plus the new messages. The
template check (rollout/tokens/template_check.py) runs at construction.
"""

from __future__ import annotations

from typing import Any

from miles.core.errors import NotAppendOnly
from miles.core.schema.rollout import RenderMode, TemplateFallback, resolve_render_mode
from miles.rollout.tito.tree import Node
from miles.rollout.tokens.messages import Message, for_template
from miles.rollout.tokens.tokenizer import Tokenizer

_TAIL = 24  # characters of the generation prompt kept to locate sampled text in a rendering

Tools = list[dict[str, Any]] | None


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class TurnRenderer:
    """One tokenizer's chat template, checked append-only (or with a documented fallback)."""

    def __init__(self, tok: Tokenizer, fallback: TemplateFallback, verify_template: bool,
                 render_mode: RenderMode) -> None:
        from miles.rollout.tokens.template_check import (
            FALLBACKS,
            check_local_render,
            check_template,
        )

        self.tok = tok
        self.fallback = fallback
        if verify_template:
            report = check_template(tok)
            if not report.ok and fallback == "none":
                raise NotAppendOnly("the chat template is not append-only, so suffix tokenization would "
                                    "not match the whole conversation; first problems:\n"
                                    + report.summary(3)
                                    + "\nset rollout.template_fallback to one of "
                                    + ", ".join(FALLBACKS) + " to accept a documented fallback")
        self.stop_texts = [tok.decode([i]) for i in tok.stop_token_ids]
        # local: render only the last turn + the new messages (verified equal on canonical chats)
        self.local = resolve_render_mode(render_mode, lambda: (
            verify_template and fallback == "none" and not check_local_render(tok).findings)) == "local"

    def render(self, msgs: list[Message], tools: Tools, gen: bool) -> str:
        return self.tok.apply_chat_template([for_template(m) for m in msgs], tools, gen)

    def new_text(self, sid: str, tools: Tools, node: Node, msgs: list[Message], pos: int) -> tuple[str, str, str]:
        """(text to tokenize, the full prompt text if rendered, the generation prompt's tail) for
        request `msgs` of session `sid`, whose first `pos` messages `node` stores."""
        if node.parent is None:
            full = self.render(msgs, tools, True)
            return full, full, full[-_TAIL:]
        if self.local:
            got = self._local_new_text(tools, node, msgs[pos:])
            if got is not None:
                return got[0], "", got[1]
        full = self.render(msgs, tools, True)
        covered = node.covered or self._prompt_text(tools, node) + node.sampled_text
        if full.startswith(covered):  # one render, nothing re-tokenized
            return full[len(covered):], full, full[-_TAIL:]
        # The template writes the stored turn differently from how the model sampled it
        # (tool-call JSON spacing, a truncated turn, a leniently matched message): close the
        # stored turn with the template's own end-of-turn text, then append the new messages.
        rendered = self.render(node.all_messages(), tools, False)
        gap = self._gap(rendered, self._prompt_text(tools, node), node.sampled_text, node.ids[node.n_spliced:])
        if full.startswith(rendered):
            return gap + full[len(rendered):], full, full[-_TAIL:]
        prefix = self.render(msgs[:pos], tools, False)
        if full.startswith(prefix):
            return gap + full[len(prefix):], full, full[-_TAIL:]
        if self.fallback == "anchor_diff":
            from miles.rollout.tokens.template_check import anchor_suffix

            return gap + anchor_suffix(self.tok, node.messages[-1], msgs[pos:], tools), full, full[-_TAIL:]
        at = _first_difference(prefix, full)
        raise NotAppendOnly(f"session {sid!r}: rendering the stored messages is not a prefix of rendering "
                            f"the request (first difference at character {at}: stored "
                            f"{prefix[at:at + 40]!r} vs request {full[at:at + 40]!r})")

    def _prompt_text(self, tools: Tools, node: Node) -> str:
        """The rendered prompt of `node`'s turn (kept from prepare, or rendered when not kept)."""
        if not node.prompt_text:
            node.prompt_text = self.render(node.all_messages()[:-1], tools, True)
        return node.prompt_text

    def _local_new_text(self, tools: Tools, node: Node, new: list[Message]) -> tuple[str, str] | None:
        """Fast path for templates verified local: render only the last turn plus the new messages."""
        if not node.sampled_text:
            return None
        if node.local_text is None:
            first = node.path()[0].messages[0]
            head = [first] if first["role"] == "system" and node.messages[0] is not first else []
            node.local_ctx = head + node.messages
            node.local_text = self.render(node.local_ctx, tools, False)
        a = node.local_text
        b = self.render(node.local_ctx + new, tools, True)
        idx = a.rfind(node.sampled_text)
        if not b.startswith(a) or idx < 0 or not a[:idx].endswith(node.gen_tail):
            return None
        return a[idx + len(node.sampled_text):] + b[len(a):], b[-_TAIL:]

    def _gap(self, rendered: str, prompt_text: str, sampled_text: str, sampled: list[int]) -> str:
        """Template text after the sampled tokens that belongs to this turn (e.g. '\\n')."""
        if rendered.startswith(prompt_text):
            block = rendered[len(prompt_text):]
            if block.startswith(sampled_text):
                return block[len(sampled_text):]
        else:
            block = rendered
        # The model's own wording differs from the template's (tool-call JSON spacing,
        # truncation): close the turn after the template's end-of-turn token.
        ended = bool(sampled) and sampled[-1] in self.tok.stop_token_ids
        for st in self.stop_texts:
            i = block.rfind(st) if st else -1
            if i >= 0:
                tail = block[i + len(st):]
                return tail if ended else st + tail
        return ""
