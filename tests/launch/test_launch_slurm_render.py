"""Slurm launcher without a cluster: env parsing, host lists, placement, the rendered script, CLI errors."""

from __future__ import annotations

import dataclasses
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from miles.core.config import load_config
from miles.core.errors import ConfigError
from miles.core.schema import MilesConfig
from miles.core.slurm_env import SlurmEnv, expand_nodelist
from miles.launch.cli import main as cli_main
from miles.launch.slurm_script import JobSpec, SlurmOptions, job_spec, make_plan, render_script
from miles.launch.slurm_step import bind_address, local_rank, master_port, nic_address

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = "examples/quickstart.toml"


def cfg(*sets: str) -> MilesConfig:
    return load_config(MilesConfig, QUICKSTART, list(sets))


# ---------------------------------------------------------------- SLURM_* environment


def test_env_parses_every_field() -> None:
    env = SlurmEnv.from_environ({
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "miles-x", "SLURM_JOB_NODELIST": "gpu[01-02]",
        "SLURM_JOB_NUM_NODES": "2", "SLURM_SUBMIT_DIR": "/home/u", "SLURM_STEP_ID": "3",
        "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "8",
        "SLURMD_NODENAME": "gpu02"})
    assert env == SlurmEnv("4242", "miles-x", "gpu[01-02]", 2, "/home/u", "3", 5, 1, 1, 8, "gpu02")
    assert env.in_allocation and env.in_step
    assert env.hosts() == ["gpu01", "gpu02"]
    assert env.port_offset(10000) == 4242


def test_env_outside_slurm_is_empty() -> None:
    env = SlurmEnv.from_environ({"HOME": "/root"})
    assert not env.in_allocation and not env.in_step
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        env.hosts()


def test_env_rejects_non_integer_counts() -> None:
    with pytest.raises(ConfigError, match="SLURM_PROCID='x'"):
        SlurmEnv.from_environ({"SLURM_PROCID": "x"})


# ---------------------------------------------------------------- host lists


