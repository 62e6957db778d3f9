#!/usr/bin/env bash
# Issue 23 acceptance 5 (bench/structured.py) on this tree, run twice for the noise (first used on 18fdcd6, the
# batched-matcher tree, since reverted: BENCHMARKS.md), then issue 21's after/before throughput pair.
#   run: bash bench/structured_batch_check.sh   (needs .whl with xgrammar/pydantic, .before for the pair)
set -uo pipefail
. bench/device_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
for i in 1 2; do
  echo "== structured run $i"; mkdir -p $OUT/structured$i
  python3 bench/structured.py --out $OUT/structured$i 2>&1 | grep -v "leaked\|nanobind\|skipped" | grep -E "^[a-z_]+ \{|tok_per_s|Error|error" | head -12
done
bash bench/redesign_check.sh 2
