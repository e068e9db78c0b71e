#!/usr/bin/env bash
# One prepared device sweep of GPU decode (issue: decode at the speed of
# HBM), in at most about 8 minutes, ending with one table:
#   1. the clock state (nvidia-smi -q) and a 100 ms clock log beside it;
#   2. `pagedattn sweep`: copy and read ceilings (grids x loads x checked /
#      trusted modules), lanes against stream over its steps x checked /
#      trusted at 32x8192, 8x2048, 1x32768 (f16), split-K partitions,
#      f16 / int8 / fp8 (time over f16's), paged against contiguous;
#   3. `pagedattn pipeline-stats`: registers, spills and code size of each
#      decode kernel as the driver reports them (checked and trusted
#      SPIR-V; needs VK_KHR_pipeline_executable_properties);
#   4. `pagedattn bench --only cascade`: the cascade grid and, in a build
#      with `--features cuda` on a machine with the driver, the CUDA twin.
#
# Usage: scripts/gpu-sweep.sh [--small]
#   PAGEDATTN_BIN   the pagedattn binary (default target/release/pagedattn;
#                   build it with `cargo build --release --features cuda
#                   -p pagedattn-cli --bins` for the CUDA twin)
#   OUT             where sweep.csv, bench.txt and clocks.csv go (default
#                   target/sweep)
# --small runs small cells on any adapter (a software one takes about a
# minute), to test the script itself.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${PAGEDATTN_BIN:-target/release/pagedattn}
OUT=${OUT:-target/sweep}
mkdir -p "$OUT"
SMALL=()
[[ "${1:-}" == "--small" ]] && SMALL=(--small)
if [[ ! -x "$BIN" ]]; then
  echo "gpu-sweep: $BIN is not an executable (build it first, or set PAGEDATTN_BIN)" >&2
  exit 1
fi

# The NVIDIA Vulkan ICD where the loader does not find it by itself.
if [[ -z "${VK_DRIVER_FILES:-}${VK_ICD_FILENAMES:-}" ]]; then
  for f in /usr/share/vulkan/icd.d/nvidia_icd.json /etc/vulkan/icd.d/nvidia_icd.json \
           /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json; do
    if [[ -f "$f" ]]; then export VK_DRIVER_FILES=$f; break; fi
  done
fi
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
  [[ -d "$d" ]] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
export PAGEDATTN_BACKEND=${PAGEDATTN_BACKEND:-vulkan} PAGEDATTN_REQUIRE_GPU=1

start=$(date +%s)
LOGGER=""
if command -v nvidia-smi >/dev/null; then
  echo "== clocks before (nvidia-smi -q -d CLOCK,POWER,PERFORMANCE)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.draw --format=csv
  nvidia-smi -q -d CLOCK,POWER,PERFORMANCE >"$OUT/nvidia-smi-q.txt" 2>&1
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu \
    --format=csv -lms 100 >"$OUT/clocks.csv" 2>/dev/null &
  LOGGER=$!
fi

echo "== sweep"
timeout 420 "$BIN" sweep "${SMALL[@]}" --csv "$OUT/sweep.csv" >"$OUT/sweep.txt" 2>"$OUT/sweep.err"
sweep_rc=$?
[[ $sweep_rc -ne 0 ]] && tail -5 "$OUT/sweep.err"

echo "== pipeline statistics"
timeout 60 "$BIN" pipeline-stats >"$OUT/stats.txt" 2>&1 || true

echo "== cascade grid and the CUDA twin (bench --only cascade)"
timeout 120 "$BIN" bench --only cascade --max-seconds 60 >"$OUT/bench.txt" 2>"$OUT/bench.err"
bench_rc=$?
[[ $bench_rc -ne 0 ]] && tail -5 "$OUT/bench.err"

[[ -n "$LOGGER" ]] && kill "$LOGGER" 2>/dev/null
echo "== $(( $(date +%s) - start )) s"
cat "$OUT/stats.txt"
cat "$OUT/bench.txt"
cat "$OUT/sweep.txt"
[[ $sweep_rc -eq 0 && $bench_rc -eq 0 ]]
