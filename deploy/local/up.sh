#!/usr/bin/env bash
# Local quick start on one machine, all on loopback: a Ray head, Prometheus with stepmem's
# config and alert rules (remote-write receiver on), and Alertmanager with stepmem's routing.
#   deploy/local/up.sh            # then submit jobs (printed below); deploy/local/down.sh stops all
# Ports and the state folder can be moved with STEPMEM_LOCAL_DIR, STEPMEM_RAY_PORT,
# STEPMEM_DASHBOARD_PORT, STEPMEM_AGENT_PORT (the head's job agent), STEPMEM_PROM_PORT,
# STEPMEM_AM_PORT; STEPMEM_RAY_TEMP_DIR puts the head's session (logs, sockets) there instead
# of Ray's default folder shared with every other Ray on the machine (keep it short: Ray's socket
# paths must fit 107 characters); STEPMEM_UP_TIMEOUT_S bounds each readiness wait (60 s). A stack
# that is already up, a port another program holds or one inside Ray's worker-port range is
# refused before anything starts; if anything does not come up (a head that exits at once is
# seen at once), what was started is stopped again.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=${STEPMEM_LOCAL_DIR:-/tmp/stepmem-local}
ray_port=${STEPMEM_RAY_PORT:-6379}
dash_port=${STEPMEM_DASHBOARD_PORT:-8265}
agent_port=${STEPMEM_AGENT_PORT:-52365}
prom_port=${STEPMEM_PROM_PORT:-9090}
am_port=${STEPMEM_AM_PORT:-9093}
# the project's own Ray and Python (the venv's), whatever is first on PATH
venv="$root/.venv/bin"
ray_bin=${RAY_BIN:-$([ -x "$venv/ray" ] && echo "$venv/ray" || command -v ray || echo ray)}
py_bin=$([ -x "$venv/python" ] && echo "$venv/python" || command -v python3)
# Debian names the Alertmanager binary prometheus-alertmanager
alertmanager=$(command -v alertmanager || command -v prometheus-alertmanager || echo alertmanager)
ray_temp=${STEPMEM_RAY_TEMP_DIR:-}
mkdir -p "$dir" "$root/deploy/prometheus/targets"
# how to reach this stack again: down.sh needs the folder when it is not the default
if [ "$dir" = /tmp/stepmem-local ]; then down_cmd="deploy/local/down.sh"
else down_cmd="STEPMEM_LOCAL_DIR=$dir deploy/local/down.sh"; fi

# Refuse a second stack (its readiness checks would be answered by the first, and down.sh
# would then stop the wrong one) and ports held by anything else, before starting anything.
for name in ray prometheus alertmanager; do
  pid=$(cat "$dir/$name.pid" 2>/dev/null || true)
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    echo "a stack is already up in $dir ($name pid $pid); $down_cmd stops it" >&2
    exit 1
  fi
done
busy=$("$py_bin" - "$ray_port" "$dash_port" "$agent_port" "$prom_port" "$am_port" <<'PY'
import socket, sys
for port in map(int, sys.argv[1:]):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            print(port)
PY
)
# Ray gives its workers ports 10002-19999 by default and refuses a component port among them,
# after its head has started (up.sh then waited for it in vain)
for port in "$ray_port" "$dash_port" "$agent_port"; do
  if [ "$port" -ge 10002 ] && [ "$port" -le 19999 ]; then
    echo "port $port lies in Ray's worker-port range (10002-19999), which Ray keeps for its" \
         "workers; give STEPMEM_RAY_PORT, STEPMEM_DASHBOARD_PORT and STEPMEM_AGENT_PORT ports" \
         "outside it" >&2
    exit 1
  fi
done
if [ -n "$busy" ]; then
  echo "port(s) $(echo $busy) on 127.0.0.1 are in use by another program; stop it or move this" \
       "stack (STEPMEM_RAY_PORT, STEPMEM_DASHBOARD_PORT, STEPMEM_AGENT_PORT, STEPMEM_PROM_PORT," \
       "STEPMEM_AM_PORT)" >&2
  exit 1
fi

# Prometheus reads the project's config as is, with the Alertmanager address of this stack.
sed "s/127.0.0.1:9093/127.0.0.1:$am_port/" "$root/deploy/prometheus/prometheus.yml" \
  > "$root/deploy/prometheus/.local.yml"
prometheus --config.file="$root/deploy/prometheus/.local.yml" --storage.tsdb.path="$dir/prometheus" \
  --web.listen-address="127.0.0.1:$prom_port" --web.enable-remote-write-receiver \
  --log.level=warn > "$dir/prometheus.log" 2>&1 &
echo $! > "$dir/prometheus.pid"
"$alertmanager" --config.file="$root/deploy/alertmanager/alertmanager.yml" \
  --storage.path="$dir/alertmanager" --web.listen-address="127.0.0.1:$am_port" \
  --cluster.listen-address= --log.level=warn > "$dir/alertmanager.log" 2>&1 &
echo $! > "$dir/alertmanager.pid"
# The Ray head in the foreground of its own session (--block), so down.sh stops this head only.
# A script's background job starts with SIGINT ignored, and `ray start --block` would keep it
# so: SIGINT is set back to its default first, and down.sh's Ctrl-C stops the head in order.
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_JOB_STOP_WAIT_TIME_S=${RAY_JOB_STOP_WAIT_TIME_S:-30} \
  setsid python3 -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL)
