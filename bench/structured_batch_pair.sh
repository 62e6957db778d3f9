#!/usr/bin/env bash
# Issue 23 acceptance 5, the batch matcher (branch batch-matcher), one device call: first the mask's host time alone
# (bench/structured_mask_host.py: this tree's matchers stepped one by one against its batch calls over 1-8 threads,
# same masks), then bench/structured.py on the tree before (.before, `git archive 018e71b`) and on this tree,
# alternately, twice each, and a table of the four.
#   run (repo root, carried .whl with xgrammar 0.2.9, apache-tvm-ffi, pydantic, pydantic-core, annotated-types,
#   typing-inspection; and .before):  bash bench/structured_batch_pair.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
nproc
grep -q batch_fill_next_token_bitmask engine/structured_output/manager.py && ! grep -q batch_fill .before/engine/structured_output/manager.py \
  || { echo "the trees are not the pair this script expects"; exit 1; }
one() {  # tree label
  echo "== $2"
  (cd "$1" && . bench/device_env.sh && timeout 125 python3 bench/structured.py --out "$OUT/$2" 2>&1 \
    | grep -v "leaked\|nanobind\|skipped" | grep -E "^[a-z_]+ \{|Error|error|Traceback" | cut -c1-400)
}
echo "== mask host time alone"
(. bench/device_env.sh && timeout 100 python3 bench/structured_mask_host.py --steps 60 --out "$OUT/mask" 2>&1 | grep -v nanobind)
for i in $(seq 1 ${PAIRS:-2}); do
  one .before "before$i"
  one . "after$i"
done
python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
print(f"{'run':8} {'json s':>7} {'sync s':>7} {'l4l s':>7} {'l4l':>5} {'l4l sync':>8} {'mask ms a/s':>12} {'valid':>5}")
for name in ("before1", "after1", "before2", "after2"):
    p = os.path.join(out, name, "structured.json")
    if not os.path.exists(p):
        print(name, "missing"); continue
    r = json.load(open(p))
    j, s, u = r["json_schema"], r["json_schema_sync"], r["unconstrained_same_lens"]
    print(f"{name:8} {j['s']:7.3f} {s['s']:7.3f} {u['s']:7.3f} {r['ratio_tok_per_s_same_lens']:5.2f} "
          f"{r['ratio_tok_per_s_sync_same_lens']:8.2f} {j['mask_host_ms_per_masked_step']:5.2f}/{s['mask_host_ms_per_masked_step']:.2f}"
          f" {j['finished_valid_json']:5d}")
EOF
