#!/usr/bin/env bash
# kuai's tokenizer.json reader against independent JavaScript tokenizers, on every line of the
# King James Bible and of tests/data/tokenizer_edge.txt (multilingual, emoji, white-space edges):
# the token ids must be identical, and decode(encode(line)) == line.
#   hf_peers.sh KUAI
# Needs the files `scripts/setup.sh --hf-tokenizers` fetches (data/hf/, third_party/hf-tokenizers)
# and node; skipped (77) without them. .ci/run fetches them.
set -euo pipefail
kuai=$1
root=$(cd "$(dirname "$0")/../.." && pwd)
modules=$root/third_party/hf-tokenizers/node_modules
hf=$root/data/hf
if ! command -v node >/dev/null || [ ! -d "$modules" ] || [ ! -s "$hf/llama2/tokenizer.json" ]; then
  echo "skipped: run scripts/setup.sh --hf-tokenizers first (needs node and npm)"
  exit 77
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The KJV as `bible` prints it (data/kjv.bin holds the same bytes after its 24-byte header).
tail -c +25 "$root/data/kjv.bin" > "$work/kjv.txt"
corpora=("$work/kjv.txt" "$root/tests/data/tokenizer_edge.txt")

failed=0
# compare NAME TOKENIZER PEER: ids of kuai and of the peer, line by line.
compare() {
  local name=$1 tokenizer=$2 peer=$3 corpus
  for corpus in "${corpora[@]}"; do
    local label
    label="$name on $(basename "$corpus")"
    if [ "$peer" = kuai-gpt2 ]; then
      "$kuai" tokenize --tokenizer gpt2 --bpe_dir "$root/data/gpt2" --file "$corpus" > "$work/peer"
    else
      node "$root/bench/peers/tokenize.mjs" "$modules" "$peer" "$corpus" > "$work/peer"
    fi
    "$kuai" tokenize --tokenizer "$tokenizer" --file "$corpus" > "$work/kuai"
    if cmp -s "$work/peer" "$work/kuai"; then
      echo "ok: $label: ids identical to $peer on $(wc -l < "$corpus") lines"
    else
      local line
      line=$( (cmp "$work/peer" "$work/kuai" || true) | sed -n 's/.* line \([0-9]*\).*/\1/p')
      echo "FAIL: $label: ids differ from $peer first on line $line:"
      echo "  text: $(sed -n "${line}p" "$corpus")"
      echo "  $peer: $(sed -n "${line}p" "$work/peer")"
      echo "  kuai: $(sed -n "${line}p" "$work/kuai")"
      failed=1
    fi
  done
}
# round_trip NAME TOKENIZER [LOSSY]: decode(encode(line)) == line for every line, but those with
# the character LOSSY: a SentencePiece-style tokenizer writes spaces as U+2581 and decodes every
# U+2581 as a space, so a text holding U+2581 itself does not come back.
round_trip() {
  local name=$1 tokenizer=$2 lossy=${3:-} corpus
  for corpus in "${corpora[@]}"; do
    local text=$corpus skipped=""
    if [ -n "$lossy" ]; then
      text=$work/lossless.txt
      grep -v -F -- "$lossy" "$corpus" > "$text" || true
      skipped=" (all but the $(grep -c -F -- "$lossy" "$corpus" || true) lines with $lossy)"
    fi
    "$kuai" tokenize --tokenizer "$tokenizer" --no-special --file "$text" |
      "$kuai" tokenize --tokenizer "$tokenizer" --decode --no-special > "$work/back"
    if cmp -s "$text" "$work/back"; then
      echo "ok: $name on $(basename "$corpus"): decode(encode(line)) == line$skipped"
    else
      echo "FAIL: $name on $(basename "$corpus"): a round trip differs: $(cmp "$text" "$work/back" || true)"
      failed=1
    fi
  done
}

compare llama2 "$hf/llama2/tokenizer.json" llama-tokenizer-js
compare llama3 "$hf/llama3/tokenizer.json" llama3-tokenizer-js
compare gpt2 "$hf/gpt2/tokenizer.json" gpt-3-encoder
# transformers.js (@lenml/tokenizers) reads the same files: a second, general implementation.
for name in llama2 llama3 gpt2 lenml-llama2; do
  compare "$name" "$hf/$name/tokenizer.json" "lenml:$hf/$name/tokenizer.json"
done
# GPT-2 read from a tokenizer.json equals kuai's own GPT-2 tokenizer (encoder.json, vocab.bpe).
if [ -s "$root/data/gpt2/encoder.json" ]; then
  compare gpt2 "$hf/gpt2/tokenizer.json" kuai-gpt2
else
  echo "FAIL: data/gpt2 missing (scripts/setup.sh --bpe)"
  failed=1
fi
for name in llama3 gpt2; do round_trip "$name" "$hf/$name/tokenizer.json"; done
for name in llama2 lenml-llama2; do round_trip "$name" "$hf/$name/tokenizer.json" "▁"; done
exit $failed
