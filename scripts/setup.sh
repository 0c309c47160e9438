#!/usr/bin/env bash
# Installs every Debian package kuai needs (only the missing ones) and prepares the default
# corpus: the King James Bible from Debian's bible-kjv, as a byte-level kuai token file
# (data/kjv.bin). Idempotent: returns at once when everything is in place.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  cmake g++ make pkg-config
  libopenblas-openmp-dev   # GEMM (OpenMP build: one thread pool with kuai's kernels)
  libdnnl-dev              # oneDNN matmul primitive (the faster GEMM on some shapes)
  libfmt-dev libtomlplusplus-dev nlohmann-json3-dev
  libgtest-dev libbenchmark-dev
  bible-kjv                # the default corpus
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

# Default corpus: header "KUAITOKS", u32 version 1, u32 bytes/token 1, u64 count; then bytes.
corpus=data/kjv.bin
if [ ! -s "$corpus" ]; then
  mkdir -p data
  tmp=$(mktemp)
  bible gen1:1-rev22:21 > "$tmp"
  n=$(stat -c %s "$tmp")
  perl -e 'print pack("a8 V V Q<", "KUAITOKS", 1, 1, $ARGV[0])' "$n" > "$corpus.tmp"
  cat "$tmp" >> "$corpus.tmp"
  rm -f "$tmp"
  mv "$corpus.tmp" "$corpus"
  echo "setup: wrote $corpus ($n tokens)"
fi
