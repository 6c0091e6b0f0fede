"""Named rule rewards and the code sandbox's limits (real subprocesses, real sockets)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from miles.core.errors import ConfigError
from miles.rollout.rewards.code_tests import CodeTestsReward, extract_code
from miles.rollout.rewards.rules import (
    RULE_REWARDS,
    MathReward,
    build_rewards,
    extract_answer,
    extract_boxed,
    extract_hash,
)
from miles.rollout.rewards.sandbox import SandboxLimits, network_isolation_available, run_python
from miles.rollout.types import Sample


def score(spec: dict[str, Any], label: Any, text: str) -> float:
    r = build_rewards([spec])({"label": label}, Sample(prompt_ids=[1], metadata={"response": text}))
    return float(asyncio.run(r) if asyncio.iscoroutine(r) else r)  # type: ignore[arg-type]


def test_answer_extraction() -> None:
    assert extract_boxed(r"so \boxed{\frac{1}{2}} and \boxed{x^{2}}") == "x^{2}"
    assert extract_boxed(r"\boxed{12") is None and extract_boxed("12") is None
    assert extract_hash("Tom has 3.\n#### 1,234\nextra") == "1,234" and extract_hash("no") is None
    assert extract_answer(r"#### 3 then \boxed{4}") == "4" and extract_answer(" 5 ") == "5"
    assert extract_answer("5", "boxed") is None and extract_answer(" 5 ", "none") == "5"


@pytest.mark.parametrize(("label", "text", "want"), [
    ("42", "42", 1.0),
    ("42", "The answer is \\boxed{42}.", 1.0),
    ("42", "41", 0.0),
    ("1234", "#### 1,234", 1.0),
    ("She sold 6 + 6 = 12 #### 12", "\\boxed{12}", 1.0),  # a GSM8K-style label
    ("0.5", "\\boxed{\\frac{1}{2}}", 1.0),
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
    ("x+1", "\\boxed{1+x}", 1.0),
    ("x+1", "\\boxed{x+2}", 0.0),
    ("\\sqrt{2}", "\\boxed{\\sqrt 2}", 1.0),
    ("3", "", 0.0),
])
def test_math_reward(label: str, text: str, want: float) -> None:
    assert score({"type": "math"}, label, text) == want


@pytest.mark.parametrize(("extract", "text", "want"), [
    ("hash", "6 + 6 = 12\n#### 12", 1.0),
    ("hash", "The answer is \\boxed{12}.", 0.0),  # right number, not in the asked format
    ("hash", "so 12", 0.0),
    ("hash", "#### 13", 0.0),
    ("boxed", "\\boxed{12}", 1.0),
    ("boxed", "#### 12", 0.0),
    ("none", "12", 1.0),
    ("auto", "so 12", 1.0),
])
def test_math_reward_extract_asks_for_the_format(extract: str, text: str, want: float) -> None:
    assert score({"type": "math", "extract": extract}, "6 + 6 = 12 #### 12", text) == want


def test_exact_and_normalized_match() -> None:
    assert score({"type": "exact"}, "Paris", " Paris ") == 1.0
    assert score({"type": "exact"}, "Paris", "paris") == 0.0
    assert score({"type": "exact"}, "Paris", "it is \\boxed{Paris}") == 1.0
    assert score({"type": "exact", "extract": "none"}, "Paris", "it is \\boxed{Paris}") == 0.0
    assert score({"type": "normalized"}, "The Eiffel Tower", "eiffel tower!") == 1.0
    assert score({"type": "normalized"}, "The Eiffel Tower", "a tower") == 0.0


@pytest.mark.parametrize(("label", "text", "want"), [
    ("B", "B", 1.0),
    ("(B)", "The answer is (b).", 1.0),
    (1, "Answer: B", 1.0),
    ("B", "\\boxed{C}", 0.0),
    ("B", "A seems wrong; I pick B", 1.0),
    ("C", "I think so", 0.0),
])
def test_multiple_choice(label: Any, text: str, want: float) -> None:
    assert score({"type": "multiple_choice"}, label, text) == want


def test_format_reward_and_weighted_sum() -> None:
    assert score({"type": "format"}, None, "thus \\boxed{3}") == 1.0
    assert score({"type": "format"}, None, "3") == 0.0
    assert score({"type": "format", "pattern": r"-?\d+", "match": "fullmatch"}, None, "-3") == 1.0
    assert score({"type": "format", "pattern": r"-?\d+", "match": "fullmatch"}, None, "x-3") == 0.0
    both = build_rewards([{"type": "math"}, {"type": "format", "weight": 0.25}])
    s = Sample(prompt_ids=[1], metadata={"response": "\\boxed{7}"})
    assert both({"label": "7"}, s) == 1.25 and both({"label": "8"}, s) == 0.25
    assert both.needs_label and not build_rewards([{"type": "format"}]).needs_label


def test_reward_specs_are_checked() -> None:
    assert RULE_REWARDS.names() == ["code_tests", "exact", "format", "math", "multiple_choice", "normalized"]
    with pytest.raises(ConfigError, match="needs a `type`"):
        build_rewards([{"weight": 1.0}])
    with pytest.raises(ConfigError, match="list at least one reward"):
        build_rewards([])
    with pytest.raises(ConfigError, match="not a valid regex"):
        build_rewards([{"type": "format", "pattern": "("}])
    with pytest.raises(ConfigError, match=r"weight: expected a number"):
        build_rewards([{"type": "math", "weight": "high"}])


def test_code_tests_reward_with_asserts_and_stdin_cases() -> None:
    spec = {"type": "code_tests", "network": "allow", "timeout_s": 10.0}
    prog = "Here:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    assert extract_code(prog).startswith("def add") and extract_code("x = 1") == "x = 1"
    assert score(spec, "assert add(2, 3) == 5", prog) == 1.0
    assert score(spec, "assert add(2, 3) == 6", prog) == 0.0
    cases = [{"input": "2 3\n", "output": "5"}, {"input": "1 1\n", "output": "3"}]
    echo = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert score(spec, cases, echo) == 0.5
    assert score({**spec, "timeout_s": 1.0}, cases, "```python\nwhile True: pass\n```") == 0.0
    r = CodeTestsReward(network="allow")
    assert r.check_label([{"input": "1"}]) and r.check_label("") and r.check_label(cases) is None


def test_sandbox_kills_at_the_time_limit() -> None:
    lim = SandboxLimits(timeout_s=1.0, network="allow")
    r = asyncio.run(run_python("import time\nprint('started', flush=True)\ntime.sleep(60)", limits=lim))
    assert r.timed_out and r.returncode is None and not r.ok and r.stdout == "started\n"
    ok = asyncio.run(run_python("print(input()[::-1])", "abc\n", lim))
    assert ok.ok and ok.stdout == "cba\n"


def test_sandbox_memory_and_output_limits() -> None:
    lim = SandboxLimits(timeout_s=20.0, memory_mib=128, max_output_bytes=1000, network="allow")
    big = asyncio.run(run_python("x = bytearray(512 << 20)\nprint('allocated')", limits=lim))
    assert big.returncode != 0 and "MemoryError" in big.stderr and "allocated" not in big.stdout
    small = asyncio.run(run_python("x = bytearray(16 << 20)\nprint('allocated')", limits=lim))
    assert small.ok and small.stdout == "allocated\n"
    loud = asyncio.run(run_python("print('x' * 5000)", limits=lim))
    assert not loud.ok and len(loud.stdout) <= 1000


@pytest.mark.skipif(not network_isolation_available(),
                    reason="no `unshare -rn` (unprivileged user namespaces) on this machine")
def test_sandbox_has_no_network() -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    code = (f"import socket\ns = socket.socket()\ns.settimeout(5)\n"
            f"print(s.connect_ex(('127.0.0.1', {port})))")
    try:
        allowed = asyncio.run(run_python(code, limits=SandboxLimits(timeout_s=20.0, network="allow")))
        denied = asyncio.run(run_python(code, limits=SandboxLimits(timeout_s=20.0, network="deny")))
    finally:
        srv.close()
    assert allowed.ok and allowed.stdout.strip() == "0"  # the same code reaches the listener outside
    assert denied.ok and denied.network_isolated and denied.stdout.strip() != "0"


def test_math_labels_in_words_are_refused_and_expressions_kept() -> None:
    r = MathReward()
    for word in ("forty", "Forty two", "twenty-one", "yes"):
        assert "is a word, not a math answer" in (r.check_label(word) or ""), word
    for ok in ("40", "x", "2x", "a+b", "\\frac{1}{2}", "pi", "\\infty", "#### 72"):
        assert r.check_label(ok) is None, ok
