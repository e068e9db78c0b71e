#!/usr/bin/env bash
# The one device run of the model (issues: GPU-ready without a GPU; on a
# lent GPU), in at most about 8 minutes on an H100, with only the working
# tree and the carried binary: no model file travels, the model runs on
# synthetic weights of the real files' shapes and formats.
#   1. scripts/gpu-sweep.sh: attention ceilings, lanes against stream,
#      splits, dtypes, paged against contiguous, the cascade, the CUDA twin
#      (in a `--features cuda` build), the driver's register counts;
#   2. `bench --only model --synthetic ARCH` for SmolLM2-135M, Gemma 3 270M
#      and the Llama-3-8B shape: prefill tokens/s, decode tokens/s by
#      batch, the attention share of a step, the dispatches of a decode
#      step, the split-K matmul against the tiled one;
#   3. `loadgen --sweep` on `serve --synthetic`: paged against the `max`
#      and `oracle` reservations, the paper's experiment where compute no
#      longer hides the pool.
# It prints one table of the model figures last and writes CSV under $OUT.
#
# Usage: scripts/gpu-run.sh [--small]
#   PAGEDATTN_BIN   the pagedattn binary (default target/release/pagedattn)
#   OUT             where the files go (default target/gpu-run)
# --small runs SmolLM2's shape at 2 layers, the quick bench and loadgen
# --quick on any adapter, to test the script itself (.ci/run runs it).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${PAGEDATTN_BIN:-target/release/pagedattn}
OUT=${OUT:-target/gpu-run}
mkdir -p "$OUT"
SMALL=0
[[ "${1:-}" == "--small" ]] && SMALL=1
if [[ ! -x "$BIN" ]]; then
  echo "gpu-run: $BIN is not an executable (build it first, or set PAGEDATTN_BIN)" >&2
  exit 1
fi
start=$(date +%s)
fail=0

# 1. The attention sweep (it finds the NVIDIA ICD and logs clocks itself).
echo "== attention: scripts/gpu-sweep.sh"
if [[ $SMALL -eq 1 ]]; then
  echo "(--small: the attention sweep is scripts/gpu-sweep.sh --small's own test; skipped here)"
else
  OUT="$OUT/sweep" PAGEDATTN_BIN="$BIN" timeout 330 bash scripts/gpu-sweep.sh >"$OUT/sweep.log" 2>&1 || fail=1
  tail -3 "$OUT/sweep.log"
fi
export PAGEDATTN_BACKEND=${PAGEDATTN_BACKEND:-vulkan} PAGEDATTN_REQUIRE_GPU=1

# 2. The model on synthetic weights, one shape at a time.
if [[ $SMALL -eq 1 ]]; then
  # Gemma 3's 262,144-row head and the 8B shape's 128,256-row one take a
  # minute each on a CPU adapter: the full run has them, --small does not
  # (model/tests/synthetic.rs runs a step of every shape).
  shapes=("smollm2-135m 2")
  quick=(--quick)
else
  shapes=("smollm2-135m" "gemma3-270m" "llama3-8b")
  quick=()
fi
echo "arch,layers,adapter,prefill_tokens_per_s,batch,decode_tokens_per_s,ms_per_step,attention_share,dispatches_per_step,matmul" >"$OUT/model.csv"
for s in "${shapes[@]}"; do
  read -r arch layers <<<"$s"
  args=(bench --only model --synthetic "$arch" --json "${quick[@]}")
  [[ -n "${layers:-}" ]] && args+=(--layers "$layers")
  echo "== model: pagedattn ${args[*]}"
  timeout 240 "$BIN" "${args[@]}" >"$OUT/model-$arch.json" 2>"$OUT/model-$arch.err"
  rc=$?
  [[ $rc -eq 124 ]] && echo "gpu-run: $arch: no result within 240 s" >>"$OUT/model-$arch.err"
  if [[ $rc -eq 0 ]]; then
    python3 - "$arch" "${layers:-all}" "$OUT/model-$arch.json" >>"$OUT/model.csv" <<'PY' || fail=1
import json, sys
arch, layers, path = sys.argv[1:4]
b = json.load(open(path))
m = b["model"] if "model" in b and isinstance(b["model"], dict) else b
for r in m["decode"]:
    share = r.get("attention_share")
    print(",".join(str(x) for x in [arch, layers, m["adapter"].replace(",", " "), round(m["prefill_tokens_per_s"], 1),
          r["batch"], round(r["tokens_per_s"], 1), round(r["ms_per_step"], 3),
          "" if share is None else round(share, 3), r.get("dispatches", ""), r.get("matmul", "")]))
PY
  else
    fail=1
    tail -5 "$OUT/model-$arch.err"
  fi
done

# 3. The paper's experiment on a synthetic model: paged against max and oracle.
echo "== serving: loadgen --sweep on serve --synthetic"
if [[ $SMALL -eq 1 ]]; then
  # --quick: 6 requests through each policy's server, each checked to
  # complete with blocks used (it fails otherwise).
  largs=(loadgen --quick --synthetic smollm2-135m --layers 2 --policies paged,max,oracle --num-blocks 64
         --rates 4 --start-rate 4 --point-seconds 1)
else
  largs=(loadgen --sweep --synthetic llama3-8b --policies paged,max,oracle --num-blocks 2048
         --max-model-len 2048 --scale 1 --rates 1,2,4,8,16,32 --start-rate 4 --point-seconds 20 --requests 32)
fi
timeout 240 "$BIN" "${largs[@]}" >"$OUT/loadgen.txt" 2>"$OUT/loadgen.err" || { fail=1; tail -5 "$OUT/loadgen.err"; }

echo "== $(( $(date +%s) - start )) s"
cat "$OUT/loadgen.txt"
echo "== the model on synthetic weights ($OUT/model.csv)"
column -s, -t <"$OUT/model.csv" 2>/dev/null || cat "$OUT/model.csv"
exit $fail
