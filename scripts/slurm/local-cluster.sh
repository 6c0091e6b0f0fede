#!/usr/bin/env bash
# A real Slurm cluster on this one host, for tests of `miles launch --slurm`:
# Debian's slurm-wlm + munge, one slurmctld and N slurmd processes (virtual nodes
# n1..nN, all on 127.0.0.1). Needs root and apt (Debian 12: Slurm 22.05). No systemd needed.
#
#   scripts/slurm/local-cluster.sh [start]   install if missing, configure, start, wait until idle
#   scripts/slurm/local-cluster.sh stop      stop the slurm daemons this script started (by PID file)
#   scripts/slurm/local-cluster.sh status
#
# Environment: MILES_SLURM_NODES (2), MILES_SLURM_CPUS (4 advertised per node; may exceed the
# real cores), MILES_SLURM_TIMEOUT (60 s to reach idle), MILES_SLURM_RESTART (1 = always restart).
#
# Why it is set up this way:
#   * Debian's slurmd is built with multiple-slurmd support, so `slurmd -N nX` per node works;
#     each gets its own port and spool dir; the node names resolve via /etc/hosts to 127.0.0.1.
#   * SlurmdParameters=config_overrides lets CPUs= exceed the machine, so a 2-core box can host
#     steps of several tasks without --overcommit.
#   * proctrack/linuxproc + task/none: no cgroups, which containers rarely delegate.
#   * No accounting daemon: job state is read with squeue/scontrol; state is wiped on every
#     (re)start, so job ids begin at 1 again.
set -euo pipefail

ACTION=${1:-start}
NODES=${MILES_SLURM_NODES:-2}
CPUS=${MILES_SLURM_CPUS:-4}
TIMEOUT=${MILES_SLURM_TIMEOUT:-60}
RESTART=${MILES_SLURM_RESTART:-0}
CTLD_PORT=6817
SLURMD_PORT0=6818
CONF=/etc/slurm/slurm.conf
STATE=/var/spool/miles-slurm
LOGS=/var/log/miles-slurm
PIDS=/run/miles-slurm

