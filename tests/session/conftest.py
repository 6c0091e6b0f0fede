"""The session stack served over HTTP, shared by the front's bad-input and client-error tests."""

from __future__ import annotations

import aiohttp
import pytest

from .session_stack import make_tok, start_stack, tiny_lm


@pytest.fixture
async def served(tmp_path):
    tok = make_tok(tmp_path)
    s = await start_stack(tok, [tiny_lm(tok)])
    http = aiohttp.ClientSession()
    yield s, http
    await http.close()
    await s.stop()
