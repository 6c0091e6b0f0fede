"""Launch validation with engine.type = "sglang": every example config either starts or is refused
at launch with the reason and the fix; the one pause option resolves per engine type; what SGLang
0.5.17 cannot run is refused before any process starts."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from miles.core.config import load_config
from miles.core.errors import ConfigError
from miles.core.schema import MilesConfig
from miles.launch.sglang_checks import sglang_launch_errors
from miles.launch.validate import validate_launch

pytestmark = pytest.mark.timeout(120)

EXAMPLES = Path(__file__).parents[2] / "examples"
HEAD_DIM_FIX = "model.overrides.head_dim"
# Every example's verdict with engine.type=sglang: "starts", or a piece of the refusal (reason + fix).
# A new example without an entry fails test_every_example_has_a_verdict.
VERDICTS: dict[str, str | tuple[str, ...]] = {
    "quickstart.toml": HEAD_DIM_FIX,
    "dataset.toml": HEAD_DIM_FIX,
    "distill_cpu.toml": HEAD_DIM_FIX,
    "quickstart_fp8.toml": "model.fp8 = 'blockwise' needs engine.type = 'torch'",  # refused at load, first
    "lora_cpu.toml": "trainer.lora.rank > 0 needs engine.type = 'torch'",
    "smollm2_rl_cpu.toml": "starts",  # SmolLM2-135M: head_dim 64 (or refused for its model.path when absent)
    "gsm8k.toml": "starts",  # SmolLM2-135M: head_dim 64, bf16 (refused for its model.path when absent)
    "agentic_calc.toml": "starts",  # the same checkpoint
    "gsm8k_qwen.toml": "starts",  # Qwen2.5-Coder-0.5B: head_dim 64 (refused for its model.path when absent)
    "vlm.toml": "a vision-language model is not available with engine.type=sglang",
    "vlm_multiturn.toml": "a vision-language model is not available with engine.type=sglang",
    "slurm/multinode.toml": "starts",  # Qwen3-30B-A3B: head_dim 128 (refused for its model.path when absent)
    # the tiny policy's head_dim; where the judge's checkpoint (/tmp/smollm2-hf) is absent, that first
    "judge_cpu.toml": (HEAD_DIM_FIX, "reward_model.path"),
    "learn_gate_cpu.toml": "trainer.lora.rank > 0 needs engine.type = 'torch'",
    "reasoning_gym_cpu.toml": "starts",  # SmolLM2-135M (refused for its model.path when absent)
    # The hub adapters' own packages are optional extras: where one is not installed (CI), the env is
    # refused first, naming the extra; where it is, the tiny policy's head_dim is.
    "openenv_cpu.toml": (HEAD_DIM_FIX, "pip install 'miles[openenv]'"),
    "verifiers_cpu.toml": (HEAD_DIM_FIX, "pip install 'miles[verifiers]'"),
}
# Refused while the config loads (core/schema/resolve.py), before launch looks for the checkpoint:
# their verdict holds whether or not model.path exists on this machine.
REFUSED_AT_LOAD = {"quickstart_fp8.toml", "lora_cpu.toml", "learn_gate_cpu.toml"}
# With the fix the refusal names, applied:
AFTER_FIX = {
    "quickstart.toml": "starts", "dataset.toml": "starts", "distill_cpu.toml": "starts",
    "quickstart_fp8.toml": "model.fp8 = 'blockwise' needs engine.type = 'torch'",
}


def _miles_examples() -> list[str]:
    out = []
    for f in sorted(EXAMPLES.rglob("*.toml")):
        top = tomllib.loads(f.read_text())
        if set(top) <= set(MilesConfig.__dataclass_fields__):  # examples/diffusion.toml is `miles diffusion`'s
            out.append(str(f.relative_to(EXAMPLES)))
    return out


# Data files an example names outside the repository (gsm8k.toml: GSM8K beside the checkout) are
# replaced by a few rows in the same format, written here: the verdict is about the example's
# engine and model settings, and a test reads nothing outside the repository.
GSM8K_ROWS = [{"question": "Ann has 3 apples and buys 4 more. How many now?",
               "answer": "She has 3+4=<<3+4=7>>7 apples.\n#### 7"},
              {"question": "A box holds 6 pens; 2 are taken. How many are left?",
               "answer": "6-2=<<6-2=4>>4 pens are left.\n#### 4"}]


@pytest.fixture(scope="module")
def data_sets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Per example, the --set lines that point its outside data at files made here."""
    d = tmp_path_factory.mktemp("gsm8k")
    for split in ("train", "test"):
        (d / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM8K_ROWS))
    rows = [f"rollout.env_args.path={d / 'train.jsonl'}", f"rollout.env_args.eval_path={d / 'test.jsonl'}"]
    return {"gsm8k.toml": rows, "gsm8k_qwen.toml": rows}


