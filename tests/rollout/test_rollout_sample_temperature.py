"""A sample carries the temperature it was sampled at, from the session store to the wire."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.core.errors import ProtocolError, SessionError
from miles.rollout.tito.client import EngineOutput, LocalSessionClient
from miles.rollout.tito.store import SessionStore
from miles.rollout.types import Sample

from .tok_fixtures import seed_tokenizer

pytestmark = pytest.mark.timeout(60)
HELLO = [{"role": "user", "content": "Hello"}]


def _store(tmp_path: Path, **sampling: object) -> SessionStore:
    return SessionStore(seed_tokenizer(tmp_path), verify_template=False, sampling=dict(sampling))


async def _engine(ids: list[int], sampling: dict[str, object]) -> EngineOutput:
    return EngineOutput([103, 104], [-0.5, -0.25])


async def test_a_turn_override_wins_over_the_default_and_reaches_the_sample(tmp_path: Path) -> None:
    client = LocalSessionClient(_store(tmp_path, temperature=0.7), _engine)
    sid = await client.create_session()
    r = await client.chat(sid, HELLO)
    assert (await client.export(sid))[0].temperature == 0.7
    sid2 = await client.create_session()
    await client.chat(sid2, HELLO, sampling={"temperature": 1.3})
    [s] = await client.export(sid2)
    assert s.temperature == 1.3
    assert Sample.from_wire(s.to_wire()).temperature == 1.3  # and it crosses the wire
    # a later turn of the first session at another temperature is refused, naming both
    with pytest.raises(SessionError, match="temperature 0.7, this turn asks for 1.0"):
        await client.chat(sid, [*HELLO, r["message"], {"role": "user", "content": " Bye"}],
                          sampling={"temperature": 1.0})
    await client.chat(sid, [*HELLO, r["message"], {"role": "user", "content": " Bye"}])  # same: served


def test_one_turn_path_records_it_too(tmp_path: Path) -> None:
    store = _store(tmp_path, temperature=0.5)
    turn = store.prepare_one(HELLO, sampling={"temperature": 0.0})
    sample, _, _ = store.commit_one(turn, [103, 104], [-0.5, -0.25])
    assert sample.temperature == 0.0
    sample, _, _ = store.commit_one(store.prepare_one(HELLO), [103], [-0.5])
    assert sample.temperature == 0.5


@pytest.mark.parametrize("sampling", [{"top_p": 0.9}, {"top_k": 20}])
def test_truncated_sampling_is_refused_per_request(tmp_path: Path, sampling: dict[str, float]) -> None:
    store = _store(tmp_path)
    sid = store.create()
    with pytest.raises(SessionError, match="truncated sampling"):
        store.prepare_turn(sid, HELLO, sampling=sampling)
    with pytest.raises(SessionError, match="truncated sampling"):
        store.prepare_one(HELLO, sampling=sampling)
    store.prepare_turn(sid, HELLO, sampling={"top_p": 1.0, "top_k": -1})  # off: fine


def test_bad_temperatures_are_named(tmp_path: Path) -> None:
    store = _store(tmp_path)
    for bad in (-0.1, "hot", float("inf")):
        with pytest.raises(SessionError, match="temperature"):
            store.prepare_one(HELLO, sampling={"temperature": bad})
    with pytest.raises(ProtocolError, match="sample.temperature"):
        Sample(prompt_ids=[1], temperature=-1.0)
    with pytest.raises(ProtocolError, match="group.temperature|samples\\[0\\].temperature"):
        Sample.from_wire({"prompt_ids": [1], "temperature": "0.7"}, "group.samples[0]")
