"""Relative paths in a config file resolve against the file's folder, those given with --set
against the working directory; both are absolute after loading, so errors name the place tried."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.core.config import load_config
from miles.core.errors import ConfigError
from miles.core.schema import MilesConfig
from miles.launch.validate import validate_launch

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
DATASET = ROOT / "examples" / "dataset.toml"


def write(p: Path, text: str) -> Path:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_paths_in_a_file_start_at_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = write(tmp_path / "proj" / "conf" / "run.toml", """
[run]
dir = "../runs/a"
[model]
path = "~/ckpt"
[rollout.env_args]
path = "data/train.jsonl"
eval_path = "/abs/test.jsonl"
label_key = "data/not_a_path"
[trainer.distill]
teacher_checkpoint = "teacher"
""")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(MilesConfig, "proj/conf/run.toml")
    here = conf.parent
    assert cfg.run.dir == str(tmp_path / "proj" / "runs" / "a")
    assert cfg.model.path == str(Path("~/ckpt").expanduser())
    assert cfg.rollout.env_args["path"] == str(here / "data" / "train.jsonl")
    assert cfg.rollout.env_args["eval_path"] == "/abs/test.jsonl"
    assert cfg.rollout.env_args["label_key"] == "data/not_a_path"  # not a path key: as written
    assert cfg.trainer.distill.teacher_checkpoint == str(here / "teacher")


def test_set_paths_start_at_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "conf" / "run.toml", '[run]\ndir = "r"\n')
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    cfg = load_config(MilesConfig, tmp_path / "conf" / "run.toml",
                      ["run.dir=out", "rollout.env_args.train_file=d.jsonl", "sync.delta_dir=../x",
                       'rollout.env_args={path = "t.jsonl", seed = 3}'])
    assert cfg.run.dir == str(work / "out")
    assert cfg.sync.delta_dir == str(tmp_path / "x")
    assert cfg.rollout.env_args == {"path": str(work / "t.jsonl"), "seed": 3}
    # a relative default is from the working directory too; '' stays unset
    bare = load_config(MilesConfig, None, [])
    assert bare.run.dir == str(work / "runs" / "latest") and bare.model.path == ""


def test_dataset_example_validates_from_another_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(MilesConfig, DATASET)
    assert cfg.rollout.env_args["path"] == str(ROOT / "examples" / "data" / "word_problems.jsonl")
    assert cfg.run.dir == str(ROOT / "runs" / "dataset")
    validate_launch(cfg)  # builds the env: reads the data file


def test_a_missing_data_file_is_named_by_its_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "c" / "run.toml", '[rollout]\nenv = "miles.rollout.envs.dataset:make_env"\n'
                                       '[rollout.env_args]\npath = "nope.jsonl"\n')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=str(tmp_path / "c" / "nope.jsonl")):
        validate_launch(load_config(MilesConfig, "c/run.toml"))


def test_miles_config_from_another_directory_prints_absolute_paths(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "miles.launch.cli", "config", str(DATASET), "--set", "run.dir=mine"],
                       capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    data = str(ROOT / "examples" / "data" / "word_problems.jsonl")
    assert json.dumps(data) in p.stdout and f'dir = {json.dumps(str(tmp_path / "mine"))}' in p.stdout