say() { echo "[local-slurm] $*" >&2; }
fail() {
  say "ERROR: $*"
  for f in "$LOGS"/*.log; do [ -f "$f" ] && { echo "--- $f" >&2; tail -n 20 "$f" >&2; }; done
  exit 1
}
[ "$(id -u)" = 0 ] || { echo "local-cluster.sh: needs root" >&2; exit 1; }
HOST=$(hostname -s)
names() { seq -f "n%g" 1 "$NODES"; }

install_pkgs() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null &&
    command -v munged >/dev/null && return 0
  command -v apt-get >/dev/null || fail "slurm is not installed and apt-get is unavailable"
  say "apt-get install slurm-wlm munge"
  # No init system here: keep package scripts from starting daemons (we start our own).
  local own_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; own_policy=1
  fi
  local rc=0
  { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge \
      >/dev/null; } || rc=$?
  [ "$own_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
  [ "$rc" = 0 ] || fail "apt-get install slurm-wlm munge failed (rc=$rc)"
}

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  munge_works && return 0
  [ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /etc/munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
  chmod 700 /etc/munge; chmod 400 /etc/munge/munge.key; chmod 755 /run/munge
  # A munged that died hard leaves its pid file and socket behind, and a new one refuses to start.
  if [ -f /run/munge/munged.pid ] && ! kill -0 "$(cat /run/munge/munged.pid)" 2>/dev/null; then
    rm -f /run/munge/munged.pid /run/munge/munge.socket.2*
  fi
  runuser -u munge -- /usr/sbin/munged || fail "munged did not start"   # it refuses to run as root
  for _ in $(seq 50); do munge_works && return 0; sleep 0.1; done
  fail "munge credentials do not round-trip"
}

render_conf() {
  cat <<EOF
# written by miles scripts/slurm/local-cluster.sh: a one-host test cluster on loopback
ClusterName=milesci
SlurmctldHost=${HOST}(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
KillWait=5
StateSaveLocation=${STATE}/ctld
SlurmdSpoolDir=${STATE}/slurmd-%n
SlurmctldPidFile=${PIDS}/slurmctld.pid
SlurmdPidFile=${PIDS}/slurmd-%n.pid
SlurmctldLogFile=${LOGS}/slurmctld.log
SlurmdLogFile=${LOGS}/slurmd-%n.log
EOF
  local i=0 n
  for n in $(names); do
    echo "NodeName=$n NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((SLURMD_PORT0 + i)) CPUs=$CPUS RealMemory=1000 State=UNKNOWN"
    i=$((i + 1))
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
}

# PIDs from our own PID files, only if the process is alive and is a slurm daemon.
our_pids() {
  local f p
  for f in "$PIDS"/*.pid; do
    [ -f "$f" ] || continue
    p=$(cat "$f" 2>/dev/null || true)
    [ -n "$p" ] && kill -0 "$p" 2>/dev/null && grep -q '^slurm' "/proc/$p/comm" 2>/dev/null && echo "$p"
  done
  return 0
}

stop_daemons() {
  local pids p alive
  pids=$(our_pids)
  if [ -n "$pids" ]; then
    say "stopping $(echo "$pids" | tr '\n' ' ')"
    for p in $pids; do kill "$p" 2>/dev/null || true; done
    for _ in $(seq 100); do
      alive=""
      for p in $pids; do
        kill -0 "$p" 2>/dev/null && [ "$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)" != Z ] && alive="$alive $p"
      done
      [ -z "$alive" ] && break
      sleep 0.1
    done
    for p in $alive; do kill -9 "$p" 2>/dev/null || true; done
  fi
  rm -f "$PIDS"/*.pid
}

idle() {
  local want got
  want=$(names | sort | tr '\n' ' ')
  got=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2=="idle"{print $1}' | sort -u | tr '\n' ' ') || return 1
  [ "$want" = "$got" ]
}

port_taken() { ss -Hltn "sport = :$1" 2>/dev/null | grep -q .; }

start_daemons() {
  local n i=0
  rm -rf "$STATE"
  mkdir -p "$STATE/ctld" "$LOGS" "$PIDS"
  port_taken "$CTLD_PORT" && fail "port $CTLD_PORT is taken (another slurmctld?)"
  for n in $(names); do
    mkdir -p "$STATE/slurmd-$n"
    port_taken $((SLURMD_PORT0 + i)) && fail "port $((SLURMD_PORT0 + i)) is taken (another slurmd?)"
    i=$((i + 1))
  done
  slurmctld -c -f "$CONF" || fail "slurmctld did not start"
  for n in $(names); do slurmd -N "$n" -f "$CONF" || fail "slurmd -N $n did not start"; done
  local deadline=$((SECONDS + TIMEOUT))
  until idle; do
    [ "$SECONDS" -lt "$deadline" ] || { sinfo -N >&2 || true; fail "nodes not idle after ${TIMEOUT}s"; }
    sleep 0.2
  done
}

case "$ACTION" in
  stop) stop_daemons; exit 0 ;;
  status) sinfo -N || true; echo "pids: $(our_pids | tr '\n' ' ')"; exit 0 ;;
  start) ;;
  *) echo "usage: $0 [start|stop|status]" >&2; exit 2 ;;
esac

t0=$SECONDS
install_pkgs
mkdir -p /etc/slurm "$PIDS" "$LOGS"
for n in $(names); do
  getent hosts "$n" >/dev/null 2>&1 || echo "127.0.0.1 $n   # miles local-cluster.sh" >>/etc/hosts
done
start_munge
want=$(mktemp)
render_conf >"$want"
if [ "$RESTART" != 1 ] && cmp -s "$want" "$CONF" && [ "$(our_pids | wc -l)" -eq $((NODES + 1)) ] && idle; then
  say "already up"
  rm -f "$want"
else
  stop_daemons
  install -m 644 "$want" "$CONF" 2>/dev/null || { cp "$want" "$CONF"; chmod 644 "$CONF"; }
  rm -f "$want"
  start_daemons
fi
out=$(timeout 60 srun -N"$NODES" -n"$NODES" --ntasks-per-node=1 -t 1 bash -c 'echo "$SLURMD_NODENAME"') ||
  fail "smoke test srun across $NODES nodes failed"
say "up in $((SECONDS - t0))s: nodes $(echo $out | tr '\n' ' ')(config $CONF, logs $LOGS)"
