#!/usr/bin/env bash
# Issues 38 and 37 in one GPU-machine call (16 cores there, against the dev VM's 2):
#  1. bench/serving_pair.py: this tree's gateway + worker against 798cfba's (carried as .before:
#     `git archive 798cfba | tar -x -C .before`), alternately, PAIRS (default 2) runs each;
#  2. bench/gateway_flood.py: the flood of the worst bodies for SECONDS (default 45) with the gateway's
#     body checker processes (default 2), then with none (checked in a thread), on a redis-server of its own.
#   run (repo root, .whl from bench/fetch_device_wheels.sh):  bash bench/gateway_device_check.sh [SECONDS] [PAIRS]
set -uo pipefail
. bench/device_env.sh
secs=${1:-45}
pairs=${2:-2}
nproc; nvidia-smi --query-gpu=name --format=csv,noheader
echo "== serving pair"
python3 bench/serving_pair.py --tree . --against .before --pairs "$pairs" --max-wall-s 300 --out $OUT 2>&1 | tail -16
bash bench/device_flood.sh "$secs"
