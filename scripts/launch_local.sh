#!/usr/bin/env bash
# Starts one run as N processes on this machine, as a multi-host run would start them.
#
#   scripts/launch_local.sh N [--log_dir=DIR] -- train.py --config=... --workdir=DIR [ARGS...]
#
# Each process gets JAX_COORDINATOR_ADDRESS=localhost:PORT (a free port, or $COORDINATOR_PORT),
# JAX_NUM_PROCESSES=N and its own JAX_PROCESS_ID, which train.py / eval.py read
# (fastpos.train.distributed). A command that starts with a *.py file runs under $PYTHON, else
# the repository's .venv, else python3 (as scripts/sweep.sh). Environment:
#   DEVICES_PER_PROCESS=K  each process sees K CPU devices (--xla_force_host_platform_device_count)
#   GPUS_PER_PROCESS=G     process i sees GPUs i*G..i*G+G-1 (CUDA_VISIBLE_DEVICES)
#   GRACE_S=S              seconds the others get to stop after one fails (default 10), then
#                          they are killed
# Logs: process i writes stdout and stderr to DIR/process_<i>.log (default DIR: the command's
# --workdir plus "/launch_logs", else ./launch_logs); process 0's log is also shown here.
# Ctrl-C / SIGTERM is forwarded to every process (train.py saves a checkpoint and exits 130 / 75).
# When a process fails, the others are stopped and the launcher exits with the failed one's
# code; otherwise with the processes' own code (0, or 130 / 75 after a forwarded signal). A process
# that loses another one (it died or froze) exits 5 (fastpos.train.errors.EXIT_PEER_LOST).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/python.sh"  # $root, $python

usage() {
  echo "usage: $0 N [--log_dir=DIR] -- train.py|eval.py|COMMAND [ARGS...]" >&2
  exit 2
}

[[ $# -ge 1 ]] || usage
n=$1
shift
if ! [[ $n =~ ^[1-9][0-9]*$ ]]; then
  echo "$0: N=$n is not a number of processes >= 1; e.g. $0 2 -- train.py ..." >&2
  exit 2
fi
log_dir=""
while [[ $# -gt 0 && $1 != "--" ]]; do
  case $1 in
    --log_dir=*) log_dir=${1#--log_dir=} ;;
    *) echo "$0: unknown option $1; options: --log_dir=DIR, then -- and the command (e.g. $0 2 -- train.py --config=...)." >&2
       exit 2 ;;
  esac
  shift
done
[[ $# -ge 2 && $1 == "--" ]] || usage
shift
cmd=("$@")
if [[ ${cmd[0]} == *.py ]]; then
  cmd=("$python" "${cmd[@]}")
fi
for k in DEVICES_PER_PROCESS GPUS_PER_PROCESS; do
  v=${!k:-}
  if [[ -n $v ]] && ! [[ $v =~ ^[1-9][0-9]*$ ]]; then
    echo "$0: $k=$v is not a count >= 1." >&2
    exit 2
  fi
done
grace=${GRACE_S:-10}
if ! [[ $grace =~ ^[0-9]+$ ]]; then
  echo "$0: GRACE_S must be an integer >= 0 (seconds); got '$grace'." >&2
  exit 2
fi
if [[ -n ${COORDINATOR_PORT:-} ]] && ! { [[ $COORDINATOR_PORT =~ ^[1-9][0-9]{0,4}$ ]] \
    && (( COORDINATOR_PORT <= 65535 )); }; then
  echo "$0: COORDINATOR_PORT must be an integer in [1, 65535]; got '$COORDINATOR_PORT'." >&2
  exit 2
fi

if [[ -z $log_dir ]]; then
  log_dir=./launch_logs
  for arg in "${cmd[@]}"; do
    [[ $arg == --workdir=* ]] && log_dir="${arg#--workdir=}/launch_logs"
  done
fi
mkdir -p "$log_dir" || exit 2

port=${COORDINATOR_PORT:-}
if [[ -z $port ]]; then
  # A port the kernel hands out as free (closed again at once: the coordinator binds it).
  port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])') || exit 2
fi

pids=()
set -m  # each process in its own process group: signals reach its children too
for ((i = 0; i < n; i++)); do
  (
    trap - TERM INT
    export JAX_COORDINATOR_ADDRESS="localhost:$port" JAX_NUM_PROCESSES="$n" JAX_PROCESS_ID="$i"
    if [[ -n ${DEVICES_PER_PROCESS:-} ]]; then
      export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$DEVICES_PER_PROCESS"
    fi
    if [[ -n ${GPUS_PER_PROCESS:-} ]]; then
      export CUDA_VISIBLE_DEVICES=$(seq -s, $((i * GPUS_PER_PROCESS)) $((i * GPUS_PER_PROCESS + GPUS_PER_PROCESS - 1)))
    fi
    exec "${cmd[@]}" >"$log_dir/process_$i.log" 2>&1
  ) &
  pids+=($!)
done
set +m
echo "launch_local: $n processes (coordinator localhost:$port), logs in $log_dir/process_<i>.log" >&2
tail -n +1 -F "$log_dir/process_0.log" 2>/dev/null &
tail_pid=$!

signal_all() {  # signal_all SIG: to every process still running (and its children)
  for pid in "${pids[@]}"; do
    kill -s "$1" -- "-$pid" 2>/dev/null
  done
}
running() {
  local pid
  for pid in "${pids[@]}"; do
    kill -0 "$pid" 2>/dev/null && return 0
  done
  return 1
}
forwarded=""
trap 'forwarded=TERM; signal_all TERM' TERM
trap 'forwarded=INT; signal_all INT' INT

code=0
failed=""
live=("${pids[@]}")
done_=()
remaining=$n
while ((remaining > 0)); do
  finished=""
  wait -n -p finished "${live[@]}" 2>/dev/null  # (bash's "Killed: <job source>" notices)
  status=$?
  [[ -z ${finished:-} ]] && continue  # a trapped signal interrupted the wait
  remaining=$((remaining - 1))
  live=()
  for ((j = 0; j < n; j++)); do
    [[ ${pids[j]} == "$finished" ]] && i=$j
    [[ ${pids[j]} != "$finished" && -z ${done_[j]:-} ]] && live+=("${pids[j]}")
  done
  done_[i]=1
  if ((status != 0 && code == 0)); then
    code=$status
    if [[ -z $forwarded ]]; then
      failed=$i
      how="exited with code $status"
      ((status > 128)) && how="was killed by signal $(kill -l $((status - 128))) (exit code $status)"
      echo "launch_local: process $i $how; stopping the others (log: $log_dir/process_$i.log)" >&2
      signal_all TERM
      (
        sleep "$grace"
        for pid in "${pids[@]}"; do kill -s KILL -- "-$pid" 2>/dev/null; done
      ) >/dev/null 2>&1 &
      killer=$!
    fi
  fi
done
[[ -n ${killer:-} ]] && kill "$killer" 2>/dev/null
kill "$tail_pid" 2>/dev/null
wait "$tail_pid" 2>/dev/null
if [[ -n $failed ]]; then
  echo "launch_local: process $failed failed (code $code); last lines of its log:" >&2
  tail -n 5 "$log_dir/process_$failed.log" >&2
  echo "launch_local: stopped: process $failed failed with code $code (its log:" \
    "$log_dir/process_$failed.log)" >&2
fi
running && signal_all KILL
exit "$code"
