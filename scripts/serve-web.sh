#!/usr/bin/env bash
# Serves the browser demo (web/, after scripts/build-web.sh) on
# http://127.0.0.1:${PORT:-8080}/. WebGPU needs a secure context, which
# localhost is; python's http.server sends .wasm as application/wasm.
set -euo pipefail
cd "$(dirname "$0")/../web"
if [ ! -f pkg/pagedattn_bg.wasm ]; then
  echo "web/pkg is missing: run scripts/build-web.sh first" >&2
  exit 1
fi
# The real-model page (model.html) loads models/ from the served folder.
if [ -d ../models ]; then
  ln -sfn ../models models
else
  echo "note: no models/ (scripts/fetch-model.sh): model.html can still load a GGUF file you pick" >&2
fi
port=${PORT:-8080}
echo "serving http://127.0.0.1:$port/"
exec python3 -m http.server --bind 127.0.0.1 "$port"
