"""HTTP fuzz of the session server's OpenAI front: every malformed request must get a clear 4xx.

The chat route, and (since issue 47) the token-level routes: `/sessions/{id}/v1/generate`
(token ids in), `/v1/tokenize`, and chat completions asking for `logprobs` / `top_logprobs`.

Sends N requests (default 10,000) built from a seeded generator of malformed bodies
(deep nesting, lone surrogates, wrong types for every field, huge bodies, undecodable
Content-Encoding, absurd sampling values, unknown session ids, cancelled requests,
prompts longer than the engine's max_seq_len, truncated sampling, sessions created with
odd ids, tools or metadata) mixed with well-formed ones, to a real front over a real
engine (tiny random model). Counts statuses; any 5xx, any 4xx without a JSON error
message, a session the front created but cannot reach at the base_url it returned, or a
server that stops answering /health is a failure. Last line: one JSON object.

    python bench/http_fuzz.py --n 10000 --out bench/results/http_fuzz.json
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import random
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:
    from miles.bench.session_front import SessionFront

USER = {"role": "user", "content": "hi"}
WEIRD: list[Any] = [None, True, 0, -1, 1e308, -1e308, 1e-300, "", "x", [], {}, [[]], {"a": {}},
                    "\u0000", "😀", 2**70, -(2**70)]
FIELDS = ["temperature", "top_p", "max_tokens", "max_completion_tokens", "top_k", "seed", "stop_token_ids",
          "stream", "stream_options", "model", "tools", "tool_choice", "n", "stop", "logprobs",
          "response_format"]


def _nest(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# Session ids a client may ask for at create (each gets a unique suffix): URL-safe ones must be
# reachable at the returned base_url, the others refused at create.
IDS = ["a/b", "..", ".", "a b", "a?b", "a#b", "%2F", "\u00fc", "x" * 200, "ok-id_1.2~", "A9", "-a", "a%20b",
       "a\\b", "\t", "a:b", "a;b", "a&b=c", "_x", "~y", "z.", "q..r"]


def case(rng: random.Random, i: int = 0) -> tuple[str, dict[str, str], bytes, bool]:
    """(kind, extra headers, raw body, expect_ok): one request body for the chat route; the
    create kinds carry the session-create body in an X-Fuzz-Create header, the token-route
    kinds their route in X-Fuzz-Route."""
    k = rng.randrange(25)
    if k >= 21:
        return _token_case(rng, k)
    body: dict[str, Any] = {"messages": [USER], "max_tokens": 2}
    if k == 0:
        d = rng.choice([100, 1000, 200_000])
        inner = _nest(d)
        return "deep_json", {}, b'{"messages": [{"role": "user", "content": ' + inner + b"}]}", False
    if k == 1:
        return "lone_surrogate", {}, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', False
    if k == 2:
        role = rng.choice([{"a": 1}, [1], ["user"], 5, None, True])
        return "role_type", {}, json.dumps({"messages": [{"role": role, "content": "x"}]}).encode(), False
    if k == 3:
        raw = json.dumps(body).encode()
        enc = rng.choice(["gzip", "deflate", "br", "x-bogus"])
        return "bad_encoding", {"Content-Encoding": enc}, b"\x1f\x8bnot-really" + raw, False
    if k == 4:
        return "gzip_ok", {"Content-Encoding": "gzip"}, gzip.compress(json.dumps(body).encode()), True
    if k == 5:
        body["temperature"] = rng.choice([1e-300, 5e-324, 1e-10, -0.0001, 3.0, 2.0000001])
        return "temperature", {}, json.dumps(body).encode(), False
    if k == 6:
        f = rng.choice(FIELDS)
        body[f] = rng.choice(WEIRD)
        return f"field_{f}", {}, json.dumps(body).encode(), None  # type: ignore[return-value]
    if k == 7:
        m = rng.choice([{"role": "user"}, {"content": "x"}, {"role": "user", "content": rng.choice(WEIRD)},
                        "user", 5, None, {"role": "tool", "content": "x"},
                        {"role": "assistant", "content": "x", "tool_calls": rng.choice(WEIRD)}])
        return "message_shape", {}, json.dumps({"messages": [m]}).encode(), None  # type: ignore[return-value]
    if k == 8:
        return "not_json", {}, rng.choice([b"{", b"nul", b"\xff\xfe", b'{"messages": [}', b"[1,]"]), False
    if k == 9:
        return "top_level", {}, rng.choice([b"[]", b"1", b'"s"', b"null", b"true"]), False
    if k == 10:
        return "messages_type", {}, json.dumps({"messages": rng.choice(WEIRD)}).encode(), False
    if k == 11:
        return "huge_body", {}, b"", False  # built when sent: at most a few per run
    if k == 12:
        return "unknown_session", {"X-Fuzz-Session": "nope"}, json.dumps(body).encode(), False
    if k == 13:
        return "cancelled", {"X-Fuzz-Cancel": "1"}, json.dumps(body).encode(), True
    if k == 14:
        return "bad_utf8", {}, b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', False
    if k == 16:  # more tokens than the engine's max_seq_len (1024): the client's mistake, a 400
        words = rng.choice([520, 2000, 20000])
        return "long_prompt", {"X-Fuzz-Fresh": "1"}, json.dumps({"messages": [{"role": "user", "content": "x " * words}],
                                              "max_tokens": 2}).encode(), False
    if k == 17:
        body.update(rng.choice([{"top_p": 0.5}, {"top_p": 0.99}, {"top_k": 1}, {"top_k": 5}]))
        return "truncated_sampling", {"X-Fuzz-Fresh": "1"}, json.dumps(body).encode(), False
    if k == 18:
        create = {"session_id": f"{rng.choice(IDS)}-{i}"}
        return "create_id", {"X-Fuzz-Create": json.dumps(create)}, json.dumps(body).encode(), None  # type: ignore[return-value]
    if k == 19:
        tools = rng.choice([*WEIRD, [{"type": "function"}], [{"type": "function", "function": {"name": 5}}],
                            [{"type": "function", "function": {"name": "f", "parameters": rng.choice(WEIRD)}}]])
        return "create_tools", {"X-Fuzz-Create": json.dumps({"tools": tools})}, json.dumps(body).encode(), None  # type: ignore[return-value]
    if k == 20:
        create = {rng.choice(["metadata", "routing_key", "session_id", "extra"]): rng.choice(WEIRD)}
        return "create_body", {"X-Fuzz-Create": json.dumps(create)}, json.dumps(body).encode(), None  # type: ignore[return-value]
    return "valid", {}, json.dumps(body).encode(), True


# token-route bodies: the ids field and the sampling / logprob fields, each valid or weird
BAD_IDS: list[Any] = [*WEIRD, [None], [1.5], ["1"], [True], [-1], [2**31], [2**70], [1] * 5000, [[1]], {"0": 1}]


def _token_case(rng: random.Random, k: int) -> tuple[str, dict[str, str], bytes, bool]:
    ids = [rng.randrange(1, 100) for _ in range(rng.randrange(1, 12))]  # the tiny vocabulary has 108
    if k == 21:  # generate with a weird field: refused or served, never a 5xx
        body: dict[str, Any] = {"input_ids": ids, "max_tokens": 2}
        f = rng.choice(["input_ids", "input_ids", *FIELDS, "messages"])
        body[f] = rng.choice(BAD_IDS if f == "input_ids" else WEIRD)
        return f"generate_{f}", {"X-Fuzz-Route": "generate"}, json.dumps(body).encode(), None  # type: ignore[return-value]
    if k == 22:  # a well-formed token turn on a fresh session: must be served
        body = {"input_ids": ids, "max_tokens": 2, "temperature": rng.choice([0.0, 1.0]),
                "logprobs": rng.choice([True, False, None])}
        return "generate_ok", {"X-Fuzz-Route": "generate", "X-Fuzz-Fresh": "1"}, json.dumps(body).encode(), True
    if k == 23:  # tokenize, global or on the session, valid or weird
        route = rng.choice(["tokenize", "session_tokenize"])
        good = rng.random() < 0.3
        if good:
            body = rng.choice([{"messages": [USER]}, {"prompt": "one two"}])
        else:
            body = {rng.choice(["messages", "prompt", "tools", "x"]): rng.choice(WEIRD)}
            if rng.random() < 0.3:
                body["prompt"] = "p"
        return f"{route}_{'ok' if good else 'weird'}", {"X-Fuzz-Route": route}, json.dumps(body).encode(), \
            (True if good else None)  # type: ignore[return-value]
    # chat with logprobs: true is served, top_logprobs > 0 or a non-bool is refused
    lp = rng.choice([True, True, *WEIRD])
    body = {"messages": [USER], "max_tokens": 2, "logprobs": lp}
    if rng.random() < 0.5:
        body["top_logprobs"] = rng.choice([0, 1, 5, 21, -1, *WEIRD])
    ok = lp is True and body.get("top_logprobs", 0) in (0, None) and not isinstance(body.get("top_logprobs"), bool)
    return "chat_logprobs", {"X-Fuzz-Fresh": "1"} if ok else {}, json.dumps(body).encode(), (True if ok else None)  # type: ignore[return-value]


def _huge() -> bytes:
    """A body just over the front's 64 MiB limit."""
    return b'{"messages": [{"role": "user", "content": "' + b"x" * (65 << 20) + b'"}]}'


