#!/usr/bin/env bash
# Start Prometheus with stepmem's config on loopback, the remote-write receiver on.
#   deploy/prometheus/run.sh [DATA_DIR] [LISTEN]    (defaults: /tmp/stepmem-prometheus 127.0.0.1:9090)
# Then: stepmem run --targets deploy/prometheus/targets/stepmem.json \
#                   --remote-write http://127.0.0.1:9090/api/v1/write
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
data=${1:-/tmp/stepmem-prometheus}
listen=${2:-127.0.0.1:9090}
mkdir -p "$data" "$here/targets"
exec prometheus --config.file="$here/prometheus.yml" --storage.tsdb.path="$data" \
  --web.listen-address="$listen" --web.enable-remote-write-receiver
