#!/usr/bin/env bash
# A one-node Slurm cluster on this machine: the real scheduler the slow tests launch
# under (srun, sbatch --requeue, scontrol requeue), and a place to try an sbatch script.
#
#   scripts/slurm-cluster.sh up [--holder ID]     install when missing, configure, start
#   scripts/slurm-cluster.sh down [--holder ID] [--force]
#   scripts/slurm-cluster.sh status               exit 0 when it takes jobs
#   scripts/slurm-cluster.sh env                  prints `export SLURM_CONF=...`
#
# `up` needs root: it installs Debian's slurm-wlm and munge with apt-get when they are
# missing, writes the configuration under $SLURM_CLUSTER_DIR (default
# /var/lib/distlearn-slurm; /etc/slurm is left alone, so clients need SLURM_CONF, which
# `env` prints), and starts munged (unless one already answers), slurmctld and slurmd.
# The cluster is this host (NodeAddr 127.0.0.1, ports $SLURM_CLUSTER_PORT and the next
# one, default 16817/16818) with more CPUs than it has (oversubscribed, so `srun -n 5`
# runs on 2 cores), one partition `debug`, and requeue allowed. Jobs run as root's.
#
# Several users share one cluster: `up --holder ID` adds a holder (a pid, checked for
# life, or any name), `down --holder ID` removes it and stops the daemons only when no
# live holder is left (without --holder: the holder "manual"). `down --force` stops
# them whatever holds them. Every change is made under a lock.
set -euo pipefail

DIR="${SLURM_CLUSTER_DIR:-/var/lib/distlearn-slurm}"
PORT="${SLURM_CLUSTER_PORT:-16817}"
CONF="$DIR/slurm.conf"
CPUS=16 # what the node claims: srun -n up to 16 on any machine (SlurmdParameters=config_overrides)
export SLURM_CONF="$CONF"

say() { echo "slurm-cluster: $*" >&2; }
die() {
    say "$*"
    exit 1
}

alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# ---------------------------------------------------------------- install

