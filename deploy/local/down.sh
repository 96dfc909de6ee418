#!/usr/bin/env bash
# Stop what deploy/local/up.sh started (only that: other Ray clusters on the machine stay).
set -uo pipefail
dir=${STEPMEM_LOCAL_DIR:-/tmp/stepmem-local}
# running, not a zombie: the script that started it has exited, and an init that does not reap
# (some containers) leaves an exited child as a zombie that `kill -0` still finds
alive() { kill -0 "$1" 2>/dev/null && [ "$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null)" != Z ]; }
session_alive() { ps -s "$1" -o stat= 2>/dev/null | grep -qv '^Z'; }  # any of session $1 running
found=0
for name in ray prometheus alertmanager; do
  pidfile="$dir/$name.pid"
  [ -f "$pidfile" ] || continue
  found=1
  pid=$(cat "$pidfile")
  if [ "$name" = ray ]; then
    # The head runs in a session of its own (setsid): Ctrl-C to it, `ray start --block` stops
    # its processes in order; whatever of that session is still there after 30 s is killed.
    kill -INT -- "-$pid" 2>/dev/null
    for _ in $(seq 60); do session_alive "$pid" || break; sleep 0.5; done
    session_alive "$pid" && pkill -KILL -s "$pid" 2>/dev/null
  else
    kill "$pid" 2>/dev/null
    for _ in $(seq 60); do alive "$pid" || break; sleep 0.5; done
    alive "$pid" && kill -KILL "$pid" 2>/dev/null
  fi
  rm -f "$pidfile"
  echo "stopped $name"
done
# `ray start` named this head in Ray's current-cluster file; a stopped head must not stay there
# (a later bare `ray.init()` on this machine would wait for it).
if [ -f "$dir/ray.address" ] && [ "$(cat /tmp/ray/ray_current_cluster 2>/dev/null)" = "$(cat "$dir/ray.address")" ]; then
  rm -f /tmp/ray/ray_current_cluster
fi
rm -f "$dir/ray.address"
if [ "$found" = 0 ]; then
  echo "no stack found in $dir (nothing stopped): a stack up.sh started with STEPMEM_LOCAL_DIR" \
       "set needs the same STEPMEM_LOCAL_DIR here" >&2
fi
