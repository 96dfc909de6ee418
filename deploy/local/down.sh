#!/usr/bin/env bash
# Stop what deploy/local/up.sh started (only that: other Ray clusters on the machine stay).
set -uo pipefail
dir=${STEPMEM_LOCAL_DIR:-/tmp/stepmem-local}
for name in ray prometheus alertmanager; do
  pidfile="$dir/$name.pid"
  [ -f "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  if [ "$name" = ray ]; then
    kill -INT -- "-$pid" 2>/dev/null   # the head's session: `ray start --block` stops its processes
  else
    kill "$pid" 2>/dev/null
  fi
  for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -0 "$pid" 2>/dev/null && kill -KILL -- "-$pid" 2>/dev/null
  rm -f "$pidfile"
  echo "stopped $name"
done
# `ray start` named this head in Ray's current-cluster file; a stopped head must not stay there
# (a later bare `ray.init()` on this machine would wait for it).
if [ -f "$dir/ray.address" ] && [ "$(cat /tmp/ray/ray_current_cluster 2>/dev/null)" = "$(cat "$dir/ray.address")" ]; then
  rm -f /tmp/ray/ray_current_cluster
fi
rm -f "$dir/ray.address"
