"""Entry of one srun task: `python -m miles.launch.slurm_step ROLE --config ... --directory-file F`.

Turns the task's Slurm facts into what a role process needs, then runs it:
- the address to bind: the config's `transport.interface`, or, when that is loopback
  and the job spans several nodes, the address this node's Slurm name resolves to;
  a NIC name (e.g. "ib0") is resolved to that NIC's IPv4 address on each node;
- `head`: runs the directory and writes its address to F (on the shared filesystem);
- other roles: wait for F, then start `miles.launch.role` with index = SLURM_PROCID, a ready
  file `RUN/logs/ROLE-PROCID.ready` (the supervisor's sign that the task served) and,
  for trainer ranks, RANK/WORLD_SIZE, LOCAL_RANK (see `local_rank`) and MASTER_ADDR (the trainer step's
  first node, from SLURM_JOB_NODELIST) / MASTER_PORT (given, or 20000 + job id % 10000).
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import ipaddress
import json
import os
import socket
import struct
import sys
import time
from pathlib import Path

from miles.core.config import from_dict, to_dict
from miles.core.errors import ConfigError, MilesError
from miles.core.logging import configure_logging, get_logger
from miles.core.schema import MilesConfig
from miles.core.slurm_env import SlurmEnv

log = get_logger("miles.slurm_step")
MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 10000
_SIOCGIFADDR = 0x8915


def nic_address(name: str) -> str:
    """IPv4 address of network interface `name` on this host."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            nics = ", ".join(n for _, n in socket.if_nameindex())
            raise ConfigError(f"transport.interface={name!r}: no IPv4 address on this node "
                              f"({exc.strerror}); interfaces here: {nics}") from None
    return socket.inet_ntoa(packed[20:24])


def bind_address(interface: str, env: SlurmEnv) -> str:
    """The address this task binds and advertises (see the module docstring)."""
    try:
        ip = ipaddress.ip_address(interface)
    except ValueError:
        return nic_address(interface)
    if ip.is_loopback and env.num_nodes > 1:
        if not env.node_name:
            raise ConfigError("SLURMD_NODENAME is not set: cannot find this node's address")
        try:
            return socket.gethostbyname(env.node_name)
        except OSError as exc:
            raise ConfigError(f"node name {env.node_name!r} does not resolve ({exc}): set "
                              "transport.interface to a NIC name such as 'ib0'") from None
    return interface


def master_port(given: int, env: SlurmEnv) -> int:
    return given or MASTER_PORT_BASE + env.port_offset(MASTER_PORT_SPAN)


def local_rank(env: SlurmEnv, visible_devices: str) -> int:
    """The GPU index this task uses among those it sees.

    With per-task GPU binding (`--gpus-per-task=1`) each task sees one device, index 0;
    with node-wide visibility it is the task's rank on the node (SLURM_LOCALID).
    """
    local = env.local_id or 0
    n = len([d for d in visible_devices.split(",") if d.strip()])
    return local % n if n else local


def wait_for_address(path: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and (text := path.read_text().strip()):
            return text
        time.sleep(0.2)
    raise ConfigError(f"no directory address in {path} after {timeout_s:.0f}s: is the head step running, "
                      "and is the run directory on a filesystem every node shares?")


def _step_config(cfg: MilesConfig, cfg_path: Path, role: str, env: SlurmEnv) -> tuple[MilesConfig, Path]:
    addr = bind_address(cfg.transport.interface, env)
    if addr == cfg.transport.interface:
        return cfg, cfg_path
    cfg = dataclasses.replace(cfg, transport=dataclasses.replace(cfg.transport, interface=addr))
    out = Path(cfg.run.dir) / "slurm" / f"config.{role}-{env.proc_id}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(to_dict(cfg), indent=1))
    return cfg, out


def _run_head(cfg: MilesConfig, ready_file: Path) -> int:
    import uvloop

    from miles.actors.runtime.host import Host
    from miles.actors.runtime.process import serve

    async def nothing(host: Host) -> None:
        return None

    return uvloop.run(serve(nothing, cfg=cfg.transport, run_directory=True, ready_file=str(ready_file)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="miles-slurm-step")
    ap.add_argument("role", choices=["head", "engine", "rollout", "trainer"])
    ap.add_argument("--config", required=True, help="resolved config JSON written by `miles launch`")
    ap.add_argument("--directory-file", required=True, help="where the head step writes its address")
    ap.add_argument("--directory-wait-s", type=float, default=300.0)
    ap.add_argument("--master-node", type=int, default=0, help="allocation index of trainer rank 0's node")
    ap.add_argument("--master-port", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        env = SlurmEnv.from_environ()
        if not env.in_step:
            raise ConfigError("not inside an srun step (SLURM_STEP_ID / SLURM_PROCID unset): "
                              "this entry is started by the script `miles launch --slurm` renders")
        cfg = from_dict(MilesConfig, json.loads(Path(a.config).read_text()))
        configure_logging(cfg.run.log_level, cfg.run.json_logs, run=cfg.run.name, role=a.role, rank=env.proc_id)
        cfg, cfg_path = _step_config(cfg, Path(a.config), a.role, env)
        ready = Path(a.directory_file)
        log.info("slurm_step", role=a.role, index=env.proc_id, node=env.node_name,
                 interface=cfg.transport.interface, job=env.job_id)
        if a.role == "head":
            return _run_head(cfg, ready)
        directory = wait_for_address(ready, a.directory_wait_s)
        os.environ["MILES_DIRECTORY"] = directory
        if a.role == "trainer":
            hosts = env.hosts()
            if not 0 <= a.master_node < len(hosts):
                raise ConfigError(f"--master-node {a.master_node} is outside the job's {len(hosts)} nodes")
            os.environ.update(MASTER_ADDR=hosts[a.master_node], MASTER_PORT=str(master_port(a.master_port, env)),
                              RANK=str(env.proc_id), WORLD_SIZE=str(env.ntasks or 1),
                              LOCAL_RANK=str(local_rank(env, os.environ.get("CUDA_VISIBLE_DEVICES", ""))))
    except MilesError as exc:
        print(f"miles slurm step {a.role}: error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 2
    from miles.launch.role import main as role_main

    # its ready file tells the supervisor (launch/slurm_supervisor.py) that it served once
    ready_file = Path(cfg.run.dir) / "logs" / f"{a.role}-{env.proc_id}.ready"
    return role_main([a.role, "--config", str(cfg_path), "--index", str(env.proc_id), "--directory", directory,
                      "--ready", str(ready_file)])


if __name__ == "__main__":
    sys.exit(main())
