"""`miles bench` is offered only where bench/ is beside the package (a checkout): an installed
wheel holds no bench/, so its CLI does not list a command that could only fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.launch import cli


@pytest.mark.timeout(60)
def test_bench_is_offered_only_with_a_bench_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "BENCH_DIR", tmp_path / "bench")  # as installed: no bench/ beside the package
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "quickstart_seeds"])
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "hello.py").write_text("import sys\nsys.exit(3)\n")
    args = cli.build_parser().parse_args(["bench", "hello"])
    assert args.fn(args) == 3  # the script ran, its exit code comes back
    args = cli.build_parser().parse_args(["bench", "nope"])
    assert args.fn(args) == 2  # an unknown name is refused, listing what there is