async def run_fuzz(url: str, n: int, seed: int = 0, concurrency: int = 8, max_huge: int = 3) -> dict[str, Any]:
    """Fuzz the front at `url`; returns counts and the failures (5xx, unclear 4xx, dead server)."""
    rng = random.Random(seed)
    statuses: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    failures: list[str] = []
    huge_sent = 0
    # A fresh connection per request: a refused body may leave its connection closed by the server.
    conn = aiohttp.TCPConnector(force_close=True, limit=concurrency * 2)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120), connector=conn) as http:
        async with http.post(f"{url}/sessions") as r:
            sid = (await r.json())["session_id"]
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int, kind: str, headers: dict[str, str], raw: bytes, expect_ok: bool | None) -> None:
            nonlocal huge_sent
            s = headers.pop("X-Fuzz-Session", sid)
            cancel = headers.pop("X-Fuzz-Cancel", "")
            create = headers.pop("X-Fuzz-Create", "")
            # a fresh session, so the refusal is this request's own (the shared one may have diverged)
            fresh = headers.pop("X-Fuzz-Fresh", "")
            route = headers.pop("X-Fuzz-Route", "")
            hdrs = {"Content-Type": "application/json", **headers}
            async with sem:
                chat = ""
                if create:
                    # A session created with this body: refused with a clear 4xx, or reachable at the
                    # base_url the front returned (the chat body is well-formed: it must be served).
                    async with http.post(f"{url}/sessions", data=create.encode(), headers=hdrs) as r:
                        text, code = await r.text(errors="replace"), r.status
                    if code == 201:
                        chat = json.loads(text)["base_url"] + "/chat/completions"
                        expect_ok = True
                        statuses["created"] += 1
                    else:
                        statuses[str(code)] += 1
                        kinds[kind] += 1
                        if code >= 500 or code < 400:
                            failures.append(f"{i} {kind}: create answered {code}: {text[:200]}")
                        elif '"message"' not in text:
                            failures.append(f"{i} {kind}: create {code} without a JSON error message: {text[:200]}")
                        return
                elif (expect_ok or fresh) and not cancel:
                    # A well-formed turn gets its own session: it must be served (200) whatever the
                    # malformed requests around it did to the shared engine batch.
                    async with http.post(f"{url}/sessions") as r:
                        s = (await r.json())["session_id"]
                chat = chat or f"{url}/sessions/{s}/v1/chat/completions"
                if route:
                    chat = {"generate": f"{url}/sessions/{s}/v1/generate", "tokenize": f"{url}/v1/tokenize",
                            "session_tokenize": f"{url}/sessions/{s}/v1/tokenize"}[route]
                if cancel:
                    task = asyncio.ensure_future(http.post(chat, data=raw, headers=hdrs))
                    await asyncio.sleep(rng.random() * 0.01)
                    task.cancel()
                    try:
                        r = await task
                        r.release()
                    except (asyncio.CancelledError, aiohttp.ClientError):
                        pass
                    statuses["cancelled"] += 1
                    kinds[kind] += 1
                    return
                try:
                    async with http.post(chat, data=raw, headers=hdrs) as r:
                        text = await r.text(errors="replace")
                        code = r.status
                except aiohttp.ClientError as exc:
                    # A server refusing a huge or undecodable body may answer and close the connection
                    # before the client has written it all: refused, not failed.
                    if kind in ("huge_body", "bad_encoding"):
                        statuses["huge_closed"] += 1
                        kinds[kind] += 1
                        return
                    failures.append(f"{i} {kind}: {type(exc).__name__}: {exc}")
                    return
            statuses[str(code)] += 1
            if expect_ok and code == 200:
                statuses["served_ok"] += 1
            kinds[kind] += 1
            if code >= 500:
                failures.append(f"{i} {kind}: {code} {text[:200]}")
            elif code >= 400:
                try:
                    msg = json.loads(text)["error"]["message"]
                    assert isinstance(msg, str) and msg
                except (ValueError, KeyError, TypeError, AssertionError):
                    # aiohttp's protocol layer answers some encodings (br without Brotli) in plain text
                    # before any handler runs: still a clear 4xx when it says why.
                    if "content-encoding" in text.lower():
                        statuses["plain_4xx"] += 1
                    else:
                        failures.append(f"{i} {kind}: {code} without a JSON error message: {text[:200]}")
            elif expect_ok is False:
                failures.append(f"{i} {kind}: {code} accepted a request meant to be refused")
            if expect_ok and code != 200:
                failures.append(f"{i} {kind}: a well-formed turn got {code}: {text[:200]}")

        cases = [case(rng, i) for i in range(n)]
        # Huge bodies are costly to build and send: at most a few per run.
        pending = []
        for i, (kind, headers, raw, ok) in enumerate(cases):
            if kind == "huge_body":
                if huge_sent >= max_huge:
                    kind, headers, raw, ok = "valid", {}, json.dumps({"messages": [USER], "max_tokens": 2}).encode(), True
                else:
                    huge_sent += 1
                    raw = _huge()
            pending.append(one(i, kind, dict(headers), raw, ok))
        t0 = time.perf_counter()
        await asyncio.gather(*pending)
        secs = time.perf_counter() - t0
        async with http.get(f"{url}/health") as r:
            alive = r.status == 200
        async with http.post(f"{url}/sessions") as r:
            fresh = (await r.json())["session_id"]
        async with http.post(f"{url}/sessions/{fresh}/v1/chat/completions",
                             json={"messages": [USER], "max_tokens": 2}) as r:
            still_serves = r.status == 200
    return {"requests": n, "seconds": round(secs, 2), "statuses": dict(statuses), "kinds": dict(kinds),
            "failures": failures[:50], "n_failures": len(failures), "alive": alive, "still_serves": still_serves}


