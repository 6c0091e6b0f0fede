"""`miles launch CONFIG --slurm`: check the run, render its sbatch script, then submit it (or run it in place).

The run is checked as `miles train` checks it (launch/cli.py `load_run`: the config, an
empty run.dir or `--resume RUN_DIR`, `validate_launch`) and the placement is planned
before anything is written or submitted: a wrong config never reaches sbatch. Outside an
allocation the script is submitted with `sbatch` (`--wait` follows the job and returns
its exit code). Inside one (SLURM_JOB_ID set, e.g. under `salloc`) the same script runs
under bash, so its srun steps use the current allocation. The script starts the shared
supervisor inside the allocation (launch/slurm_supervisor.py). `--dry-run` prints the
script and touches nothing (it checks the placement, not the config's files and hooks,
which may only exist where the job runs). The run directory must be on a filesystem all
nodes share: the resolved config, the directory address and the logs live there.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from miles.core.errors import ConfigError
from miles.core.logging import configure_logging
from miles.core.schema import MilesConfig
from miles.core.slurm_env import SlurmEnv
from miles.launch.cli import _load, _resume_config, add_config_args, begin_resume, load_run
from miles.launch.slurm_script import (
    ROLES,
    SlurmOptions,
    SlurmPlan,
    job_spec,
    make_plan,
    render_script,
)
from miles.metrics.run_dir import write_config


def _role_pairs(values: list[str], flag: str) -> list[tuple[str, str]]:
    out = []
    for v in values:
        role, sep, rest = v.partition("=")
        if not sep or not rest:
            raise ConfigError(f"{flag} {v!r}: expected ROLE=VALUE with ROLE one of {', '.join(ROLES)}")
        out.append((role, rest))
    return out


def options_from_args(args: argparse.Namespace, env: SlurmEnv) -> SlurmOptions:
    srun: dict[str, tuple[str, ...]] = {}
    for role, arg in _role_pairs(args.srun_arg, "--srun-arg"):
        srun[role] = (*srun.get(role, ()), arg)
    nodes = args.nodes or (env.num_nodes if env.in_allocation else 0)
    return SlurmOptions(nodes=nodes, place=dict(_role_pairs(args.place, "--place")), partition=args.partition,
                        account=args.account, time=args.time, cpus_per_task=args.cpus_per_task,
                        gpus_per_node=args.gpus_per_node, sbatch_args=tuple(args.sbatch_arg), srun_args=srun,
                        master_port=args.master_port, max_restarts=args.max_restarts,
                        directory_wait_s=args.directory_wait_s)


def _render(plan: SlurmPlan, cfg: MilesConfig) -> str:
    run_dir = str(Path(cfg.run.dir).resolve())
    return render_script(plan, run_dir=run_dir, config_path=f"{run_dir}/config.resolved.json",
                         python=sys.executable, workdir=os.getcwd())


def prepare(cfg: MilesConfig, resume: str = "") -> MilesConfig:
    """Absolute run dir and, for a fresh run, a real initial checkpoint, so every step on every
    node loads the same one (a resumed run loads its checkpoint)."""
    from miles.warmup.sft import with_initial_checkpoint

    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(Path(cfg.run.dir).resolve())))
    return cfg if resume else with_initial_checkpoint(cfg)


def write_run_files(cfg: MilesConfig, plan: SlurmPlan, resume: str = "") -> Path:
    """The resolved config, the steps the supervisor runs (slurm/steps.json) and the script."""
    run = Path(cfg.run.dir)
    (run / "slurm").mkdir(parents=True, exist_ok=True)
    (run / "logs").mkdir(exist_ok=True)
    (run / "slurm" / "exit_code").unlink(missing_ok=True)  # an earlier job's (before --resume)
    cfg_path = write_config(run, cfg)
    job_spec(plan, run_dir=str(run), config_path=str(cfg_path), python=sys.executable,
             resume=resume).write(run / "slurm" / "steps.json")
    path = run / "slurm" / "job.sbatch"
    path.write_text(_render(plan, cfg))
    return path


def submit(script: Path) -> str:
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ConfigError("sbatch not found on PATH: run on a Slurm login node, inside `salloc`, or add "
                          "--dry-run to print the script")
    res = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True)
    if res.returncode != 0:
        raise ConfigError(f"sbatch rejected {script}: {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout.strip().split(";")[0]


def job_state(job_id: str) -> tuple[str, int | None]:
    """(state, exit code or None) from `scontrol show job`; ('GONE', None) once Slurm forgot it."""
    res = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
    if res.returncode != 0:
        return "GONE", None
    fields = dict(kv.split("=", 1) for kv in res.stdout.split() if "=" in kv)
    code = fields.get("ExitCode", "")
    return fields.get("JobState", "UNKNOWN"), int(code.split(":")[0]) if code[:1].isdigit() else None


FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE", "GONE"}


def wait_job(job_id: str, run_dir: Path, poll_s: float = 1.0) -> int:
    """Poll until the job ends; its exit code from the script's exit_code file, else from Slurm."""
    state, code = job_state(job_id)
    while state not in FINAL:
        time.sleep(poll_s)
        state, code = job_state(job_id)
    marker = run_dir / "slurm" / "exit_code"
    if marker.is_file() and marker.read_text().strip().lstrip("-").isdigit():
        return int(marker.read_text())
    print(f"miles: job {job_id} ended {state} without writing {marker}", file=sys.stderr)
    return code if code else 1


