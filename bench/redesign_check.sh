#!/usr/bin/env bash
# Issue 21's one H200 call: the engine-process parity (graphs and eager), HF parity, and the 1B
# fixed and lognormal throughput of this tree against the tree before the redesign (798cfba,
# unpacked by `git archive 798cfba | tar -x -C .before`, carried as .before), run alternately.
#   run: bash bench/redesign_check.sh 1   (parity, then after/before once), then ... 2 (after/before again)
set -uo pipefail
. bench/device_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
mkdir -p $OUT/after $OUT/before $OUT/after2 $OUT/before2 /tmp/ppb && ln -sfn "$PWD/.before" /tmp/ppb/pagestream
after() { (cd bench && python3 throughput.py --no-hf --workloads 1b-fixed,1b-lognormal --out $OUT/$1) 2>&1 | grep -v "leaked\|nanobind\|skipped" | tail -${2:-8}; }
before() { (cd .before/bench && PYTHONPATH=/tmp/ppb python3 throughput.py --no-hf --workloads 1b-fixed,1b-lognormal --out $OUT/$1) 2>&1 | grep -v "leaked\|nanobind\|skipped" | tail -${2:-8}; }
if [ "${1:-1}" = 1 ]; then
echo "== parity: engine process vs in-process"; (cd bench && python3 engine_process_parity.py --out $OUT/after && python3 engine_process_parity.py --enforce-eager --out $OUT/after) 2>&1 | grep '^{\|DIFF' 
echo "== parity: HF"; python3 bench/gpu_engine.py --skip-throughput --num-prompts 24 --out $OUT/after 2>&1 | grep -v "leaked\|nanobind\|skipped" | tail -4
echo "== after 1"; after after
echo "== before 1"; before before
else
echo "== after 2"; after after2 3
echo "== before 2"; before before2 3
fi
