#!/usr/bin/env bash
# Builds the browser demo into web/pkg: the `pagedattn-web` crate (web/,
# the CLI's demo over the library) compiled to wasm32-unknown-unknown
# (wgpu's WebGPU backend) and its wasm-bindgen glue.
# Then `scripts/serve-web.sh` serves web/ on http://127.0.0.1:8080/.
#
# Needs: rustup (adds the wasm32 target if missing) and the wasm-bindgen CLI
# at exactly the version of the wasm-bindgen crate in Cargo.lock (installed
# with `cargo install` if missing: about 1 minute, once).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! rustup target list --installed | grep -qx wasm32-unknown-unknown; then
  rustup target add wasm32-unknown-unknown
fi

# The CLI and the crate must match exactly, or the generated glue refuses
# to load the module.
want=$(awk '/^name = "wasm-bindgen"$/ { getline; gsub(/version = |"/, ""); print; exit }' Cargo.lock)
have=$(wasm-bindgen --version 2>/dev/null | awk '{ print $2 }' || true)
if [ "$have" != "$want" ]; then
  echo "installing wasm-bindgen-cli $want (have: ${have:-none})"
  # Only the `wasm-bindgen` binary, without the TLS stack the test
  # runner's downloads need (its published lock names crate versions the
  # registry may not have, so no --locked).
  # A tool run once a build, on one 2.7 MB module: built without
  # optimisation it installs in 0.36x the time (61 s against 168 s, 2
  # cores) and takes 0.9 s instead of 0.2 s, with byte-identical output
  # (benches/NOTES.md, CI time). The profile applies to this install only.
  CARGO_PROFILE_RELEASE_OPT_LEVEL=0 CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_LTO=false \
    cargo install wasm-bindgen-cli --version "$want" --no-default-features --bin wasm-bindgen
fi

# `cargo rustc --crate-type cdylib` rather than a cdylib in [lib]: native
# builds then do not link a shared library they never use.
cargo rustc -p pagedattn-web --lib --release --target wasm32-unknown-unknown --crate-type cdylib
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
wasm-bindgen --target web --no-typescript --out-dir web/pkg --out-name pagedattn \
  "$target_dir/wasm32-unknown-unknown/release/pagedattn_web.wasm"
echo "built web/pkg ($(du -sh web/pkg | cut -f1)); serve it with scripts/serve-web.sh"
