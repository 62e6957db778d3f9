#!/usr/bin/env bash
# Issues 38 and 23 (acceptance 5) on a GPU machine, in two device calls that each stay under 600 s:
#   bash bench/device_session_check.sh pair   # issue 38: bench/serving_pair.py, this tree against .before (798cfba), 2 pairs
#   bash bench/device_session_check.sh rest   # issue 23 acc. 5: bench/structured.py on this tree; then issue 38's flood
# Carry .whl (bench/fetch_device_wheels.sh; plus .whl/xg/ with xgrammar 0.2.9 and apache-tvm-ffi 0.1.15.post2,
# installed to /tmp/site-xg and put on PYTHONPATH for the structured run alone, so the gateway runs as
# gateway_device_check.sh has it, without xgrammar) and .before (`git archive 798cfba | tar -x -C .before`).
# The serving step is gateway_device_check.sh's; the flood is bench/device_flood.sh, on db 2 of the machine's own redis-server.
set -uo pipefail
mode=${1:-pair}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. bench/device_env.sh
nproc; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null || true

if [ "$mode" = pair ]; then
  echo "== serving pair (issue 38)"
  timeout 560 python3 bench/serving_pair.py --tree . --against .before --pairs 2 --max-wall-s 460 --out "$OUT" 2>&1 \
    | tee "$OUT/serving_pair.log"
  exit 0
fi

if [ "$mode" = rest ]; then
  echo "== structured (issue 23 acceptance 5)"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-xg .whl/xg/*.whl \
    || echo "xgrammar install failed"
  (export PYTHONPATH="$PYTHONPATH:/tmp/site-xg"; timeout 200 python3 bench/structured.py --out "$OUT/structured" \
    > "$OUT/structured.log" 2>&1; echo "structured.py rc=$?")
  grep -v "leaked\|nanobind\|skipped" "$OUT/structured.log" | grep -E "^[a-z_]+ \{|Error|error|Traceback" | cut -c1-600
  python3 - "$OUT/structured/structured.json" <<'EOF'
import json, os, sys
p = sys.argv[1]
if not os.path.exists(p):
    print("structured.json missing"); sys.exit(0)
r = json.load(open(p))
print("gpu", r.get("gpu"))
for k in ("unconstrained", "json_schema", "json_schema_sync", "unconstrained_same_lens", "unconstrained_again"):
    x = r[k]
    print(f"{k:24} s={x['s']:.3f} tok={x['output_tokens']} tok/s={x['tok_per_s']:.1f} mask_ms/step={x['mask_host_ms_per_masked_step']}"
          f" masked_steps={x['masked_steps']} wait_ms={x['wait_for_step_in_flight_ms_total']:.1f}"
          f" valid={x.get('finished_valid_json')} finish={x.get('finish_reasons')}")
for k in ("ratio_tok_per_s", "ratio_tok_per_s_same_lens", "ratio_tok_per_s_sync", "ratio_tok_per_s_sync_same_lens",
          "unconstrained_repeat_ratio", "same_lens_output_tokens_equal", "json_async_sync_identical_requests", "compile", "stats"):
    print(k, r.get(k))
EOF
  echo "== flood (issue 38 / 37)"
  bash bench/device_flood.sh 45 redis://127.0.0.1:6379/2
  redis-cli -p 6379 shutdown nosave >/dev/null 2>&1 || python3 -c "import redis; redis.Redis(port=6379).shutdown(nosave=True)" 2>/dev/null
  exit 0
fi
echo "mode: pair | rest"; exit 2
