#!/usr/bin/env bash
# Local quick start on one machine, all on loopback: a Ray head, Prometheus with stepmem's
# config and alert rules (remote-write receiver on), and Alertmanager with stepmem's routing.
#   deploy/local/up.sh            # then submit jobs (printed below); deploy/local/down.sh stops all
# Ports and the state folder can be moved with STEPMEM_LOCAL_DIR, STEPMEM_RAY_PORT,
# STEPMEM_DASHBOARD_PORT, STEPMEM_PROM_PORT, STEPMEM_AM_PORT.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=${STEPMEM_LOCAL_DIR:-/tmp/stepmem-local}
ray_port=${STEPMEM_RAY_PORT:-6379}
dash_port=${STEPMEM_DASHBOARD_PORT:-8265}
prom_port=${STEPMEM_PROM_PORT:-9090}
am_port=${STEPMEM_AM_PORT:-9093}
ray_bin=${RAY_BIN:-$(command -v ray || echo "$root/.venv/bin/ray")}
# Debian names the Alertmanager binary prometheus-alertmanager
alertmanager=$(command -v alertmanager || command -v prometheus-alertmanager || echo alertmanager)
mkdir -p "$dir" "$root/deploy/prometheus/targets"

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
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_JOB_STOP_WAIT_TIME_S=${RAY_JOB_STOP_WAIT_TIME_S:-30} \
  setsid "$ray_bin" start --head --block --node-ip-address=127.0.0.1 --dashboard-host=127.0.0.1 \
  --port="$ray_port" --dashboard-port="$dash_port" --disable-usage-stats \
  > "$dir/ray.log" 2>&1 &
echo $! > "$dir/ray.pid"
echo "127.0.0.1:$ray_port" > "$dir/ray.address"

ready() {  # up to 60 s
  python3 - "$1" <<'PY'
import sys, time, urllib.request
for _ in range(120):
    try:
        urllib.request.urlopen(sys.argv[1], timeout=2).read()
        sys.exit(0)
    except OSError:
        time.sleep(0.5)
sys.exit(1)
PY
}
ready "http://127.0.0.1:$prom_port/-/ready" || { echo "Prometheus did not start: $dir/prometheus.log"; exit 1; }
ready "http://127.0.0.1:$am_port/-/ready" || { echo "Alertmanager did not start: $dir/alertmanager.log"; exit 1; }
ready "http://127.0.0.1:$dash_port/api/version" || { echo "Ray did not start: $dir/ray.log"; exit 1; }
cat <<MSG
stepmem local stack up (state in $dir):
  Ray head       http://127.0.0.1:$dash_port   (GCS 127.0.0.1:$ray_port)
  Prometheus     http://127.0.0.1:$prom_port   (stepmem config, alert rules, remote-write receiver)
  Alertmanager   http://127.0.0.1:$am_port
Submit a run (replay without a GPU, the real workload with one):
  ray job submit --address http://127.0.0.1:$dash_port --working-dir . -- python -m collector.job \\
      --targets $root/deploy/prometheus/targets/stepmem.json \\
      --remote-write http://127.0.0.1:$prom_port/api/v1/write
Grafana: mount grafana/provisioning/* under /etc/grafana/provisioning/ and grafana/dashboards/
at /var/lib/grafana/dashboards/stepmem (see the README). Stop everything: deploy/local/down.sh
MSG