async def start_front(tmp: Path, token: str = "") -> SessionFront:
    """A real session front (bench/session_front.py): the rollout's session path to one tiny
    TorchEngine actor, on one host."""
    from miles.bench.session_front import start_session_front
    from miles.core.schema.engine import EngineConfig
    from miles.models.config import ModelSpec
    from miles.models.presets import tiny_config
    from miles.models.registry import build_model
    from miles.rollout.tokens.tiny_tokenizer import tiny_tokenizer

    tok = tiny_tokenizer(str(tmp / "tok"))
    spec = ModelSpec.from_hf(tiny_config("qwen3", vocab_size=tok.vocab_size))
    ecfg = EngineConfig(max_batch_size=16, max_seq_len=1024, kv_budget_tokens=100_000)
    return await start_session_front(tok, [build_model(spec, seed=0)], engine_cfg=ecfg, token=token)


async def _main(a: argparse.Namespace) -> dict[str, Any]:
    front = await start_front(Path(a.tmp))
    try:
        return await run_fuzz(front.url, a.n, a.seed, a.concurrency)
    finally:
        await front.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        a.tmp = tmp
        res = asyncio.run(_main(a))
    print(f"{'status':>12} {'count':>8}")
    for k, v in sorted(res["statuses"].items()):
        print(f"{k:>12} {v:>8}")
    print(f"failures: {res['n_failures']}  alive: {res['alive']}  still serves: {res['still_serves']}")
    for f in res["failures"][:10]:
        print("  ", f)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
