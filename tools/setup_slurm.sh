#!/usr/bin/env bash
# A real two-node Slurm cluster on this machine, for examples/slurm/gyre_multinode.sbatch and the
# tests/slurm tier: Debian's slurm-wlm daemons (built with multiple-slurmd support) and munge.
#
#   bash tools/setup_slurm.sh          # install (apt, once) and start; the last line is SLURM_CONF=<path>
#   bash tools/setup_slurm.sh --stop   # stop the daemons it started (state and logs stay)
#
# One slurmctld and two slurmd (`slurmd -N n1`, `slurmd -N n2`, each on its own port), nodes n1 and n2
# of 2 CPUs each in the partition `local`; n1 and n2 resolve through /etc/hosts to 127.0.0.1 and
# 127.0.0.2.  Processes are tracked through /proc (proctrack/linuxproc, task/none: no cgroups).
# munged runs on its own socket and key.  Everything it writes but the /etc/hosts lines lives under
# GYRE_SLURM_DIR (default ~/.cache/gyre/slurm): slurm.conf, the munge key, state, spool, logs, pids.
# A requeued job may start again 21 s after `scontrol requeue` (cred_expire=20; Slurm's default is 120).
# Client commands find the cluster through SLURM_CONF: `export "$(bash tools/setup_slurm.sh | tail -n 1)"`.
# Starting again is a no-op while the daemons run and slurm.conf is unchanged (a change restarts them).
# Needs root (apt, /etc/hosts, daemons).
set -euo pipefail
DIR="${GYRE_SLURM_DIR:-$HOME/.cache/gyre/slurm}"
CONF="$DIR/slurm.conf"
CTLD_PORT="${GYRE_SLURM_PORT:-6917}"  # slurmctld; slurmd of n1 and n2 on the next two ports
NODES=(n1 n2)
ADDRS=(127.0.0.1 127.0.0.2)

log() { echo "setup_slurm: $*" >&2; }
running() {  # process $1 runs (an exited, unreaped zombie does not)
  local stat
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  [[ "${stat##*) }" != Z* ]]
}
alive() { [[ -f "$1" ]] && running "$(cat "$1")"; }  # the daemon of pid file $1 runs

stop_pidfile() {  # stop the daemon whose pid file is $1 (only that process, by its id)
  local f="$1" pid
  [[ -f "$f" ]] || return 0
  pid="$(cat "$f")"
  if [[ -n "$pid" ]] && running "$pid"; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do running "$pid" || break; sleep 0.1; done
    running "$pid" && kill -9 "$pid" 2>/dev/null
  fi
  rm -f "$f"
}

if [[ "${1:-}" == "--stop" ]]; then
  if [[ -f "$CONF" ]] && command -v scancel >/dev/null; then
    SLURM_CONF="$CONF" scancel --quiet --full --partition local 2>/dev/null || true  # the cluster's jobs
  fi
  for n in "${NODES[@]}"; do stop_pidfile "$DIR/slurmd-$n.pid"; done
  stop_pidfile "$DIR/slurmctld.pid"
  stop_pidfile "$DIR/munged.pid"
  log "stopped (state and logs under $DIR)"
  exit 0
elif [[ $# -gt 0 ]]; then
  echo "usage: bash tools/setup_slurm.sh [--stop]" >&2
  exit 2
fi

if [[ "$(id -u)" != 0 ]]; then
  echo "setup_slurm: error: run as root (installs packages, edits /etc/hosts, starts slurmd)" >&2
  exit 1
fi
if ! command -v slurmd >/dev/null || ! command -v slurmctld >/dev/null || ! command -v sbatch >/dev/null \
   || ! command -v munged >/dev/null; then
  log "installing slurmctld, slurmd, slurm-client and munge (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >&2
fi

for i in "${!NODES[@]}"; do  # node names resolve (the job's rendezvous address is the first node's name)
  if ! grep -qE "^[0-9.]+[[:space:]]+(.*[[:space:]])?${NODES[$i]}([[:space:]]|$)" /etc/hosts; then
    echo "${ADDRS[$i]} ${NODES[$i]}" >> /etc/hosts
  fi
done

mkdir -p "$DIR"/{state,log,spool/n1,spool/n2,munge}
chmod 700 "$DIR/munge"
if [[ ! -s "$DIR/munge/munge.key" ]]; then
  dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$DIR/munge/munge.key"
fi
HOST="$(hostname -s)"
cat > "$CONF.tmp" <<EOF
# Written by tools/setup_slurm.sh: two slurmd on this machine (n1, n2), one slurmctld.
ClusterName=gyre-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=20
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdTimeout=30
KillWait=5
InactiveLimit=0
MinJobAge=600
JobRequeue=1
NodeName=n1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 1)) CPUs=2 RealMemory=8000 State=UNKNOWN
NodeName=n2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 2)) CPUs=2 RealMemory=8000 State=UNKNOWN
PartitionName=local Nodes=n1,n2 Default=YES MaxTime=INFINITE OverSubscribe=FORCE:2 State=UP
EOF
changed=0
cmp -s "$CONF.tmp" "$CONF" || changed=1
mv "$CONF.tmp" "$CONF"
export SLURM_CONF="$CONF"


if ! alive "$DIR/munged.pid"; then
  munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed"
fi
if [[ "$changed" == 1 ]]; then  # a running cluster takes a new slurm.conf on a restart (jobs keep running)
  for n in "${NODES[@]}"; do stop_pidfile "$DIR/slurmd-$n.pid"; done
  stop_pidfile "$DIR/slurmctld.pid"
fi
if ! alive "$DIR/slurmctld.pid"; then
  slurmctld -f "$CONF"  # daemonises; keeps its state in $DIR/state
fi
for n in "${NODES[@]}"; do
  if ! alive "$DIR/slurmd-$n.pid"; then
    slurmd -f "$CONF" -N "$n"
  fi
done

for _ in $(seq 60); do  # both nodes registered and usable
  states="$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u || true)"
  if [[ "$states" =~ n1\ (idle|mix|alloc) ]] && [[ "$states" =~ n2\ (idle|mix|alloc) ]]; then
    log "ready: $(echo "$states" | tr '\n' ' ')(logs in $DIR/log)"
    echo "SLURM_CONF=$CONF"
    exit 0
  fi
  if [[ "$states" =~ (down|drain) ]]; then  # e.g. after an unclean stop: bring the nodes back
    scontrol update nodename=n1,n2 state=resume >/dev/null 2>&1 || true
  fi
  sleep 1
done
echo "setup_slurm: error: the nodes did not become idle within 60 s: ${states:-no answer from slurmctld} (see $DIR/log)" >&2
exit 1