os.execvp(sys.argv[1], sys.argv[1:])' "$ray_bin" start --head --block --node-ip-address=127.0.0.1 --dashboard-host=127.0.0.1 \
  --port="$ray_port" --dashboard-port="$dash_port" --dashboard-agent-listen-port="$agent_port" \
  ${ray_temp:+--temp-dir="$ray_temp"} --disable-usage-stats > "$dir/ray.log" 2>&1 &
echo $! > "$dir/ray.pid"
echo "127.0.0.1:$ray_port" > "$dir/ray.address"

# Anything below that fails stops what this script started (down.sh) before exiting.
up=0
trap '[ "$up" = 1 ] || STEPMEM_LOCAL_DIR="$dir" "$root/deploy/local/down.sh" >/dev/null 2>&1' EXIT

# Ray (2.60, the pinned version) starts a head with token authentication when RAY_AUTH_MODE=token
# or, with RAY_AUTH_MODE unset, when a token exists (any earlier local `ray.init()` writes
# ~/.ray/auth_token): the dashboard then answers 401 without "Authorization: Bearer <token>".
# Ray's CLI finds the token itself (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, else
# ~/.ray/auth_token); so does this check.
ready() {  # up to STEPMEM_UP_TIMEOUT_S (60 s); exit 3 when the server answers but refuses our
  # credentials, 4 when the process that should answer ($2, a pid) has exited
  "$py_bin" - "$1" "${STEPMEM_UP_TIMEOUT_S:-60}" "${2:-0}" <<'PY'
import os, sys, time, urllib.error, urllib.request
from pathlib import Path

def exited(pid):
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie (an init that does not reap) has exited too
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False

def token():
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    return path.read_text().strip() if path.is_file() else None

refused = False
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    if exited(int(sys.argv[3])):
        sys.exit(4)
    req = urllib.request.Request(sys.argv[1])
    if token():  # read each time: a new head writes its token as it starts
        req.add_header("Authorization", f"Bearer {token()}")
    try:
        urllib.request.urlopen(req, timeout=2).read()
        sys.exit(0)
    except urllib.error.HTTPError as e:
        refused = e.code in (401, 403)
        time.sleep(0.5)
    except OSError:
        time.sleep(0.5)
sys.exit(3 if refused else 1)
PY
}
ready "http://127.0.0.1:$prom_port/-/ready" "$(cat "$dir/prometheus.pid")" || { echo "Prometheus did not start: $dir/prometheus.log"; exit 1; }
ready "http://127.0.0.1:$am_port/-/ready" "$(cat "$dir/alertmanager.pid")" || { echo "Alertmanager did not start: $dir/alertmanager.log"; exit 1; }
rc=0; ready "http://127.0.0.1:$dash_port/api/version" "$(cat "$dir/ray.pid")" || rc=$?
if [ "$rc" = 3 ]; then
  echo "Ray started with token authentication but its token was not found (RAY_AUTH_TOKEN," \
       "RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token); stopped it. Set RAY_AUTH_MODE=disabled for a" \
       "loopback-only stack, or put the token where Ray looks: $dir/ray.log"
  exit 1
elif [ "$rc" = 4 ]; then
  echo "Ray's head exited at once; the end of $dir/ray.log:"
  tail -n 5 "$dir/ray.log" | cut -c1-300
  exit 1
elif [ "$rc" != 0 ]; then
  echo "Ray did not start: $dir/ray.log"
  exit 1
fi
# The head takes jobs through its agent, which starts a little after the dashboard; when the
# agent cannot bind its port it stays up without it, and every submit fails with a 500.
ready "http://127.0.0.1:$agent_port/api/local_raylet_healthz" "$(cat "$dir/ray.pid")" || {
  echo "Ray's job agent did not come up on 127.0.0.1:$agent_port (jobs could not be" \
       "submitted): $dir/ray.log and the head's dashboard_agent log"
  exit 1
}
up=1
if "$py_bin" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
    "http://127.0.0.1:$dash_port/api/version" 2>/dev/null; then
  auth="off (the head found no token and RAY_AUTH_MODE is not token)"
  submit_env=""
else
  auth="on: RAY_AUTH_MODE=token lets the ray CLI and ray.init find the token (~/.ray/auth_token); browsers ask for \`ray get-auth-token\`"
  submit_env="RAY_AUTH_MODE=token "
fi
cat <<MSG
stepmem local stack up (state in $dir):
  Ray head       http://127.0.0.1:$dash_port   (GCS 127.0.0.1:$ray_port)
  Prometheus     http://127.0.0.1:$prom_port   (stepmem config, alert rules, remote-write receiver)
  Alertmanager   http://127.0.0.1:$am_port
  Ray token auth $auth
Submit a run (replay without a GPU, the real workload with one), from $root:
  ${submit_env}$ray_bin job submit --address http://127.0.0.1:$dash_port --working-dir . \\
      --runtime-env-json '{"excludes": ["benchmarks/results"]}' -- \\
      $py_bin -m collector.job \\
      --targets $root/deploy/prometheus/targets/stepmem.json \\
      --remote-write http://127.0.0.1:$prom_port/api/v1/write
Grafana: mount grafana/provisioning/* under /etc/grafana/provisioning/ and grafana/dashboards/
at /var/lib/grafana/dashboards/stepmem (see the README). Stop everything: $down_cmd
MSG
