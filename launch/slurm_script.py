"""The Slurm job of a run: which role runs on which nodes, and the sbatch script that does it.

One `srun` step per role (head, engine, rollout, trainer), each with `--exact` (a step
takes only its own CPUs, so steps run side by side) and `--kill-on-bad-exit` (one
failing task ends its step). `--relative` places a step on a contiguous range of the
allocation's nodes, so the script needs no host names. The head step (the directory)
starts first; it writes its address to `RUN/slurm/directory.addr` on the shared
filesystem, and the other steps wait for that file. The script then supervises: an
engine or rollout step that exits is restarted (up to a limit), the run ends when the
trainer step ends, and the remaining steps are stopped with SIGTERM.
"""

from __future__ import annotations

import ipaddress
import shlex
from dataclasses import dataclass, field

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


def render_script(plan: SlurmPlan, *, run_dir: str, config_path: str, python: str, workdir: str) -> str:
    """The sbatch script; the same file runs under `bash` inside an existing allocation."""
    o = plan.opts
    head = ["#!/bin/bash", f"#SBATCH --job-name={plan.job_name}", f"#SBATCH --nodes={plan.nodes}",
            f"#SBATCH --ntasks-per-node={plan.tasks_per_node}", f"#SBATCH --cpus-per-task={o.cpus_per_task}",
            f"#SBATCH --output={run_dir}/slurm/slurm-%j.out"]
    head += [f"#SBATCH --{k}={v}" for k, v in (("partition", o.partition), ("account", o.account),
                                                ("time", o.time)) if v]
    if o.gpus_per_node:
        head.append(f"#SBATCH --gpus-per-node={o.gpus_per_node}")
    head += [f"#SBATCH {a}" for a in o.sbatch_args]
    lines = head + [
        "# Rendered by `miles launch --slurm`: one srun step per role; the head (directory) step first.",
        "# Inside an allocation `miles launch --slurm` runs this file with bash instead of sbatch.",
        "set -uo pipefail",
        f"cd {_q(workdir)}",
        f"RUN={_q(run_dir)}",
        f"CONFIG={_q(config_path)}",
        'ADDR="$RUN/slurm/directory.addr"',
        f"PY={_q(python)}",
        f"MAX_RESTARTS={o.max_restarts}",
        f"DIRECTORY_WAIT_S={int(o.directory_wait_s)}",
        "export PYTHONUNBUFFERED=1",
        'mkdir -p "$RUN/logs" "$RUN/slurm"',
        '# a stale address from an earlier job would send the steps to a dead directory',
        'rm -f "$ADDR" "$RUN/slurm/exit_code"',
        "",
    ]
    master = plan.step("trainer").first_node
    for s in plan.steps:
        # --open-mode=append: a restarted step adds to its log; truncating it would erase the
        # lines of the incarnation that crashed (the evidence of why it was restarted)
        srun = ["srun", f"--job-name={s.role}", f"--nodes={s.num_nodes}", f"--ntasks={s.ntasks}",
                f"--relative={s.first_node}", "--exact", "--kill-on-bad-exit=1", "--open-mode=append",
                f"--cpus-per-task={o.cpus_per_task}", *s.extra]
        entry = ['"$PY"', "-m", "miles.launch.slurm_step", s.role, '--config "$CONFIG"',
                 '--directory-file "$ADDR"', f"--directory-wait-s {int(o.directory_wait_s)}"]
        if s.role == "trainer":
            entry += [f"--master-node {master}"] + ([f"--master-port {o.master_port}"] if o.master_port else [])
        # the trainer's stdout (rank 0's progress line) goes to the job's own output
        out = f'--{"error" if s.role == "trainer" else "output"}="$RUN/logs/{s.role}-%t.log"'
        # exec: the background job started for a step IS its srun, so a TERM to $! reaches srun
        lines.append(f"step_{s.role}() {{ exec {' '.join(_q(a) for a in srun)} {out} {' '.join(entry)}; }}")
    restartable = " ".join(s.role for s in plan.steps if s.role in ("engine", "rollout"))
    lines += [
        "",
        "declare -A NAME=() TRIES=()",
        'start() { "step_$1" & NAME[$!]=$1; echo "miles: step $1 started (srun pid $!)"; }',
        "# Graceful stop: SIGTERM to a step's tasks (scancel JOB.STEP, found by step name), so they drain",
        "# and unregister; srun itself turns a SIGTERM into a hard kill, so it only gets one after 20 s.",
        "# (Slurm 22.05's scancel reports a spurious 'Invalid job id' after signalling a step: ignored.)",
        "in_list() { [[ \" ${*:2} \" == *\" $1 \"* ]]; }",
        "stop_steps() {",
        "  local p sid sname live t=0",
        '  while read -r sid sname; do in_list "$sname" "$@" && { scancel -s TERM "$sid" 2>/dev/null || :; }; done \\',
        '    < <(squeue -h -s -j "${SLURM_JOB_ID:-0}" -o "%i %j" 2>/dev/null)',
        "  while :; do",
        '    live=""',
        '    for p in "${!NAME[@]}"; do in_list "${NAME[$p]}" "$@" && kill -0 "$p" 2>/dev/null && live="$live $p"; done',
        '    [ -z "$live" ] && break',
        '    if [ "$t" -ge 100 ]; then kill -TERM $live 2>/dev/null; break; fi',
        "    sleep 0.2; t=$((t + 1))",
        "  done",
        '  for p in "${!NAME[@]}"; do in_list "${NAME[$p]}" "$@" && { wait "$p"; unset "NAME[$p]"; }; done',
        "  return 0",
        "}",
        "# the head goes last so the other steps can still unregister from the directory",
        "stop_all() { stop_steps engine rollout trainer; stop_steps head; }",
        'finish() { echo "$1" > "$RUN/slurm/exit_code"; echo "miles: job exit code $1"; exit "$1"; }',
        "trap 'echo \"miles: interrupted\" >&2; stop_all; finish 130' INT TERM",
        "",
        "start head; HEAD_PID=$!",
        "waited=0",
        'until [ -s "$ADDR" ]; do',
        '  if ! kill -0 "$HEAD_PID" 2>/dev/null; then',
        '    echo "miles: the head step exited before writing $ADDR; see $RUN/logs/head-0.log" >&2; wait; finish 1',
        "  fi",
        '  if [ "$waited" -ge $((DIRECTORY_WAIT_S * 5)) ]; then',
        '    echo "miles: no directory address in $ADDR after ${DIRECTORY_WAIT_S}s" >&2; stop_all; finish 1',
        "  fi",
        "  sleep 0.2; waited=$((waited + 1))",
        "done",
        'echo "miles: directory at $(cat "$ADDR")"',
        *[f"start {s.role}" for s in plan.steps if s.role != "head"],
        "",
        "rc=0",
        "while :; do",
        "  fin=''",
        '  wait -n -p fin "${!NAME[@]}"; code=$?',
        '  if [ -z "$fin" ]; then [ "$code" = 127 ] && { rc=1; break; }; continue; fi  # 127: no step left',
        '  name=${NAME[$fin]}; unset "NAME[$fin]"',
        '  if [ "$name" = trainer ]; then rc=$code; echo "miles: trainer step exited with $code"; break; fi',
        f'  if [[ " {restartable} " == *" $name "* ]] && [ "${{TRIES[$name]:-0}}" -lt "$MAX_RESTARTS" ]; then',
        '    TRIES[$name]=$(( ${TRIES[$name]:-0} + 1 ))',
        '    echo "miles: step $name exited with $code; restart ${TRIES[$name]}/$MAX_RESTARTS" >&2',
        '    start "$name"; continue',
        "  fi",
        '  echo "miles: step $name exited with $code before the trainer finished; see $RUN/logs/$name-*.log" >&2',
        "  rc=$(( code == 0 ? 1 : code )); break",
        "done",
        "stop_all",
        'finish "$rc"',
    ]
    return "\n".join(lines) + "\n"
