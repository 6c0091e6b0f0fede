"""Session throughput: turns/s through the TITO session store (tokenize suffix + append + export).

Each measurement is a function returning a row; the lead's HTTP measurement
(`http_turns_per_s`) plugs into MEASUREMENTS the same way. Baseline in the same
run: re-rendering and re-tokenizing the whole conversation every turn, which is
what a server without checkpoints would do. `prefix_hit_rate` comes from the
router's multi-turn workload over SIMULATED engine prefix caches
(miles.rollout.prefix_cache_sim). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from typing import Any

from miles.rollout.prefix_cache_sim import simulate_multi_turn
from miles.rollout.session_store import SessionStore
from miles.rollout.tiny_tokenizer import tiny_tokenizer
from miles.rollout.tokenizer import HFTokenizer

SYSTEM = {"role": "system", "content": "You are a calculator. Answer with the number only."}


def _replies(tok: HFTokenizer, turns: int) -> list[list[int]]:
    end = tok.token_to_id("<|im_end|>")
    return [tok.encode(f"The answer is {t * 7 + 3}.") + [end] for t in range(turns)]


def store_turns(tok: HFTokenizer, sessions: int, turns: int) -> dict[str, Any]:
    """Full TITO path: prepare (match + render + encode suffix), commit (store ids), export."""
    store = SessionStore(tok)
    replies = _replies(tok, turns)
    lps = [[-0.1] * len(r) for r in replies]
    t0 = time.perf_counter()
    for s in range(sessions):
        sid = store.create()
        msgs: list[dict[str, Any]] = [SYSTEM]
        for t in range(turns):
            msgs.append({"role": "user", "content": f"What is {s % 97}+{t}?"})
            plan = store.prepare_turn(sid, msgs)
            res = store.commit_turn(sid, plan, replies[t], lps[t], versions=1)
            msgs.append(res.message)
        (sample,) = store.export(sid)
        assert sample.num_sampled == sum(len(r) for r in replies)
        store.close(sid)
    dt = time.perf_counter() - t0
    return {"name": "store (TITO)", "turns": sessions * turns, "seconds": dt,
            "turns_per_s": sessions * turns / dt}


def retokenize_turns(tok: HFTokenizer, sessions: int, turns: int) -> dict[str, Any]:
    """Baseline: render and tokenize the whole conversation every turn (no checkpoints)."""
    replies = [tok.decode(r) for r in _replies(tok, turns)]
    t0 = time.perf_counter()
    for s in range(sessions):
        msgs: list[dict[str, Any]] = [SYSTEM]
        for t in range(turns):
            msgs.append({"role": "user", "content": f"What is {s % 97}+{t}?"})
            ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))
            msgs.append({"role": "assistant", "content": replies[t]})
            assert ids
        tok.encode(tok.apply_chat_template(msgs))
    dt = time.perf_counter() - t0
    return {"name": "baseline: re-tokenize whole", "turns": sessions * turns, "seconds": dt,
            "turns_per_s": sessions * turns / dt}


MEASUREMENTS: list[Callable[[HFTokenizer, int, int], dict[str, Any]]] = [store_turns, retokenize_turns]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sessions", type=int, default=400)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5, help="best of N per measurement (shared CPUs are noisy)")
    args = ap.parse_args()
    tok = tiny_tokenizer(tempfile.mkdtemp(prefix="miles-bench-tok-"))
    store_turns(tok, 20, args.turns)  # warm-up (template compile, caches)
    runs: list[list[dict[str, Any]]] = [[] for _ in MEASUREMENTS]
    for _ in range(args.repeats):  # interleaved, so both sides see the same machine load
        for i, m in enumerate(MEASUREMENTS):
            runs[i].append(m(tok, args.sessions, args.turns))
    rows = [max(r, key=lambda x: x["turns_per_s"]) for r in runs]
    hit_aff = simulate_multi_turn(engines=4, affinity=True).prefix_hit_rate
    hit_none = simulate_multi_turn(engines=4, affinity=False).prefix_hit_rate
    print(f"{args.sessions} sessions x {args.turns} turns, best of {args.repeats}")
    print(f"{'measurement':32} {'turns':>8} {'seconds':>9} {'turns/s':>10}")
    for r in rows:
        print(f"{r['name']:32} {r['turns']:>8} {r['seconds']:>9.3f} {r['turns_per_s']:>10.0f}")
    print(f"prefix hit rate (SIMULATED caches, 4 engines): affinity {hit_aff:.4f}, no affinity {hit_none:.4f}")
    result = {
        "store_turns_per_s": round(rows[0]["turns_per_s"], 1),
        "baseline_retokenize_turns_per_s": round(rows[1]["turns_per_s"], 1),
        "store_vs_retokenize": round(rows[0]["turns_per_s"] / rows[1]["turns_per_s"], 3),
        "prefix_hit_rate": round(hit_aff, 4),
        "prefix_hit_rate_no_affinity": round(hit_none, 4),
        "prefix_hit_rate_source": "simulation",
        "goal_store_turns_per_s": 10000,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