install() {
    local need=()
    for bin in slurmctld slurmd srun munged; do
        command -v "$bin" >/dev/null || [[ -x "/usr/sbin/$bin" ]] || need=(slurm-wlm munge)
    done
    ((${#need[@]})) || return 0
    [[ "$(id -u)" == 0 ]] || die "slurm-wlm and munge are not installed, and only root can install them"
    command -v apt-get >/dev/null || die "slurm-wlm and munge are not installed, and there is no apt-get"
    say "apt-get install ${need[*]} (once; log in $DIR/apt.log)"
    mkdir -p "$DIR"
    if ! {
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}"
    } >"$DIR/apt.log" 2>&1; then
        tail -n 20 "$DIR/apt.log" >&2
        die "apt-get install ${need[*]} failed (see $DIR/apt.log)"
    fi
}

# ---------------------------------------------------------------- configuration

write_conf() {
    local host
    host="$(hostname -s)"
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
    cat >"$CONF.tmp" <<EOF
# Written by scripts/slurm-cluster.sh: a one-node cluster on this host.
ClusterName=distlearn
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
# No cgroups: a container may have none to give; processes are tracked by parentage.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# The node claims $CPUS CPUs whatever it has: a test's 5 tasks fit on 2 cores.
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
# The grace between a job's SIGTERM (scancel, scontrol requeue, its time limit) and SIGKILL.
KillWait=30
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
NodeName=$host NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
    mv "$CONF.tmp" "$CONF"
}

# ---------------------------------------------------------------- daemons

start_munge() {
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0 # one answers already (the system's): use it, and leave it running
    fi
    [[ -s /etc/munge/munge.key ]] || {
        mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null ||
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=128 status=none
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    }
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    chmod 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged 9>&-
    touch "$DIR/munged.ours"
    for _ in $(seq 50); do
        munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    die "munged did not answer (see /var/log/munge/munged.log)"
}

node_state() { sinfo -h -N -o %T 2>/dev/null | head -n 1; }

# (9>&- on each daemon: one that inherited the lock's descriptor would hold the lock
# for as long as it runs)
start() {
    start_munge
    if ! alive "$DIR/slurmctld.pid"; then
        rm -rf "${DIR:?}/state"/* # a fresh controller: no job of an earlier run comes back
        /usr/sbin/slurmctld -c -f "$CONF" 9>&- || die "slurmctld failed to start (see $DIR/log/slurmctld.log)"
    fi
    if ! alive "$DIR/slurmd.pid"; then
        /usr/sbin/slurmd -f "$CONF" 9>&- || die "slurmd failed to start (see $DIR/log/slurmd.log)"
    fi
    local state=""
    for _ in $(seq 150); do
        state="$(node_state)"
        case "$state" in
        idle* | mixed* | allocated*) return 0 ;;
        down* | drain*) scontrol update NodeName="$(hostname -s)" State=RESUME 2>/dev/null || true ;;
        esac
        sleep 0.2
    done
    die "the node is not taking jobs after 30 s (state: ${state:-none}; see $DIR/log/)"
}

stop_pid() { # pidfile: SIGTERM, then SIGKILL after 10 s
    local pidfile="$1" pid
    alive "$pidfile" || {
        rm -f "$pidfile"
        return 0
    }
    pid="$(cat "$pidfile")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pidfile"
}

stop() {
    if alive "$DIR/slurmctld.pid"; then
        scancel --full --quiet $(squeue -h -o %i 2>/dev/null) 2>/dev/null || true
        for _ in $(seq 100); do # let the steps end before their slurmd does
            [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break
            sleep 0.1
        done
    fi
    stop_pid "$DIR/slurmd.pid"
    stop_pid "$DIR/slurmctld.pid"
    if [[ -f "$DIR/munged.ours" ]]; then
        stop_pid /run/munge/munged.pid
        rm -f "$DIR/munged.ours"
    fi
}

# ---------------------------------------------------------------- holders

live_holders() {
    [[ -f "$DIR/holders" ]] || return 0
    while read -r h; do
        [[ -z "$h" ]] && continue
        if [[ "$h" =~ ^[0-9]+$ ]] && ! kill -0 "$h" 2>/dev/null; then
            continue # a pid that has ended (a test run killed before its teardown)
        fi
        echo "$h"
    done <"$DIR/holders"
}

set_holders() { # the live holders, with $1 added (+ID) or removed (-ID)
    local change="$1" id="${1:1}"
    { live_holders | grep -vxF "$id" || true; } >"$DIR/holders.tmp"
    [[ "$change" == +* ]] && echo "$id" >>"$DIR/holders.tmp"
    mv "$DIR/holders.tmp" "$DIR/holders"
}

locked() { # run "$@" under the cluster's lock
    mkdir -p "$DIR"
    exec 9>"$DIR/lock"
    flock -w 120 9 || die "another slurm-cluster.sh holds $DIR/lock for more than 120 s"
    "$@"
}

# ---------------------------------------------------------------- commands

cmd_up() {
    [[ "$(id -u)" == 0 ]] || die "up needs root (it installs packages and starts daemons)"
    install
    if ! alive "$DIR/slurmctld.pid"; then
        write_conf
    fi
    start
    set_holders "+$HOLDER"
    say "up: $(node_state) ($(sinfo -h -o '%P %D nodes %c CPUs' | head -n 1)); export SLURM_CONF=$CONF"
}

cmd_down() {
    if [[ "$FORCE" == 1 ]]; then
        stop
        rm -f "$DIR/holders"
        say "down (forced)"
        return
    fi
    set_holders "-$HOLDER"
    local left
    left="$(live_holders | tr '\n' ' ')"
    if [[ -n "$left" ]]; then
        say "still held by: $left(left running)"
        return
    fi
    stop
    say "down"
}

cmd_status() {
    if ! alive "$DIR/slurmctld.pid" || ! alive "$DIR/slurmd.pid"; then
        say "not running"
        return 1
    fi
    local state
    state="$(node_state)"
    echo "node: ${state:-unknown}; holders: $(live_holders | tr '\n' ' ')"
    squeue
    case "$state" in idle* | mixed* | allocated*) return 0 ;; *) return 1 ;; esac
}

cmd="${1:-}"
shift || true
HOLDER=manual
FORCE=0
while (($#)); do
    case "$1" in
    --holder)
        HOLDER="${2:?--holder needs an id}"
        shift 2
        ;;
    --force)
        FORCE=1
        shift
        ;;
    *) die "unknown argument $1 (see the top of $0)" ;;
    esac
done
case "$cmd" in
up) locked cmd_up ;;
down) locked cmd_down ;;
status) cmd_status ;;
env) echo "export SLURM_CONF=$CONF" ;;
*) die "usage: $0 up|down|status|env [--holder ID] [--force]" ;;
esac
