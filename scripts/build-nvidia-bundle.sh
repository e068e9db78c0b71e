#!/usr/bin/env bash
# Builds everything scripts/nvidia-check.sh runs on an NVIDIA machine that has
# a driver but no Rust toolchain and no internet: the release test binaries
# and the `pagedattn` binary with `--features cuda`, the criterion bench
# binary, and the Vulkan loader (the driver brings the Vulkan ICD but the
# machine may lack libvulkan.so.1).
#
# Output: target/nvidia-bundle/ and target/nvidia-bundle.tar.gz. Copy the
# tarball over, then: tar xzf nvidia-bundle.tar.gz && nvidia-bundle/nvidia-check.sh
#
# Needs: cargo, python3 (to read cargo's JSON), libvulkan1 (installed with
# apt-get when missing). x86-64 Linux only, like the target machine.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "$(uname -m)" != x86_64 ]]; then
  echo "build-nvidia-bundle: this machine is $(uname -m); the bundle must be built on x86_64" >&2
  exit 1
fi

OUT=target/nvidia-bundle
rm -rf "$OUT"
mkdir -p "$OUT/tests" "$OUT/benches" "$OUT/lib"

# Prints "name<TAB>path" for every executable cargo reports whose target
# kind is $1 ("test-targets": unit and integration tests; "bench": benches).
executables() {
  python3 -c '
import json, sys
want = sys.argv[1]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    t = m["target"]
    if want == "bench" and "bench" not in t["kind"]:
        continue
    # Test builds also produce the plain binary: skip it.
    if want == "test-targets" and not m["profile"]["test"]:
        continue
    # The library unit tests are named after the crate; call them "lib".
    print(("lib" if "lib" in t["kind"] else t["name"]) + "\t" + m["executable"])
' "$1"
}

echo "== release test binaries (--features cuda)"
cargo test --release --features cuda --no-run --message-format=json-render-diagnostics \
  | executables test-targets | while IFS=$'\t' read -r name exe; do
      cp "$exe" "$OUT/tests/$name"
      echo "   tests/$name"
    done

echo "== bench binaries (optional: the check script does not need them)"
if ! cargo bench --features cuda --no-run --message-format=json-render-diagnostics \
  | executables bench | while IFS=$'\t' read -r name exe; do
      cp "$exe" "$OUT/benches/$name"
      echo "   benches/$name"
    done; then
  echo "   WARNING: the benches did not build; the bundle has none" >&2
fi

echo "== pagedattn (release, --features cuda)"
cargo build --release --features cuda --bin pagedattn
cp target/release/pagedattn "$OUT/pagedattn"

echo "== Vulkan loader"
loader=/usr/lib/x86_64-linux-gnu/libvulkan.so.1
if [[ ! -e "$loader" ]]; then
  apt-get update -qq && apt-get install -y -qq libvulkan1 >/dev/null
fi
# The versioned file under the soname the binaries ask for.
cp -L "$loader" "$OUT/lib/libvulkan.so.1"

cp scripts/nvidia-check.sh "$OUT/"
chmod +x "$OUT/nvidia-check.sh" "$OUT/pagedattn" "$OUT"/tests/* "$OUT"/benches/* 2>/dev/null || true
{
  echo "pagedattn NVIDIA bundle"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -srm)"
  echo "rustc: $(rustc --version)"
  echo "glibc: $(ldd --version | head -1)"
  echo "vulkan loader: $(readlink -f "$loader")"
  echo "files:"
  (cd "$OUT" && find . -type f | sort | sed 's/^/  /')
} >"$OUT/MANIFEST.txt"

tar -C target -czf target/nvidia-bundle.tar.gz nvidia-bundle
echo "== done: $OUT ($(du -sh "$OUT" | cut -f1)), target/nvidia-bundle.tar.gz ($(du -sh target/nvidia-bundle.tar.gz | cut -f1))"
