#!/usr/bin/env bash
# What the browser tests need besides the build: Debian's Chromium and the
# test's node modules (playwright-core). Each is installed only if missing.
# scripts/web-test.sh calls this; .ci/run runs it beside the build.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x /usr/bin/chromium ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq chromium >/dev/null
fi
if [ ! -d web/test/node_modules/playwright-core ]; then
  (cd web/test && npm ci --no-audit --no-fund --loglevel=error)
fi
