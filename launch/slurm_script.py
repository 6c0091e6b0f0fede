"""The Slurm job of a run: which role runs on which nodes, each role's srun step, and the sbatch script.

One `srun` step per role (head, engine, rollout, trainer), each with `--exact` (a step
takes only its own CPUs, so steps run side by side) and `--kill-on-bad-exit` (one
failing task ends its step). `--relative` places a step on a contiguous range of the
allocation's nodes, so no host names are needed. The steps' commands go to
`RUN/slurm/steps.json` (`JobSpec`); the sbatch script only starts the supervisor
(launch/slurm_supervisor.py), which runs them: the head step (the directory) first, the
others once its address is in `RUN/slurm/directory.addr`, all watched by the supervisor
`miles train` uses too (launch/supervisor.py).
"""

from __future__ import annotations

import ipaddress
import json
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

from miles.core.errors import ConfigError
from miles.core.schema import MilesConfig

ROLES = ("head", "engine", "rollout", "trainer")


@dataclass(frozen=True)
class Step:
    role: str
    first_node: int
    num_nodes: int
    ntasks: int
    extra: tuple[str, ...] = ()

    def tasks_on(self, node: int) -> int:
        """Tasks srun's default block distribution puts on allocation node `node`."""
        if not self.first_node <= node < self.first_node + self.num_nodes:
            return 0
        k = node - self.first_node
        base, rem = divmod(self.ntasks, self.num_nodes)
        return base + (1 if k < rem else 0)


@dataclass(frozen=True)
class SlurmOptions:
    """What `miles launch --slurm` takes besides the config (all plain CLI flags)."""

    nodes: int = 0  # 0 = from the placement (or the allocation)
    place: dict[str, str] = field(default_factory=dict)  # role -> "K" or "A-B" node indices
    partition: str = ""
    account: str = ""
    time: str = ""
    cpus_per_task: int = 1
    gpus_per_node: int = 0
    sbatch_args: tuple[str, ...] = ()
    srun_args: dict[str, tuple[str, ...]] = field(default_factory=dict)
    master_port: int = 0  # 0 = 20000 + SLURM_JOB_ID % 10000
    max_restarts: int = 3
    directory_wait_s: float = 300.0


@dataclass(frozen=True)
class SlurmPlan:
    job_name: str
    nodes: int
    steps: tuple[Step, ...]
    opts: SlurmOptions

    def step(self, role: str) -> Step:
        return next(s for s in self.steps if s.role == role)

    @property
    def tasks_per_node(self) -> int:
        return max(sum(s.tasks_on(n) for s in self.steps) for n in range(self.nodes))


def _parse_range(role: str, spec: str, nodes: int) -> tuple[int, int]:
    a, _, b = spec.partition("-")
    try:
        lo, hi = int(a), int(b or a)
    except ValueError:
        raise ConfigError(f"--place {role}={spec!r}: expected a node index K or a range A-B") from None
    if not 0 <= lo <= hi < nodes:
        raise ConfigError(f"--place {role}={spec!r}: node indices must lie in 0..{nodes - 1} "
                          f"(the job has {nodes} node{'s' * (nodes != 1)})")
    return lo, hi - lo + 1


def default_nodes(cfg: MilesConfig) -> int:
    """Trainer, rollout and head share node 0; engines get a node of their own when there are any."""
    return 2 if cfg.engine.num_engines > 0 else 1


def make_plan(cfg: MilesConfig, opts: SlurmOptions) -> SlurmPlan:
    """Decide every step's nodes and task count; bad placement or transport -> ConfigError."""
    unknown = sorted(set(opts.place) - set(ROLES)) + sorted(set(opts.srun_args) - set(ROLES))
    if unknown:
        raise ConfigError(f"unknown role {unknown[0]!r} in --place/--srun-arg; roles are {', '.join(ROLES)}")
    nodes = opts.nodes or default_nodes(cfg)
    if nodes < 1:
        raise ConfigError(f"--nodes must be >= 1, got {nodes}")
    counts = {"head": 1, "engine": cfg.engine.num_engines, "rollout": 1, "trainer": cfg.trainer.world_size}
    if counts["trainer"] < 1:
        raise ConfigError(f"trainer.world_size must be >= 1, got {counts['trainer']}")
    engine_default = f"1-{min(nodes - 1, max(1, counts['engine']))}" if nodes > 1 else "0"
    defaults = {"head": "0", "engine": engine_default, "rollout": "0", "trainer": "0"}
    steps = []
    for role in ROLES:
        if counts[role] == 0:
            continue
        spec = opts.place.get(role, defaults[role])
        first, n = _parse_range(role, spec, nodes)
        if counts[role] < n:
            raise ConfigError(f"--place {role}={spec}: {counts[role]} task(s) cannot span {n} nodes")
        steps.append(Step(role, first, n, counts[role], opts.srun_args.get(role, ())))
    used = {k for s in steps for k in range(s.first_node, s.first_node + s.num_nodes)}
    if len(used) < nodes:
        raise ConfigError(f"the job asks for {nodes} nodes but the placement uses only {len(used)}: "
                          "lower --nodes or place a role on the others with --place ROLE=A-B")
    check_transport(cfg, nodes)
    if cfg.eval.mode == "snapshot":
        raise ConfigError("eval.mode = 'snapshot' needs a dedicated eval engine, which `miles launch --slurm` "
                          "does not place: use eval.mode = 'shared' (or 'external'), or run it with `miles train`")
    return SlurmPlan(f"miles-{cfg.run.name}", nodes, tuple(steps), opts)