def run_in_place(script: Path) -> int:
    """Run the script under bash here; its exit code. A Ctrl-C reaches the supervisor too, which
    stops the steps gracefully: wait for that instead of leaving (which would end the allocation's
    steps at once under salloc)."""
    proc = subprocess.Popen(["bash", str(script)])
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            continue


def cmd_launch(args: argparse.Namespace) -> int:
    if not args.slurm:
        raise ConfigError("`miles launch` needs --slurm (the cluster backend); for local processes use "
                          "`miles train CONFIG`")
    env = SlurmEnv.from_environ()
    if args.dry_run:
        cfg = _resume_config(args.resume, args.set)[0] if args.resume else _load(args)
        print(_render(make_plan(cfg, options_from_args(args, env)), cfg), end="")
        return 0
    if args.resume and args.config:
        raise ConfigError(f"--resume {args.resume}: give no CONFIG (the run's own config.resolved.json is "
                          "used; change it with --set)")
    # the checks of `miles train` (but where roles share a GPU: the steps' placement decides), before
    # anything is written or submitted
    loaded = load_run(args, local=False)
    if loaded is None:
        return 0
    cfg, resume = loaded
    if cfg.reward_model.num_engines:
        raise ConfigError("reward_model.num_engines > 0: the judge pool is started by `miles train` (local) "
                          "only so far; under Slurm serve the judge yourself and call it from the reward function")
    plan = make_plan(cfg, options_from_args(args, env))
    if env.in_allocation and env.num_nodes and env.num_nodes < plan.nodes:
        raise ConfigError(f"the plan needs {plan.nodes} nodes but allocation {env.job_id} has {env.num_nodes}: "
                          "allocate more nodes or lower --nodes / --place")
    begin_resume(cfg, resume)
    # file: events as JSON to run_dir/logs/launcher.log, warnings and errors as one readable line
    # here (as `miles train`); the roles' events go to their steps' logs
    configure_logging(cfg.run.log_level, cfg.run.json_logs, file=cfg.run.launcher_log(), run=cfg.run.name,
                      role="launcher")
    cfg = prepare(cfg, resume)
    script = write_run_files(cfg, plan, str(Path(resume).resolve()) if resume else "")
    if env.in_allocation:
        print(f"miles: inside allocation {env.job_id}: running {script}", flush=True)
        return run_in_place(script)
    job_id = submit(script)
    print(f"miles: submitted job {job_id}: {script}  (log {cfg.run.dir}/slurm/slurm-{job_id}.out)", flush=True)
    if not args.wait:
        return 0
    return wait_job(job_id, Path(cfg.run.dir))


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("launch", help="run on Slurm: one srun step per role (sbatch, or inside salloc)")
    add_config_args(p)
    p.add_argument("--slurm", action="store_true", help="launch under Slurm (required)")
    p.add_argument("--resume", default="", metavar="RUN_DIR",
                   help="continue RUN_DIR from its last checkpoint (trainer, buffer ledger, data position)")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script and exit")
    p.add_argument("--wait", action="store_true", help="after sbatch, wait for the job; exit with its code")
    p.add_argument("--nodes", type=int, default=0, help="nodes of the job (default: 2 with engines, else 1)")
    p.add_argument("--place", action="append", default=[], metavar="ROLE=A[-B]",
                   help="allocation node indices of a role's step (head, engine, rollout, trainer)")
    p.add_argument("--partition", default="")
    p.add_argument("--account", default="")
    p.add_argument("--time", default="", help="sbatch --time limit, e.g. 04:00:00")
    p.add_argument("--cpus-per-task", type=int, default=1, help="CPUs of every task (sbatch and srun)")
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="extra #SBATCH line, e.g. --sbatch-arg=--exclusive")
    p.add_argument("--srun-arg", action="append", default=[], metavar="ROLE=ARG",
                   help="extra srun argument for one role's step, e.g. engine=--gpus-per-task=1")
    p.add_argument("--master-port", type=int, default=0, help="trainer MASTER_PORT (default 20000 + job id %% 10000)")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts of a crashed engine step (a rollout step is not restarted: resume the run)")
    p.add_argument("--directory-wait-s", type=float, default=300.0, help="how long steps wait for the head")
    p.set_defaults(fn=cmd_launch)