@pytest.mark.parametrize(("spec", "hosts"), [
    ("n1", ["n1"]),
    ("n[1-2]", ["n1", "n2"]),
    ("n[1-3,7],login", ["n1", "n2", "n3", "n7", "login"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
    ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
    ("a[1]b,c", ["a1b", "c"]),
])
def test_expand_nodelist(spec: str, hosts: list[str]) -> None:
    assert expand_nodelist(spec) == hosts


@pytest.mark.parametrize("spec", ["n[1-2", "n1-2]", "n[2-1]", "n[a-b]", "n[[1]]", ""])
def test_expand_nodelist_rejects_malformed(spec: str) -> None:
    with pytest.raises(ConfigError, match="node list"):
        expand_nodelist(spec)


ranges = st.lists(st.tuples(st.integers(0, 120), st.integers(0, 5)), min_size=1, max_size=3)


@given(prefix=st.sampled_from(["n", "gpu", "r1-n"]), rs=ranges, pad=st.integers(1, 3))
def test_expand_nodelist_matches_a_direct_enumeration(prefix: str, rs: list[tuple[int, int]], pad: int) -> None:
    body = ",".join(f"{str(lo).zfill(pad)}-{str(lo + n).zfill(pad)}" for lo, n in rs)
    want = [f"{prefix}{str(v).zfill(pad)}" for lo, n in rs for v in range(lo, lo + n + 1)]
    assert expand_nodelist(f"{prefix}[{body}]") == want


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol (Slurm client) not installed")
def test_expand_nodelist_agrees_with_scontrol() -> None:
    for spec in ["n[1-3,7],gpu[01-02]-ib[1-2]", "a[08-10],b", "x[001-003]"]:
        out = subprocess.run(["scontrol", "show", "hostnames", spec], capture_output=True, text=True, check=True)
        assert expand_nodelist(spec) == out.stdout.split()


# ---------------------------------------------------------------- placement


def test_default_plan_puts_engines_on_their_own_node() -> None:
    plan = make_plan(cfg(), SlurmOptions())
    assert plan.nodes == 2
    where = {s.role: (s.first_node, s.num_nodes, s.ntasks) for s in plan.steps}
    assert where == {"head": (0, 1, 1), "engine": (1, 1, 1), "rollout": (0, 1, 1), "trainer": (0, 1, 1)}
    assert plan.tasks_per_node == 3


def test_placement_spreads_a_role_over_a_node_range() -> None:
    c = cfg("engine.num_engines=5", "trainer.world_size=4")
    plan = make_plan(c, SlurmOptions(nodes=4, place={"engine": "2-3", "trainer": "0-1"}))
    eng, tr = plan.step("engine"), plan.step("trainer")
    assert [eng.tasks_on(n) for n in range(4)] == [0, 0, 3, 2]
    assert [tr.tasks_on(n) for n in range(4)] == [2, 2, 0, 0]
    assert plan.tasks_per_node == 4  # node 0: head + rollout + 2 trainer ranks


@pytest.mark.parametrize(("opts", "match"), [
    (SlurmOptions(nodes=2, place={"engine": "2"}), r"node indices must lie in 0\.\.1"),
    (SlurmOptions(nodes=2, place={"engine": "x"}), "expected a node index"),
    (SlurmOptions(nodes=3), "uses only 2"),
    (SlurmOptions(nodes=2, place={"trainer": "0-1"}), "cannot span 2 nodes"),
    (SlurmOptions(nodes=2, place={"critic": "0"}), "unknown role 'critic'"),
    (SlurmOptions(nodes=2, srun_args={"critic": ("--x",)}), "unknown role 'critic'"),
])
def test_bad_placement_names_the_problem(opts: SlurmOptions, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_plan(cfg(), opts)


@pytest.mark.parametrize(("sets", "match"), [
    (["transport.interface=10.0.0.5"], "one host's address"),
    (["transport.interface=0.0.0.0"], "cannot be advertised"),
    (["transport.scheme=ipc"], "only reaches processes on one host"),
])
def test_multi_node_rejects_single_host_transport(sets: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_plan(cfg(*sets), SlurmOptions(nodes=2))


def test_single_node_accepts_a_literal_address_and_nic_names_anywhere() -> None:
    make_plan(cfg("transport.interface=10.0.0.5"), SlurmOptions(nodes=1))
    make_plan(cfg("transport.interface=ib0"), SlurmOptions(nodes=2))


# ---------------------------------------------------------------- the script


def render(c: MilesConfig, opts: SlurmOptions) -> str:
    return render_script(make_plan(c, opts), run_dir="/shared/runs/q", config_path="/shared/runs/q/c.json",
                         python="/opt/venv/bin/python", workdir="/shared/src")


def test_script_starts_the_supervisor_and_lists_one_exact_srun_step_per_role_head_first() -> None:
    opts = SlurmOptions(partition="gpu", time="01:00:00", sbatch_args=("--exclusive",),
                        srun_args={"engine": ("--gpus-per-task=1",)}, master_port=29555)
    s = render(cfg(), opts)
    lines = s.splitlines()
    assert lines[0] == "#!/bin/bash"
    for want in ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=3", "#SBATCH --partition=gpu",
                 "#SBATCH --time=01:00:00", "#SBATCH --exclusive", "#SBATCH --output=/shared/runs/q/slurm/slurm-%j.out"]:
        assert want in lines
    # the script only starts the shared supervisor; it runs no srun itself
    assert lines[-1] == "exec /opt/venv/bin/python -m miles.launch.slurm_supervisor /shared/runs/q"
    assert not [ln for ln in lines if "srun" in ln and not ln.startswith("#")]
    spec = job_spec(make_plan(cfg(), opts), run_dir="/shared/runs/q", config_path="/shared/runs/q/c.json",
                    python="/opt/venv/bin/python")
    assert [c.role for c in spec.steps] == ["head", "engine", "rollout", "trainer"]
    for c in spec.steps:
        ln = " ".join(c.argv)
        assert c.argv[0] == "srun" and ln.count("srun ") == 1 and "--exact" in ln and "--kill-on-bad-exit=1" in ln
        assert "--open-mode=append" in ln  # a restarted step keeps its crashed incarnation's lines
        assert f"miles.launch.slurm_step {c.role}" in ln
        assert f"#   {c.role}: {shlex.join(c.argv)}" in lines  # the dry run shows what will run
    by = {c.role: " ".join(c.argv) for c in spec.steps}
    assert "--relative=1" in by["engine"] and "--gpus-per-task=1" in by["engine"]
    assert "--relative=0" in by["trainer"] and "--master-port 29555" in by["trainer"]
    assert spec.address_file == Path("/shared/runs/q/slurm/directory.addr")


def test_job_spec_round_trips_through_its_file(tmp_path: Path) -> None:
    spec = job_spec(make_plan(cfg("engine.num_engines=3"), SlurmOptions(nodes=2, max_restarts=5)),
                    run_dir="/r", config_path="/r/c.json", python="py", resume="/r/checkpoints/step_000002")
    spec.write(tmp_path / "steps.json")
    back = JobSpec.read(tmp_path / "steps.json")
    assert back == spec and back.max_restarts == 5 and back.steps[1].ntasks == 3


def test_snapshot_eval_is_refused_under_slurm() -> None:
    with pytest.raises(ConfigError, match="eval.mode = 'snapshot'"):
        make_plan(cfg("eval.mode=snapshot"), SlurmOptions())


def test_script_is_valid_bash() -> None:
    c = cfg("engine.num_engines=3", "trainer.world_size=2")
    s = render(c, SlurmOptions(nodes=3, place={"engine": "1-2"}, gpus_per_node=8, account="proj"))
    res = subprocess.run(["bash", "-n"], input=s, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "#SBATCH --gpus-per-node=8" in s and "#SBATCH --account=proj" in s


def test_single_node_job_puts_every_step_on_node_0() -> None:
    s = render(cfg("engine.num_engines=2"), SlurmOptions(nodes=1))
    assert "#SBATCH --nodes=1" in s and "#SBATCH --ntasks-per-node=5" in s
    assert "--relative=1" not in s and s.count("--relative=0") == 4


# ---------------------------------------------------------------- per-step facts


def test_bind_address_rules() -> None:
    one = SlurmEnv(num_nodes=1, node_name="n1")
    many = SlurmEnv(num_nodes=2, node_name="localhost")
    assert bind_address("127.0.0.1", one) == "127.0.0.1"
    assert bind_address("127.0.0.1", many) == "127.0.0.1"  # "localhost" resolves to loopback
    assert bind_address("10.1.2.3", one) == "10.1.2.3"
    assert bind_address("lo", many) == nic_address("lo") == "127.0.0.1"
    with pytest.raises(ConfigError, match="no-such-nic0"):
        bind_address("no-such-nic0", many)
    with pytest.raises(ConfigError, match="does not resolve"):
        bind_address("127.0.0.1", dataclasses.replace(many, node_name="no-such-host.invalid"))


def test_master_port_is_given_or_derived_from_the_job() -> None:
    assert master_port(29500, SlurmEnv(job_id="7")) == 29500
    assert master_port(0, SlurmEnv(job_id="123456")) == 20000 + 3456


def test_local_rank_follows_gpu_binding() -> None:
    env = SlurmEnv(local_id=3)
    assert local_rank(env, "") == 3  # no CUDA_VISIBLE_DEVICES: the node-local task rank
    assert local_rank(env, "0,1,2,3,4,5,6,7") == 3  # node-wide visibility
    assert local_rank(env, "5") == 0  # --gpus-per-task=1: the one visible device


# ---------------------------------------------------------------- the CLI


def test_dry_run_prints_the_script(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["launch", QUICKSTART, "--slurm", "--dry-run", "--set", "run.name=demo"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash\n#SBATCH --job-name=miles-demo\n")


@pytest.mark.parametrize(("args", "word"), [
    (["--set", "engine.num_engines=two"], "engine.num_engines"),
    (["--set", "no_such.key=1"], "no_such"),
    (["--place", "engine=5"], "--place engine"),
    (["--place", "engine"], "ROLE=VALUE"),
])
def test_bad_input_gives_one_error_line_and_nonzero_exit(args: list[str], word: str) -> None:
    res = subprocess.run([sys.executable, "-m", "miles.launch.cli", "launch", QUICKSTART, "--slurm", "--dry-run",
                          *args], capture_output=True, text=True)
    assert res.returncode == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("miles: error: ConfigError") and word in lines[0], res.stderr


def test_launch_without_slurm_flag_points_to_train(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["launch", QUICKSTART, "--dry-run"]) == 2
    assert "miles train" in capsys.readouterr().err


# ---------------------------------------------------------------- examples/slurm


def _example_launch_args(sbatch: Path) -> tuple[dict[str, str], list[str]]:
    text = sbatch.read_text().replace("\\\n", " ")
    header = dict(ln[len("#SBATCH --"):].split("=", 1) for ln in text.splitlines()
                  if ln.startswith("#SBATCH --") and "=" in ln)
    line = next(ln for ln in text.splitlines() if ln.startswith("exec miles launch"))
    return header, [a for a in shlex.split(line)[2:] if a != "$@"]


@pytest.mark.parametrize("name", ["multinode.sbatch", "quickstart-2node.sbatch"])
def test_example_sbatch_renders_within_its_own_allocation(name: str, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = Path("examples/slurm") / name
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    header, args = _example_launch_args(path)
    # inside the example's allocation: miles takes the node count from Slurm
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", header["nodes"])
    assert cli_main([*args, "--dry-run"]) == 0
    script = capsys.readouterr().out
    assert f"#SBATCH --nodes={header['nodes']}" in script
    per_node = int(next(ln for ln in script.splitlines() if ln.startswith("#SBATCH --ntasks-per-node="))
                   .split("=")[1])
    assert per_node <= int(header["ntasks-per-node"]), "the example allocates fewer tasks than its steps need"


@pytest.mark.timeout(120)
def test_launch_console_is_readable_lines_with_events_in_the_log(tmp_path: Path) -> None:
    """`miles launch --slurm` on a console that is not a terminal: no raw JSON event lines (the
    warm-up's events go to run_dir/logs/launcher.log); here no sbatch is on PATH, so it stops
    at the submit with its one-line error, after writing the run's files."""
    import json
    import os

    run = tmp_path / "run"
    (tmp_path / "bin").mkdir()
    p = subprocess.run([sys.executable, "-m", "miles.launch.cli", "launch", str(ROOT / "examples" / "quickstart.toml"),
                        "--slurm", "--set", f"run.dir={run}", "--set", "run.warmup_sft_steps=0"],
                       capture_output=True, text=True, timeout=110, cwd=tmp_path,
                       env={**os.environ, "PATH": str(tmp_path / "bin"), "MILES_CACHE": str(tmp_path / "cache"),
                            "SLURM_JOB_ID": "", "SLURM_NODELIST": ""})
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stdout == "" and p.stderr.splitlines() == [
        "miles: error: ConfigError: sbatch not found on PATH: run on a Slurm login node, inside `salloc`, "
        "or add --dry-run to print the script"]
    events = [json.loads(ln)["event"] for ln in (run / "logs" / "launcher.log").read_text().splitlines()]
    assert "warmup_saved" in events
