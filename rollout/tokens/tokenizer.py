"""The tokenizer contract of the rollout side and its implementation over `tokenizers`.

`load_tokenizer(model_dir)` reads a Hugging Face model directory
(tokenizer.json + tokenizer_config.json, whose `chat_template` is rendered with
Jinja); transformers is not needed at run time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tokenizers import Tokenizer as _HFTok

from miles.core.errors import ConfigError
from miles.rollout.tokens.chat_template import ChatTemplate


@runtime_checkable
class Tokenizer(Protocol):
    """What the session store, verifier and environments need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_id(self) -> int | None: ...
    @property
    def pad_token_id(self) -> int | None: ...
    @property
    def stop_token_ids(self) -> list[int]: ...

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...
    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = False) -> str: ...


def _token_str(v: Any) -> str | None:
    """tokenizer_config tokens are either a string or an AddedToken dict with 'content'."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


class HFTokenizer:
    """`tokenizers.Tokenizer` + a Jinja chat template, as read from a model directory."""

    def __init__(self, tok: _HFTok, chat_template: str, eos_token: str | None = None,
                 pad_token: str | None = None, bos_token: str | None = None,
                 extra_stop_tokens: list[str] | None = None, name: str = "") -> None:
        self._tok = tok
        self.name = name
        self.template = ChatTemplate(chat_template, {"bos_token": bos_token or "", "eos_token": eos_token or ""})
        self._eos = self._id_of(eos_token, "eos_token")
        self._pad = self._id_of(pad_token, "pad_token")
        stops = [self._eos] if self._eos is not None else []
        for t in extra_stop_tokens or []:
            i = self._id_of(t, "stop token")
            if i is not None and i not in stops:
                stops.append(i)
        self._stops = stops
        self._special_ids = {
            int(i) for i, t in tok.get_added_tokens_decoder().items() if t.special
        }

    def _id_of(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        i = self._tok.token_to_id(token)
        if i is None:
            raise ConfigError(f"tokenizer {self.name!r}: {what} {token!r} is not in the vocabulary")
        return i

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def pad_token_id(self) -> int | None:
        return self._pad

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self._stops)

    @property
    def special_token_ids(self) -> set[int]:
        return set(self._special_ids)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = False) -> str:
        return self.template.render(messages, tools, add_generation_prompt)


def load_tokenizer(model_dir: str | Path, chat_template: str | None = None) -> HFTokenizer:
    """Read tokenizer.json + tokenizer_config.json (+ chat_template.jinja if present)."""
    d = Path(model_dir)
    tj = d / "tokenizer.json"
    if not tj.is_file():
        raise ConfigError(f"{str(d)!r} has no tokenizer.json (a fast tokenizer file is required)")
    cfg: dict[str, Any] = {}
    cj = d / "tokenizer_config.json"
    if cj.is_file():
        try:
            cfg = json.loads(cj.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{str(cj)!r} is not valid JSON: {exc}") from exc
    template = chat_template
    if template is None:
        jinja_file = d / "chat_template.jinja"
        raw = cfg.get("chat_template")
        if jinja_file.is_file():
            template = jinja_file.read_text()
        elif isinstance(raw, str):
            template = raw
        elif isinstance(raw, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
            template = named.get("default")
    if not isinstance(template, str):
        raise ConfigError(f"{str(d)!r}: no chat template (tokenizer_config.json 'chat_template' or chat_template.jinja)")
    try:
        tok = _HFTok.from_file(str(tj))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception on bad files
        raise ConfigError(f"{str(tj)!r} cannot be loaded by `tokenizers`: {exc}") from exc
    extra = [t for t in cfg.get("miles_stop_tokens", []) if isinstance(t, str)]
    gen = d / "generation_config.json"
    if gen.is_file():
        # generation_config's eos_token_id (int or list) names further stop tokens
        try:
            ids = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{str(gen)!r} is not valid JSON: {exc}") from exc
        for i in ids if isinstance(ids, list) else [ids] if isinstance(ids, int) else []:
            t = tok.id_to_token(int(i))
            if t is not None:
                extra.append(t)
    return HFTokenizer(
        tok, template,
        eos_token=_token_str(cfg.get("eos_token")),
        pad_token=_token_str(cfg.get("pad_token")),
        bos_token=_token_str(cfg.get("bos_token")),
        extra_stop_tokens=extra,
        name=str(d),
    )
