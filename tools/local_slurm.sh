#!/usr/bin/env bash
# A real Slurm cluster on this one host, for tests, CI and demos (Debian 12, slurm-wlm 22.05, as root).
#
#   tools/local_slurm.sh up [--nodes N] [--root DIR]   install if needed, start munge + slurmctld + N slurmd
#   tools/local_slurm.sh status [--root DIR]
#   tools/local_slurm.sh down [--root DIR]             stop the daemons this script started (by PID file)
#
# `up` is idempotent and ends by printing the line to paste: export SLURM_CONF=<root>/etc/slurm.conf
# Emulated nodes n1..nN all run on this host (Debian's build has MULTIPLE_SLURMD), each with its own
# slurmd port, spool and TmpFS, so `srun -N2 -n4` really spans two Slurm nodes.
set -euo pipefail

cmd=${1:-}
[ $# -gt 0 ] && shift
ROOT=${REFLOW_SLURM_ROOT:-/tmp/reflow-slurm}
NODES=2
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) NODES=$2; shift 2 ;;
    --root) ROOT=$2; shift 2 ;;
    *) echo "local_slurm.sh: unknown argument '$1' (usage: up [--nodes N] [--root DIR] | status | down)" >&2; exit 2 ;;
  esac
done
case "$NODES" in ''|*[!0-9]*|0) echo "local_slurm.sh: --nodes must be a positive integer, got '$NODES'" >&2; exit 2 ;; esac
CONF=$ROOT/etc/slurm.conf
MUNGE_PID=$ROOT/munge/munged.pid
export SLURM_CONF=$CONF

log() { echo "local_slurm: $*" >&2; }

alive() {  # alive PIDFILE -> 0 when the pid in it runs
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_packages() {
  local need=()
  for b in slurmctld slurmd sinfo munged; do command -v "$b" >/dev/null 2>&1 || need+=("$b"); done
  [ ${#need[@]} -eq 0 ] && return 0
  log "installing Slurm and munge (missing: ${need[*]})"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge libpmix2 >/dev/null
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return 0   # someone's munged already answers; we neither start nor later stop it
  fi
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  # munged refuses a root-owned setup unless run as its own user, who must be able to write the
  # PID file: it lives in a directory of munge's own (without it, `down` could not find munged).
  mkdir -p "$ROOT/munge"
  chown munge:munge "$ROOT/munge"
  runuser -u munge -- /usr/sbin/munged --pid-file="$MUNGE_PID"
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge >/dev/null || { log "munged did not come up"; exit 1; }
  for _ in $(seq 50); do [ -s "$MUNGE_PID" ] && break; sleep 0.1; done
  [ -s "$MUNGE_PID" ] || { log "munged wrote no PID file at $MUNGE_PID"; exit 1; }
  touch "$ROOT/munged.ours"
}

write_conf() {
  local hw mem nodes_conf="" names=""
  # CPUs/sockets/cores exactly as slurmd sees them, else slurmd drains itself.
  hw=$(slurmd -C | head -1 | sed 's/^NodeName=[^ ]* //; s/ *RealMemory=[0-9]*//; s/ *UpTime=.*//')
  mem=$(( $(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p') * 8 / 10 / NODES ))
  for i in $(seq 1 "$NODES"); do
    nodes_conf+="NodeName=n$i NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$((17100 + i)) $hw RealMemory=$mem State=UNKNOWN"$'\n'
    mkdir -p "$ROOT/tmp/n$i" "$ROOT/spool/n$i"
  done
  cat > "$CONF" <<EOF
# Written by tools/local_slurm.sh: $NODES emulated node(s) on $(hostname).
ClusterName=reflowlocal
SlurmctldHost=localhost
SlurmctldPort=17099
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool/%n
SlurmctldPidFile=$ROOT/slurmctld.pid
SlurmdPidFile=$ROOT/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
TmpFS=$ROOT/tmp/%n
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$ROOT/log/jobcomp.txt
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
$nodes_conf
PartitionName=debug Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  echo "$NODES" > "$ROOT/nodes"
}

up() {
  if [ -f "$ROOT/nodes" ] && alive "$ROOT/slurmctld.pid"; then
    local have; have=$(cat "$ROOT/nodes")
    if [ "$have" != "$NODES" ]; then
      log "already running with $have node(s) under $ROOT; run 'tools/local_slurm.sh down' first"; exit 1
    fi
    local all=1
    for i in $(seq 1 "$NODES"); do alive "$ROOT/slurmd-n$i.pid" || all=0; done
    if [ $all = 1 ]; then
      log "already up ($NODES node(s))"
      echo "export SLURM_CONF=$CONF"
      return 0
    fi
  fi
  install_packages
  if ! alive "$ROOT/slurmctld.pid"; then
    # A fresh controller starts from empty state: a job recovered from an earlier cluster (a test
    # killed mid-run, a requeued job) would hold the nodes allocated and the next start would fail.
    rm -rf "$ROOT/state" "$ROOT/spool"
  fi
  mkdir -p "$ROOT"/{etc,state,spool,log,tmp}
  start_munge
  write_conf
  alive "$ROOT/slurmctld.pid" || slurmctld
  for i in $(seq 1 "$NODES"); do alive "$ROOT/slurmd-n$i.pid" || slurmd -N "n$i"; done
  for _ in $(seq 120); do
    [ "$(sinfo -h -o '%t' 2>/dev/null | sort -u | tr -d '\n')" = "idle" ] && break
    sleep 0.25
  done
  if [ "$(sinfo -h -o '%t' 2>/dev/null | sort -u | tr -d '\n')" != "idle" ]; then
    sinfo >&2 || true
    log "nodes did not become idle; logs in $ROOT/log"; exit 1
  fi
  log "up: $NODES node(s), partition debug, state in $ROOT"
  echo "export SLURM_CONF=$CONF"
}

down() {
  local stopped=0 p
  for p in "$ROOT"/slurmd-*.pid "$ROOT/slurmctld.pid"; do
    [ -f "$p" ] || continue
    if alive "$p"; then kill "$(cat "$p")" && stopped=$((stopped + 1)); fi
  done
  if [ -f "$ROOT/munged.ours" ] && alive "$MUNGE_PID"; then
    kill "$(cat "$MUNGE_PID")" && stopped=$((stopped + 1))
    rm -f "$ROOT/munged.ours"
  fi
  for _ in $(seq 50); do
    local any=0
    for p in "$ROOT"/slurmd-*.pid "$ROOT/slurmctld.pid" "$MUNGE_PID"; do alive "$p" && any=1; done
    [ $any = 0 ] && break
    sleep 0.1
  done
  rm -f "$ROOT/nodes"
  log "stopped $stopped daemon(s)"
}

status() {
  local p
  for p in "$ROOT/slurmctld.pid" "$ROOT"/slurmd-*.pid "$MUNGE_PID"; do
    [ -f "$p" ] || continue
    if alive "$p"; then echo "$(basename "$p" .pid): running (pid $(cat "$p"))"; else echo "$(basename "$p" .pid): not running"; fi
  done
  if alive "$ROOT/slurmctld.pid"; then sinfo; echo "export SLURM_CONF=$CONF"; else echo "local Slurm is down"; return 1; fi
}

case "$cmd" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: tools/local_slurm.sh up [--nodes N] [--root DIR] | status | down" >&2; exit 2 ;;
esac
