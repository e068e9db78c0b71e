#!/usr/bin/env bash
# Runs pagedattn's prebuilt checks on an x86-64 Linux machine with an NVIDIA
# GPU and driver (580 / CUDA 13 targeted) but no Rust toolchain and no
# internet. Build the bundle elsewhere with scripts/build-nvidia-bundle.sh,
# copy target/nvidia-bundle.tar.gz over, unpack, and run this from inside it:
#
#   tar xzf nvidia-bundle.tar.gz && nvidia-bundle/nvidia-check.sh [--full]
#
# It runs every test binary on the Vulkan backend with a GPU and CUDA
# required (PAGEDATTN_BACKEND=vulkan PAGEDATTN_REQUIRE_GPU=1
# PAGEDATTN_REQUIRE_CUDA=1), so the wgpu tests run on the NVIDIA adapter and
# the CUDA parity test cannot skip; then the demo and `pagedattn bench
# --quick` (the full grid with --full). It writes report.txt (short) and
# logs/*.log (everything) next to itself, and exits non-zero if any step
# failed.
set -uo pipefail
cd "$(dirname "$0")" || exit 1
HERE=$PWD

FULL=0
[[ "${1:-}" == "--full" ]] && FULL=1

REPORT=$HERE/report.txt
LOGS=$HERE/logs
mkdir -p "$LOGS"
: >"$REPORT"
say() { echo "$*" | tee -a "$REPORT"; }
FAILED=0

say "pagedattn NVIDIA check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
[[ -f MANIFEST.txt ]] && say "bundle: $(sed -n 2p MANIFEST.txt)"
say "machine: $(uname -srm), $(ldd --version 2>/dev/null | head -1)"
if command -v nvidia-smi >/dev/null; then
  say "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -4 | tr '\n' ';')"
else
  say "gpu: nvidia-smi not found"
fi

# --- Libraries -------------------------------------------------------------
# The driver's own folder (some containers mount it outside ld.so.cache).
for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
  [[ -d "$d" ]] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done

has_lib() { ldconfig -p 2>/dev/null | grep -q "$1" || compgen -G "/usr/local/nvidia/lib*/$1*" >/dev/null; }

# Vulkan loader: the system's if there is one, else the bundled copy.
if has_lib libvulkan.so.1; then
  say "vulkan loader: system"
else
  export LD_LIBRARY_PATH="$HERE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  say "vulkan loader: bundled (lib/libvulkan.so.1)"
fi

# The NVIDIA Vulkan ICD: point the loader at it explicitly, so the tests
# cannot land on a software adapter.
if [[ -z "${VK_DRIVER_FILES:-}${VK_ICD_FILENAMES:-}" ]]; then
  for f in /usr/share/vulkan/icd.d/nvidia_icd.json /etc/vulkan/icd.d/nvidia_icd.json \
           /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json /usr/local/share/vulkan/icd.d/nvidia_icd.json; do
    if [[ -f "$f" ]]; then export VK_DRIVER_FILES=$f VK_ICD_FILENAMES=$f; break; fi
  done
fi
say "vulkan ICD: ${VK_DRIVER_FILES:-${VK_ICD_FILENAMES:-none found, default search}}"

# NVRTC is part of the CUDA toolkit, not the driver. The binaries look for
# libnvrtc.so.13 or libnvrtc.so (cudarc's names for CUDA 13); when the
# dynamic linker knows neither, find a folder holding one: the toolkit's
# first (it matches the driver), then pip's nvidia wheels.
if ! ldconfig -p 2>/dev/null | grep -qE 'libnvrtc\.so(\.13)? \('; then
  nvrtc=""
  for pat in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
             /usr/local/cuda-*/lib64 /usr/local/cuda-*/targets/x86_64-linux/lib \
             /usr/lib/x86_64-linux-gnu /opt/*/.venv/lib/python3*/site-packages/nvidia/*/lib \
             /usr/local/lib/python3*/dist-packages/nvidia/*/lib /usr/lib/python3/dist-packages/nvidia/*/lib; do
    for d in $pat; do
      if [[ -e "$d/libnvrtc.so.13" || -e "$d/libnvrtc.so" ]]; then nvrtc=$d; break 2; fi
    done
  done
  if [[ -n "$nvrtc" ]]; then
    export LD_LIBRARY_PATH="$nvrtc${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    say "nvrtc: $nvrtc (added to LD_LIBRARY_PATH)"
  else
    say "nvrtc: libnvrtc.so.13 NOT FOUND (the CUDA parity test will fail: install the CUDA toolkit's NVRTC)"
  fi
