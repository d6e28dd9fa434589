#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for testing `cel grid --executor slurm` against a real Slurm
# (tests/test_slurm.py starts it through this script).
#
#   scripts/slurm-cluster.sh start    install what is missing (Debian packages), start the cluster, wait until the
#                                     node is idle; fast when it already runs
#   scripts/slurm-cluster.sh stop     stop the daemons this script started (the state folder stays)
#   scripts/slurm-cluster.sh status   sinfo, or exit 1 when the cluster is not running
#   scripts/slurm-cluster.sh env      the line to source before using it by hand: export SLURM_CONF=...
#
# The cluster is private to this script: its own configuration ($CEL_SLURM_DIR, default /var/tmp/cel-slurm, used
# through SLURM_CONF), its own ports and its own accounting database, so a system Slurm is never touched. It has
# slurmctld, slurmd, and slurmdbd on a private MariaDB, because submitit learns from `sacct` that a job ended
# without a result (cancelled, killed, out of time): a real cluster has job accounting, and without it such a job
# would look pending for ever. One node (this machine's hostname, CPUs and memory, as `slurmd -C` reports them),
# one partition, no GPUs.
#
# Exit status: 0 running, 1 not running (status), 2 bad usage, 77 cannot run here (not root, no apt-get, or a
# daemon failed to start): the message says why, and the test skips (in CI, with CI=true, it fails instead).
set -uo pipefail

DIR=${CEL_SLURM_DIR:-/var/tmp/cel-slurm}
CONF=$DIR/slurm.conf
CLUSTER=celtest
PARTITION=debug
CTLD_PORT=6917 SLURMD_PORT=6918 DBD_PORT=6919 DB_PORT=6920  # not Slurm's defaults: never a system cluster's
DB_PASSWORD=cel-slurm-test  # a MariaDB bound to 127.0.0.1 that holds nothing but this test cluster's accounting
NODE=$(hostname -s)
export SLURM_CONF=$CONF

say() { echo "slurm-cluster: $*"; }
skip() { say "SKIP: $*"; exit 77; }

pidfile() {  # MariaDB runs as mysql: its files sit in its own folder
  case $1 in mariadb) echo "$DIR/mysql/mariadb.pid" ;; *) echo "$DIR/$1.pid" ;; esac
}

running() {  # running NAME: the daemon NAME started here is alive
  local file
  file=$(pidfile "$1")
  [ -s "$file" ] && kill -0 "$(cat "$file")" 2>/dev/null
}

node_state() { sinfo -h -n "$NODE" -o %T 2>/dev/null | head -1; }

healthy() {  # the node takes jobs and accounting answers
  running slurmctld && running slurmd && running slurmdbd || return 1
  case "$(node_state)" in idle* | mixed* | allocated* | completing*) ;; *) return 1 ;; esac
  sacct -n -X -S now >/dev/null 2>&1
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...: poll every 0.5 s
  local seconds=$1 what=$2
  shift 2
  for _ in $(seq $((seconds * 2))); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  say "gave up waiting for $what after ${seconds} s; the logs' ends ($DIR/log/, $DIR/mysql/mariadb.log):"
  tail -n 8 "$DIR"/log/*.log "$DIR/mysql/mariadb.log" 2>/dev/null | sed 's/^/    /'
  return 1
}

install_packages() {
  local missing=()
  for pair in slurmctld:slurmctld slurmd:slurmd slurmdbd:slurmdbd sbatch:slurm-client munged:munge \
    mariadbd:mariadb-server; do
    command -v "${pair%%:*}" >/dev/null || PATH=$PATH:/usr/sbin command -v "${pair%%:*}" >/dev/null ||
      missing+=("${pair#*:}")
  done
  [ ${#missing[@]} = 0 ] && return 0
  command -v apt-get >/dev/null || skip "Slurm is not installed (${missing[*]}) and there is no apt-get to install it"
  say "installing ${missing[*]} (apt-get)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}"; } >"$DIR/log/apt.log" 2>&1 || skip "apt-get install ${missing[*]} failed; see $DIR/log/apt.log"
}

start_munge() {  # reuse a running munged (its key is this machine's); else start one
  munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null ||
      dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge && chown munge:munge /run/munge
  runuser -u munge -- /usr/sbin/munged --force 9>&- || skip "munged failed to start"
  pgrep -u munge -n munged >"$DIR/munged.pid"  # started here: stop ends it
  wait_for 10 munge sh -c 'munge -n | unmunge' || skip "munge does not answer"
}

sql() { mariadb --socket="$DIR/mysql/mysql.sock" -u root -e "$1"; }

start_database() {
  if [ ! -d "$DIR/mysql/mysql" ]; then
    mkdir -p "$DIR/mysql" && chown mysql:mysql "$DIR/mysql"
    mariadb-install-db --user=mysql --datadir="$DIR/mysql" --auth-root-authentication-method=socket \
      >"$DIR/log/mariadb-install.log" 2>&1 || skip "mariadb-install-db failed; see $DIR/log/mariadb-install.log"
  fi
  if ! running mariadb; then
    /usr/sbin/mariadbd --user=mysql --datadir="$DIR/mysql" --socket="$DIR/mysql/mysql.sock" \
      --pid-file="$(pidfile mariadb)" --log-error="$DIR/mysql/mariadb.log" --bind-address=127.0.0.1 --port=$DB_PORT \
      --skip-log-bin >/dev/null 2>&1 9>&- &
    wait_for 60 MariaDB sql "SELECT 1" || skip "MariaDB failed to start"
  fi
  sql "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASSWORD';
       GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" || skip "could not create the accounting database user"
}

write_config() {  # $DIR/slurm.conf and slurmdbd.conf; CONFIG_CHANGED=1 when they differ from the ones before
  local hardware
  hardware=$(slurmd -C 2>/dev/null | grep '^NodeName=' | sed 's/ *UpTime=.*//')
  [ -n "$hardware" ] || skip "slurmd -C could not describe this machine"
  cat >"$CONF.new" <<EOF