def check_transport(cfg: MilesConfig, nodes: int) -> None:
    """Reject transport settings that cannot work across `nodes` hosts, naming the fix."""
    t = cfg.transport
    if nodes > 1 and t.scheme == "ipc":
        raise ConfigError("transport.scheme='ipc' only reaches processes on one host, and this job spans "
                          f"{nodes} nodes: set transport.scheme='tcp'")
    try:
        ip = ipaddress.ip_address(t.interface)
    except ValueError:
        return  # a NIC name (e.g. "ib0"): each step binds that NIC's own address
    if ip.is_unspecified:
        raise ConfigError(f"transport.interface={t.interface!r} cannot be advertised to peers: name a NIC "
                          "(e.g. 'ib0') or keep 127.0.0.1 to bind each node's Slurm hostname address")
    if nodes > 1 and not ip.is_loopback:
        raise ConfigError(f"transport.interface={t.interface!r} is one host's address, but the job spans "
                          f"{nodes} nodes: name a NIC (e.g. --set transport.interface=ib0) or keep "
                          "127.0.0.1 to bind each node's Slurm hostname address")


def _q(s: str) -> str:
    return shlex.quote(s)


@dataclass(frozen=True)
class StepCommand:
    role: str
    ntasks: int
    argv: tuple[str, ...]  # the srun command line


@dataclass(frozen=True)
class JobSpec:
    """What the supervisor inside the allocation runs (RUN/slurm/steps.json)."""

    run_dir: str
    steps: tuple[StepCommand, ...]
    max_restarts: int = 3
    directory_wait_s: float = 300.0
    stop_grace_s: float = 20.0  # how long a step may drain after its SIGTERM before srun kills it
    resume: str = ""  # the checkpoint of `--resume`, or "" for a fresh run

    @property
    def address_file(self) -> Path:
        return Path(self.run_dir) / "slurm" / "directory.addr"

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def read(cls, path: Path) -> JobSpec:
        d = json.loads(path.read_text())
        steps = tuple(StepCommand(s["role"], int(s["ntasks"]), tuple(s["argv"])) for s in d.pop("steps"))
        return cls(steps=steps, **d)


def step_commands(plan: SlurmPlan, *, run_dir: str, config_path: str, python: str) -> tuple[StepCommand, ...]:
    """Each role's srun command; the head's first."""
    o = plan.opts
    addr = f"{run_dir}/slurm/directory.addr"
    master = plan.step("trainer").first_node
    out = []
    for s in plan.steps:
        # --open-mode=append: a restarted step adds to its log; truncating it would erase the
        # lines of the incarnation that crashed (the evidence of why it was restarted).
        # The trainer's stdout (rank 0's progress line) goes to the job's own output.
        log = f"--{'error' if s.role == 'trainer' else 'output'}={run_dir}/logs/{s.role}-%t.log"
        srun = ["srun", f"--job-name={s.role}", f"--nodes={s.num_nodes}", f"--ntasks={s.ntasks}",
                f"--relative={s.first_node}", "--exact", "--kill-on-bad-exit=1", "--open-mode=append",
                f"--cpus-per-task={o.cpus_per_task}", *s.extra, log]
        entry = [python, "-m", "miles.launch.slurm_step", s.role, "--config", config_path,
                 "--directory-file", addr, "--directory-wait-s", f"{o.directory_wait_s:g}"]
        if s.role == "trainer":
            entry += ["--master-node", str(master)] + (["--master-port", str(o.master_port)] if o.master_port else [])
        out.append(StepCommand(s.role, s.ntasks, (*srun, *entry)))
    return tuple(out)


def job_spec(plan: SlurmPlan, *, run_dir: str, config_path: str, python: str, resume: str = "") -> JobSpec:
    return JobSpec(run_dir, step_commands(plan, run_dir=run_dir, config_path=config_path, python=python),
                   plan.opts.max_restarts, plan.opts.directory_wait_s, resume=resume)


def render_script(plan: SlurmPlan, *, run_dir: str, config_path: str, python: str, workdir: str) -> str:
    """The sbatch script; the same file runs under `bash` inside an existing allocation.

    It only starts the supervisor; the steps it will run are listed as comments."""
    o = plan.opts
    head = ["#!/bin/bash", f"#SBATCH --job-name={plan.job_name}", f"#SBATCH --nodes={plan.nodes}",
            f"#SBATCH --ntasks-per-node={plan.tasks_per_node}", f"#SBATCH --cpus-per-task={o.cpus_per_task}",
            f"#SBATCH --output={run_dir}/slurm/slurm-%j.out"]
    head += [f"#SBATCH --{k}={v}" for k, v in (("partition", o.partition), ("account", o.account),
                                                ("time", o.time)) if v]
    if o.gpus_per_node:
        head.append(f"#SBATCH --gpus-per-node={o.gpus_per_node}")
    head += [f"#SBATCH {a}" for a in o.sbatch_args]
    steps = step_commands(plan, run_dir=run_dir, config_path=config_path, python=python)
    lines = head + [
        "# Rendered by `miles launch --slurm`; inside an allocation it runs this file with bash instead of sbatch.",
        "# The supervisor `miles train` uses too runs here, inside the allocation: it starts one srun step",
        f"# per role from {run_dir}/slurm/steps.json (the head first), restarts a crashed engine step,",
        "# stops every step with SIGTERM at the end (the head last) and writes RUN/slurm/exit_code:",
        *[f"#   {c.role}: {' '.join(_q(a) for a in c.argv)}" for c in steps],
        "set -uo pipefail",
        f"cd {_q(workdir)}",
        "export PYTHONUNBUFFERED=1",
        f"exec {_q(python)} -m miles.launch.slurm_supervisor {_q(run_dir)}",
    ]
    return "\n".join(lines) + "\n"
