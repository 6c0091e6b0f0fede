"""Load on the session server: N concurrent multi-turn OpenAI clients against a real engine.

For each N (default 1, 4, 16, 64, 256) N clients run at once, each a session of
`--turns` chat turns (the whole history every turn, as an OpenAI client sends it)
through the HTTP front -> session store -> request routing -> TorchEngine (tiny random model,
`--max-tokens` tokens a turn), all in this process on CPU. Reported per N: p50/p99
turn latency (client side, request to full reply), turns/s, errors, the process's
RSS growth, and the bookkeeping check: every session's stored turn count equals the
turns its client made, and its exported sample holds exactly the completion tokens
the client was told about (no turn lost, none duplicated). End to end for the front
and the store, but the engine is a toy: numbers are not an LLM serving benchmark.
Last line: one JSON object.

    python bench/session_load.py --out bench/results/session_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from miles.bench.http_fuzz import start_front


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def _client(http: aiohttp.ClientSession, url: str, c: int, turns: int, max_tokens: int,
                  lat: list[float]) -> dict[str, Any]:
    async with http.post(f"{url}/sessions") as r:
        sid = (await r.json())["session_id"]
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You add numbers."}]
    completion = 0
    done = 0
    errors: list[str] = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"What is {c % 97}+{t}?"})
        body = {"model": "policy", "messages": msgs, "max_tokens": max_tokens}
        t0 = time.perf_counter()
        async with http.post(f"{url}/sessions/{sid}/v1/chat/completions", json=body) as r:
            d = await r.json()
            status = r.status
        lat.append(time.perf_counter() - t0)
        if status != 200:
            errors.append(f"client {c} turn {t}: {status} {d}")
            break
        done += 1
        completion += int(d["usage"]["completion_tokens"])
        msgs.append({k: v for k, v in d["choices"][0]["message"].items() if v is not None})
    async with http.get(f"{url}/sessions/{sid}") as r:
        info = await r.json()
    async with http.post(f"{url}/sessions/{sid}/samples") as r:
        samples = (await r.json())["samples"]
    sampled = sum(sum(s["loss_mask"]) for s in samples)
    if info["turns"] != done:
        errors.append(f"client {c}: made {done} turns, the store holds {info['turns']}")
    if sampled != completion:
        errors.append(f"client {c}: told {completion} completion tokens, the sample holds {sampled}")
    async with http.delete(f"{url}/sessions/{sid}") as r:
        if r.status != 200:
            errors.append(f"client {c}: close answered {r.status}")
    return {"turns": done, "errors": errors}


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


async def run_load(url: str, n: int, turns: int, max_tokens: int) -> dict[str, Any]:
    lat: list[float] = []
    rss0 = _rss_mib()
    conn = aiohttp.TCPConnector(limit=n + 4)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as http:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(_client(http, url, c, turns, max_tokens, lat) for c in range(n)))
        secs = time.perf_counter() - t0
    errors = [e for o in outs for e in o["errors"]]
    made = sum(o["turns"] for o in outs)
    return {"clients": n, "turns": made, "expected_turns": n * turns, "seconds": round(secs, 2),
            "turns_per_s": round(made / secs, 1), "p50_ms": round(_pct(lat, 0.5) * 1e3, 1),
            "p99_ms": round(_pct(lat, 0.99) * 1e3, 1), "max_ms": round(max(lat) * 1e3, 1) if lat else 0.0,
            "rss_growth_mib": round(_rss_mib() - rss0, 1), "errors": len(errors), "first_errors": errors[:5]}


async def _main(a: argparse.Namespace, tmp: str) -> dict[str, Any]:
    front = await start_front(Path(tmp))
    rows = []
    try:
        for n in a.clients:
            rows.append(await run_load(front.url, n, a.turns, a.max_tokens))
            r = rows[-1]
            print(f"{r['clients']:>7} {r['turns']:>6} {r['turns_per_s']:>8} {r['p50_ms']:>8} {r['p99_ms']:>8} "
                  f"{r['rss_growth_mib']:>8} {r['errors']:>6}", flush=True)
    finally:
        await front.stop()
    return {"bench": "session_load", "engine": "TorchEngine, tiny random qwen3, CPU, same process",
            "turns_per_client": a.turns, "max_tokens": a.max_tokens, "rows": rows,
            "total_errors": sum(r["errors"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    print(f"{'clients':>7} {'turns':>6} {'turns/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'RSS+MiB':>8} {'errors':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        res = asyncio.run(_main(a, tmp))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
