#!/usr/bin/env bash
# The flood of the worst bodies (issue 37, acceptance 2) on the GPU machine's CPUs: bench/gateway_flood.py for
# SECONDS with the gateway's body checker processes (2), then with none (checked in a thread), on a redis-server of
# its own on port 6379 (REDIS_URL picks the db; gateway_flood.py's default is db 13). Each run's JSON and log go to
# $OUT. Called by bench/gateway_device_check.sh and bench/device_session_check.sh, after `. bench/device_env.sh`.
#   run (repo root):  bash bench/device_flood.sh [SECONDS] [REDIS_URL]
set -uo pipefail
secs=${1:-45}
url=${2:-redis://127.0.0.1:6379/13}
OUT=${OUT:-/tmp/out}
redis-server --port 6379 --bind 127.0.0.1 --save '' --appendonly no --daemonize yes >/dev/null
python3 -c "import redis, time
for _ in range(100):
    try: redis.Redis(port=6379).ping(); break
    except redis.ConnectionError: time.sleep(0.1)"
for checkers in 2 0; do
  echo "== flood, body_check_processes=$checkers"
  timeout $((secs + 105)) python3 bench/gateway_flood.py --seconds "$secs" --clients 4 --checkers $checkers --redis-url "$url" \
    --out "$OUT/gateway_flood_checkers$checkers.json" > "$OUT/gateway_flood_checkers$checkers.log" 2>&1 \
    || tail -20 "$OUT/gateway_flood_checkers$checkers.log"
  python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))" "$OUT/gateway_flood_checkers$checkers.json"
done
