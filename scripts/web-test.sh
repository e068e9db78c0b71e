#!/usr/bin/env bash
# CI's end-to-end test of the browser demo: installs Chromium and the test's
# node dependencies if missing, builds the page (scripts/build-web.sh),
# serves it on a free port of 127.0.0.1, runs web/test/e2e.mjs in headless
# Chromium (WebGPU on SwiftShader), then web/test/model.mjs (the real model,
# which needs scripts/fetch-model.sh first), and stops the server. Exits
# non-zero on any failure. Writes web/screenshot.png and
# web/screenshot-model.png (or $PAGEDATTN_SCREENSHOT and
# $PAGEDATTN_MODEL_SCREENSHOT).
#
# The first run also installs the wasm-bindgen CLI (about 1 minute); caching
# ~/.cargo/bin/wasm-bindgen in CI skips that.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/web-test-deps.sh

scripts/build-web.sh
# The real-model page loads the fetched model from the served folder.
if [ ! -f models/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  echo "models/SmolLM2-135M-Instruct.Q4_1.gguf is missing: run scripts/fetch-model.sh first" >&2
  exit 1
fi
ln -sfn ../models web/models

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log=$(mktemp)
python3 -m http.server --bind 127.0.0.1 --directory web "$port" >"$log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 50); do
  if python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/')" 2>/dev/null; then
    break
  fi
  sleep 0.1
done

# The test bounds itself at 2 minutes; this outer bound catches a stuck browser launch.
# PAGEDATTN_WEB_REPEAT=N runs it N times in a row (a flake hunt); any failure fails.
repeat=${PAGEDATTN_WEB_REPEAT:-1}
for i in $(seq "$repeat"); do
  if [ "$repeat" -gt 1 ]; then echo "== browser test run $i of $repeat"; fi
  timeout 180 node web/test/e2e.mjs "http://127.0.0.1:$port/"
  # The real model on WebGPU: greedy tokens against the reference fixture,
  # then 4 beams with the page's block counts against the engine's.
  timeout 660 node web/test/model.mjs "http://127.0.0.1:$port/"
done
if [ "$repeat" -gt 1 ]; then echo "browser test: $repeat runs in a row passed"; fi
