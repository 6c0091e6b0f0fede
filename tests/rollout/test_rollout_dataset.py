"""The dataset env: rows, per-epoch shuffles, resume, splits, bad lines, and `miles data check`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from miles.core.errors import ConfigError
from miles.launch.cli import main
from miles.rollout.envs.dataset import DataError, make_env
from miles.rollout.types import Sample


def _write(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return _write(tmp_path / "d.jsonl", [{"q": f"{i}+1=", "a": str(i + 1)} for i in range(10)])


def _env(path: Path, **kw: Any) -> Any:
    return make_env(path=str(path), prompt_key="q", label_key="a", **kw)


def test_rows_become_prompts_rewarded_by_the_label(data: Path) -> None:
    env = _env(data, shuffle=False, system_prompt="Be brief.", prompt_template="Q: {prompt}")
    p = env.prompts.next()
    assert p["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q: 0+1="}]
    assert p["label"] == p["answer"] == "1" and p["row"] == "d-1" and p["index"] == 0
    assert env.reward(p, Sample(prompt_ids=[1], metadata={"response": "\\boxed{1}"})) == 1.0
    assert env.reward(p, Sample(prompt_ids=[1], metadata={"response": "2"})) == 0.0


def test_chat_message_prompts_and_ids(tmp_path: Path) -> None:
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    f = _write(tmp_path / "c.jsonl", [{"id": "x7", "messages": msgs, "answer": "A"}])
    env = make_env(path=str(f), prompt_key="messages", id_key="id", system_prompt="other",
                   rewards=[{"type": "exact"}])
    p = env.prompts.item(0)
    assert p["messages"] == msgs and p["row"] == "x7"  # an existing system message is kept


def test_each_epoch_is_a_fresh_seeded_permutation(data: Path) -> None:
    env = _env(data, seed=3)
    seq = [env.prompts.next()["row"] for _ in range(30)]
    epochs = [seq[0:10], seq[10:20], seq[20:30]]
    assert all(sorted(e) == sorted(f"d-{i}" for i in range(1, 11)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3
    assert [_env(data, seed=3).prompts.item(i)["row"] for i in range(30)] == seq
    assert [_env(data, seed=4).prompts.item(i)["row"] for i in range(10)] != epochs[0]
    assert [_env(data, shuffle=False).prompts.item(i)["row"] for i in range(10)] == [f"d-{i}" for i in range(1, 11)]


def test_resume_continues_at_the_saved_position(data: Path) -> None:
    a = _env(data, seed=1)
    for _ in range(13):
        a.prompts.next()
    state = json.loads(json.dumps(a.prompts.state()))  # what a checkpoint keeps
    expected = [a.prompts.next() for _ in range(12)]
    b = _env(data, seed=1)
    b.prompts.load_state(state)
    assert [b.prompts.next() for _ in range(12)] == expected
    with pytest.raises(ConfigError, match="seed"):
        _env(data, seed=2).prompts.load_state(state)
    shorter = _write(data.with_name("short.jsonl"), [{"q": "x", "a": "1"}] * 9)
    with pytest.raises(ConfigError, match="over 10 rows, the data now has 9"):
        _env(shorter, seed=1).prompts.load_state(state)


def test_train_eval_split_is_disjoint_and_independent_of_the_shuffle_seed(data: Path, tmp_path: Path) -> None:
    train = {p.id for p in _env(data, eval_fraction=0.3).prompts.rows}
    held = [p.id for p in _env(data, eval_fraction=0.3, split="eval", seed=99).prompts.rows]
    assert len(held) == 3 and len(train) == 7 and not train & set(held)
    ev = _env(data, eval_fraction=0.3, split="eval", seed=5).prompts
    assert [ev.item(i)["row"] for i in range(3)] == held  # eval is served in file order
    assert [p.id for p in _env(data, eval_fraction=0.3, split_seed=1, split="eval").prompts.rows] != held
    other = _write(tmp_path / "ev.jsonl", [{"q": "e", "a": "0"}])
    assert [p.id for p in _env(data, eval_path=str(other), split="eval").prompts.rows] == ["ev-1"]
    assert len(_env(data, eval_path=str(other)).prompts.rows) == 10


@pytest.mark.parametrize(("row", "kw", "error"), [
    ('{"q": "1+1=", "a": }', {}, "not valid JSON"),
    ("[1, 2]", {}, "expected a JSON object, got list"),
    ({"question": "x", "a": "1"}, {}, "missing the prompt field 'q' (fields: question, a)"),
    ({"q": "x"}, {}, "missing the label field 'a'"),
    ({"q": "  ", "a": "1"}, {}, "empty prompt in 'q'"),
    ({"q": 5, "a": "1"}, {}, "'q' must be a string or a list of messages, got int"),
    ({"q": [{"role": "bot", "content": "x"}], "a": "1"}, {}, "'q' message 0 has role 'bot'"),
    ({"q": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "a": "1"}, {},
     "'q': the last message is the assistant's"),
    ({"q": "x", "a": "\\frac{"}, {}, "cannot be parsed as a math answer"),
    ({"q": "x", "a": "forty"}, {}, "math: label 'forty' is a word, not a math answer"),  # docs/datasets.md
    ({"q": "x", "a": "E"}, {"rewards": [{"type": "multiple_choice"}], "good": "B"}, "not one of the letters 'ABCD'"),
    ({"q": "x", "a": "assert f(1) =="}, {"rewards": [{"type": "code_tests", "network": "allow"}]},
     "does not compile"),
])
def test_a_bad_line_is_named_with_what_is_wrong(tmp_path: Path, row: Any, kw: dict[str, Any], error: str) -> None:
    good = kw.pop("good", "1")
    f = _write(tmp_path / "bad.jsonl", [{"q": "ok", "a": good}, "", row, {"q": "ok", "a": good}])
    with pytest.raises(DataError) as exc:
        _env(f, **kw)
    msg = str(exc.value)
    assert "bad.jsonl:3: " in msg and error in msg.split("bad.jsonl:3: ", 1)[1]


def test_bad_settings_are_config_errors(data: Path) -> None:
    with pytest.raises(ConfigError, match="unknown config key 'lable_key'"):
        make_env(path=str(data), lable_key="a")
    with pytest.raises(ConfigError, match="unknown reward type 'maths'; valid: code_tests, exact"):
        _env(data, rewards=[{"type": "maths"}])
    with pytest.raises(ConfigError, match=r"rewards\[1\] \(type 'format'\): unknown config key 'patern'"):
        _env(data, rewards=[{"type": "math"}, {"type": "format", "patern": "x"}])
    with pytest.raises(ConfigError, match="does not exist"):
        make_env(path=str(data) + ".missing")
    with pytest.raises(ConfigError, match="eval_fraction must be in"):
        _env(data, eval_fraction=1.0)


def test_parquet_rows_or_a_clear_install_hint(tmp_path: Path) -> None:
    f = tmp_path / "d.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        f.write_bytes(b"PAR1")
        with pytest.raises(ConfigError, match=r"pip install 'miles\[parquet\]'"):
            make_env(path=str(f))
        return
    pq.write_table(pa.table({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}), f)
    assert [p.line for p in make_env(path=str(f)).prompts.rows] == [1, 2]


def test_data_check_command(data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[rollout]\nenv = "miles.rollout.envs.dataset:make_env"\n'
                   '[rollout.env_args]\npath = "elsewhere.jsonl"\nprompt_key = "q"\nlabel_key = "a"\n'
                   'eval_fraction = 0.2\n')
    assert main(["data", "check", str(data), "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "10 rows OK (10 text, 0 chat)" in out and "8 train / 2 eval" in out
    bad = _write(tmp_path / "b.jsonl", [{"q": "x", "a": "1"}, {"q": "y"}, "{", {"q": "z"}])
    assert main(["data", "check", str(bad), "--config", str(cfg)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{bad}:2: missing the label field 'a'") and "3 bad row(s) of 4" in out
    assert f"{bad}:3: not valid JSON" in out
    # without a config: the env's defaults (prompt_key "prompt"), overridable with --set
    assert main(["data", "check", str(data)]) == 1
    assert "missing the prompt field 'prompt'" in capsys.readouterr().out
    assert main(["data", "check", str(data), "--set", "rollout.env_args.prompt_key=q",
                 "--set", "rollout.env_args.label_key=a"]) == 0
    other = tmp_path / "o.toml"
    other.write_text('[rollout]\nenv = "miles.rollout.envs.arithmetic:make_env"\n')
    assert main(["data", "check", str(data), "--config", str(other)]) == 2
    assert "not the dataset env" in capsys.readouterr().err


def test_the_shipped_example_is_the_generator_output_and_checks_clean(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "wp.jsonl"
    subprocess.run([sys.executable, str(root / "examples/data/make_word_problems.py"), "--out", str(out)],
                   check=True, capture_output=True, timeout=60)
    shipped = root / "examples/data/word_problems.jsonl"
    assert out.read_text() == shipped.read_text()
    assert main(["data", "check", str(shipped), "--config", str(root / "examples/dataset.toml")]) == 0
    assert "400 rows OK" in capsys.readouterr().out
