"""Bad arguments, missing extras and a missing peer: one clear error line, non-zero exit, no hang."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.core.ports import group_port
from miles.launch.cli import main

from .perftest_helpers import perftest

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("args", "needle"), [
    (["--sizes", "8X"], "unknown unit 'X'"),
    (["--sizes", "1GiB:8B:x2"], "stop 8B is below start 1GiB"),
    (["--sizes", "8B:1KiB:x1"], "must multiply by at least 2"),
    (["--sizes", "8B:1KiB"], "a range is START:STOP:STEP"),
    (["--sizes", "8B:1KiB:*2"], "must be xN (multiply) or +SIZE (add)"),
    (["--sizes", "64TiB"], "exceeds the limit"),
    (["--transport", "zmq-ctl", "--sizes", "128MiB"], "exceeds the limit of 65532KiB"),
    (["--pattern", "bucket", "--transport", "zmq-ctl"], "needs a bulk transport"),
    (["--iters", "0"], "--iters 0 must be >= 1"),
    (["--window", "-1"], "--window -1 must be >= 1"),
    (["--device", "cuda", "--transport", "zmq-bulk"], "moves host memory"),
    (["--device", "pinned", "--transport", "cuda-ipc"], "--device pinned is for host transports"),
    (["--peer", "nohost"], "expected HOST:PORT"),
    (["--peer", "h:1", "--listen", "2"], "exclude each other"),
    (["--transport", "disk", "--listen", "127.0.0.1:1"], "needs --dir"),
])
def test_bad_arguments(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["perftest", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_missing_extras_name_what_to_install(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    try:
        import ucxx  # noqa: F401
    except ImportError:
        assert main(["perftest", "--transport", "ucx"]) == 2
        assert "pip install 'miles[ucx]'" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        assert main(["perftest", "--transport", "cuda-ipc"]) == 2
        assert "needs CUDA" in capsys.readouterr().err
        assert main(["perftest", "--transport", "broadcast", "--device", "cuda"]) == 2
        assert "needs CUDA" in capsys.readouterr().err
        assert main(["perftest", "--transport", "zmq-bulk", "--device", "pinned"]) == 2
        assert "--device pinned needs CUDA" in capsys.readouterr().err


@pytest.mark.parametrize("role", ["--peer", "--listen"])
def test_missing_peer_fails_within_the_deadline(tmp_path: Path, role: str) -> None:
    # timeout=40: a perftest that waits for ever fails here; how close to its 1 s it gives up is
    # a timing, measured by bench/deadlines_cpu.py
    res = perftest(role, f"127.0.0.1:{group_port()}", "--connect-timeout", "1", cwd=tmp_path, timeout=40)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "within 1 s" in lines[0], lines


def test_plot_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "bw.png"
    res = perftest("--transport", "zmq-bulk", "--pattern", "pingpong", "--sizes", "8B,4KiB", "--iters", "8",
                   "--warmup", "2", "--plot", str(png), "--quiet", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res.stdout == ""