def verdict(name: str, *sets: str) -> str:
    try:
        validate_launch(load_config(MilesConfig, EXAMPLES / name, ["engine.type=sglang", *sets]))
    except ConfigError as exc:
        return str(exc)
    return "starts"


def test_every_example_has_a_verdict() -> None:
    assert sorted(_miles_examples()) == sorted(VERDICTS)


@pytest.mark.parametrize("name", sorted(VERDICTS))
def test_each_example_starts_or_is_refused_at_launch(name: str, data_sets: dict[str, list[str]]) -> None:
    sets = data_sets.get(name, [])
    got = verdict(name, *sets)
    path = tomllib.loads((EXAMPLES / name).read_text()).get("model", {}).get("path", "")
    if path and not (Path(path) / "config.json").is_file() and name not in REFUSED_AT_LOAD:
        assert f"model.path {path!r} has no config.json" in got  # refused here: the checkpoint is elsewhere
        return
    want = VERDICTS[name]
    if isinstance(want, tuple):  # any of these refusals
        assert any(w in got for w in want), got
        return
    assert got == "starts" if want == "starts" else want in got, got
    if name in AFTER_FIX:
        after = verdict(name, *sets, f"{HEAD_DIM_FIX}=64")
        want = AFTER_FIX[name]
        assert after == "starts" if want == "starts" else want in after, after


def test_head_dim_refusal_names_the_reason_and_the_fix() -> None:
    got = verdict("quickstart.toml")
    assert "head_dim=16" in got and "fallback_rotary_embedding" in got and HEAD_DIM_FIX in got


def cfg(*sets: str) -> MilesConfig:
    return load_config(MilesConfig, EXAMPLES / "quickstart.toml",
                       ["engine.type=sglang", "model.overrides.head_dim=64", *sets])


def test_one_pause_option_resolves_per_engine_type() -> None:
    assert cfg().sync.pause_mode == "retract" and cfg().engine.dtype == "bfloat16"
    torch_cfg = load_config(MilesConfig, EXAMPLES / "quickstart.toml")
    assert torch_cfg.sync.pause_mode == "in_place" and torch_cfg.engine.dtype == "float32"
    assert sglang_launch_errors(cfg()) == []
    for mode in ("in_place", "none"):
        errs = sglang_launch_errors(cfg(f"sync.pause_mode={mode}"))
        assert len(errs) == 1 and "sync.pause_mode=retract" in errs[0]
    assert sglang_launch_errors(cfg("sync.pause_mode=abort")) == []


def test_what_sglang_cannot_run_is_refused_with_the_fix() -> None:
    [e] = sglang_launch_errors(cfg("engine.dtype=float32"))
    assert "rmsnorm" in e and "engine.dtype=bfloat16" in e
    errs = sglang_launch_errors(cfg("engine.sglang_tp=3"))
    assert any("does not divide the model's 4 attention heads" in e for e in errs)
    assert any("2 KV heads: one must divide the other" in e for e in errs)
    assert sglang_launch_errors(cfg("engine.sglang_tp=4")) == []  # 4 heads split, 2 KV heads replicated
    [e] = sglang_launch_errors(cfg("engine.sglang_url=http://127.0.0.1:1", "engine.num_engines=2"))
    assert "every engine would drive the same server" in e
    with pytest.raises(ConfigError, match="trainer.pause_engines"):  # a config-only rule: at load
        cfg("trainer.pause_engines=true")


def test_two_engines_split_the_gpu_budget() -> None:
    two = cfg("engine.num_engines=2", "trainer.device=cuda")
    assert two.engine.sglang_mem_fraction == pytest.approx(0.225)  # 0.45 with the trainer, / 2 servers
    assert [two.engine.for_engine(i).sglang_port for i in (0, 1)] == [30000, 30001]
    alone = cfg("engine.num_engines=2", "trainer.device=cpu")
    assert alone.engine.sglang_mem_fraction == pytest.approx(0.425)
    [e] = sglang_launch_errors(cfg("engine.num_engines=2", "engine.sglang_mem_fraction=0.4", "trainer.device=cuda"))
    assert "together 0.80" in e and "at most 0.225" in e and "sglang_placement=spread" in e
    assert sglang_launch_errors(cfg("engine.num_engines=2", "engine.sglang_mem_fraction=0.4",
                                    "engine.sglang_placement=spread", "trainer.device=cuda")) == []


def test_resolved_config_carries_no_removed_key() -> None:
    from miles.core.config import from_dict, to_dict

    d = to_dict(cfg())
    assert "pause_mode" not in d["engine"] and d["sync"]["pause_mode"] == "retract"
    assert from_dict(MilesConfig, json.loads(json.dumps(d))).sync.pause_mode == "retract"  # what roles read
