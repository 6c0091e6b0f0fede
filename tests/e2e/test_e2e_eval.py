"""The three evaluation modes in a real run: shared, snapshot (own engine) and external (a command)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .e2e_helpers import metrics, start_run, wait

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.mark.parametrize("mode", ["shared", "snapshot", "external"])
def test_eval_mode_reports_metrics(tmp_path: Path, mode: str, miles_cache: Path) -> None:
    run = tmp_path / "run"
    script = tmp_path / "judge.py"
    # A real external evaluator: it reads the exported checkpoint's config and reports a number.
    script.write_text("import json, pathlib, sys\n"
                      "cfg = json.loads((pathlib.Path(sys.argv[1]) / 'config.json').read_text())\n"
                      "print(json.dumps({'layers': cfg['num_hidden_layers']}))\n")
    p = start_run(run, miles_cache, "--set", "run.steps=4", "--set", f"eval.mode={mode}",
                  "--set", "eval.every_steps=2", "--set", "eval.num_prompts=8",
                  "--set", f"eval.command={sys.executable} {script} {{checkpoint}}")
    assert wait(p, 280) == 0, (tmp_path / "run.launcher.log").read_text()[-3000:]
    evals = [json.loads(ln) for ln in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [2, 4]
    for e in evals:
        assert "eval/failed" not in e and e["eval/lag_steps"] >= 0
        if mode == "external":
            assert e["eval/external/layers"] > 0 and e["eval/external_exit_code"] == 0
        else:
            assert 0.0 <= e["eval/reward_mean"] <= 1.0 and e["eval/num_prompts"] == 8
    assert all("eval/skipped" in r for r in metrics(run))