else
  say "nvrtc: known to the dynamic linker"
fi
say "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"

export PAGEDATTN_BACKEND=vulkan PAGEDATTN_REQUIRE_GPU=1 PAGEDATTN_REQUIRE_CUDA=1
export RUST_BACKTRACE=1

# --- Tests -----------------------------------------------------------------
say ""
say "== tests (Vulkan backend, GPU and CUDA required)"
for t in tests/*; do
  [[ -x "$t" ]] || continue
  name=$(basename "$t")
  log=$LOGS/test-$name.log
  start=$(date +%s)
  timeout 900 "$t" --test-threads=1 --nocapture >"$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  summary=$(grep -E '^test result:' "$log" | tail -1)
  adapters=$(grep -oE '^adapter: .*' "$log" | sort -u | sed 's/^adapter: //' | paste -sd';' -)
  if [[ $rc -eq 0 ]]; then status=PASS; else status="FAIL (exit $rc)"; FAILED=1; fi
  say "$(printf '%-16s %-16s %4ss  %s' "$name" "$status" "$secs" "${summary:-no summary line}")"
  [[ -n "$adapters" ]] && say "                 adapter: $adapters"
  if [[ $rc -ne 0 ]]; then
    # Each panic's location and message (the line after it).
    grep -A1 -E "panicked at" "$log" | grep -v '^--$' | head -8 | sed 's/^/                 /' | tee -a "$REPORT"
  fi
  if [[ "$name" == cuda_parity ]]; then
    grep -E '^CUDA' "$log" | sort -u | sed 's/^/                 /' | tee -a "$REPORT"
    grep -E 'rel L2' "$log" | sed 's/^/                 /' | tee -a "$REPORT"
  fi
  if grep -qiE 'llvmpipe|lavapipe|swiftshader' <<<"$adapters"; then
    say "                 WARNING: a software adapter, not the NVIDIA GPU"
    FAILED=1
  fi
done

# --- Demo and bench --------------------------------------------------------
# run_step LABEL LOG CMD...: stdout to LOG, stderr (progress) to LOG.err.
run_step() {
  local label=$1 log=$2
  shift 2
  local start rc
  start=$(date +%s)
  timeout 1200 "$@" >"$log" 2>"$log.err"
  rc=$?
  if [[ $rc -eq 0 ]]; then
    say "$label: PASS ($(( $(date +%s) - start ))s)"
  else
    say "$label: FAIL (exit $rc, $(( $(date +%s) - start ))s)"
    FAILED=1
  fi
  return $rc
}

say ""
say "== demo (Vulkan)"
if run_step "pagedattn demo" "$LOGS/demo.log" ./pagedattn; then
  grep -E '^(adapter|worst|done|pool after)' "$LOGS/demo.log" | sed 's/^/  /' | tee -a "$REPORT"
else
  tail -5 "$LOGS/demo.log.err" | sed 's/^/  /' | tee -a "$REPORT"
fi

say ""
say "== bench (Vulkan adapter, and CUDA where this build wires it in)"
if ! ./pagedattn bench --help >/dev/null 2>&1; then
  say "pagedattn bench: this build has no 'bench' subcommand (skipped)"
else
  args=(--quick)
  [[ $FULL -eq 1 ]] && args=()
  if run_step "pagedattn bench ${args[*]}" "$LOGS/bench.log" ./pagedattn bench "${args[@]}"; then
    # The report itself is short: keep all of it.
    grep -v '^\s*$' "$LOGS/bench.log" | sed 's/^/  /' | tee -a "$REPORT"
  else
    tail -8 "$LOGS/bench.log.err" | sed 's/^/  /' | tee -a "$REPORT"
  fi
  if ! grep -qi cuda "$LOGS/bench.log"; then
    say "  note: the bench output names no CUDA section (not wired into this build's bench?)"
  fi
fi

say ""
if [[ $FAILED -eq 0 ]]; then say "RESULT: all steps passed"; else say "RESULT: FAILED (see logs/)"; fi
exit $FAILED