# Written by scripts/slurm-cluster.sh: a one-node test cluster. Regenerated on start.
ClusterName=$CLUSTER
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
# processes tracked by parentage, no cgroups: works inside containers
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
KillWait=5
# a requeued job (preemption, time limit) waits cred_expire seconds (120 by default), then the next scheduling pass
AuthInfo=cred_expire=5
SchedulerParameters=sched_interval=2,bf_interval=2
MinJobAge=600
$hardware NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  cat >"$DIR/slurmdbd.conf.new" <<EOF
# Written by scripts/slurm-cluster.sh
AuthType=auth/munge
DbdAddr=127.0.0.1
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$DIR/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASSWORD
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$DIR/slurmdbd.conf.new"
  CONFIG_CHANGED=
  for file in "$CONF" "$DIR/slurmdbd.conf"; do
    cmp -s "$file.new" "$file" || CONFIG_CHANGED=1
    mv "$file.new" "$file"
  done
}

stop_daemons() {
  local name pid
  for name in slurmd slurmctld slurmdbd mariadb munged; do
    running $name || continue
    pid=$(cat "$(pidfile $name)")
    kill "$pid" 2>/dev/null
    for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
    say "stopped $name ($pid)"
  done
  rm -f "$DIR/munged.pid"
}

start() {
  [ "$(id -u)" = 0 ] || skip "starting a Slurm cluster needs root (packages, daemons); run as root, as CI does"
  mkdir -p "$DIR"/{state,spool,log}
  exec 9>"$DIR/lock"
  flock 9  # two starts at once (parallel tests) wait for each other; daemons start with 9>&- so as not to hold it
  install_packages
  write_config
  if [ -z "$CONFIG_CHANGED" ] && healthy; then
    say "running (node $NODE $(node_state)); export SLURM_CONF=$CONF"
    return 0
  fi
  [ -z "$CONFIG_CHANGED" ] || stop_daemons  # daemons of an older configuration
  start_munge
  start_database
  running slurmdbd || /usr/sbin/slurmdbd 9>&- || skip "slurmdbd failed to start; see $DIR/log/slurmdbd.log"
  wait_for 30 slurmdbd sacctmgr -n show cluster || skip "slurmdbd does not answer"
  [ -n "$(sacctmgr -n -P show cluster format=cluster "$CLUSTER")" ] ||
    sacctmgr -i add cluster "$CLUSTER" >/dev/null || skip "could not register cluster $CLUSTER with slurmdbd"
  running slurmctld || /usr/sbin/slurmctld 9>&- || skip "slurmctld failed to start; see $DIR/log/slurmctld.log"
  running slurmd || /usr/sbin/slurmd 9>&- || skip "slurmd failed to start; see $DIR/log/slurmd.log"
  wait_for 30 "the node to register" sh -c '[ -n "$(sinfo -h -n '"$NODE"' -o %T)" ]' || skip "the node never registered"
  case "$(node_state)" in down* | drain* | fail*) scontrol update nodename="$NODE" state=resume ;; esac
  wait_for 60 "node $NODE to be idle" healthy || skip "the cluster did not become ready"
  say "running (node $NODE $(node_state)); export SLURM_CONF=$CONF"
}

case "${1:-}" in
  start) start ;;
  stop) stop_daemons ;;
  status) healthy && sinfo && exit 0; say "not running"; exit 1 ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
