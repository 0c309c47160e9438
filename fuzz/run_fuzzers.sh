#!/usr/bin/env bash
# Runs kuai's libFuzzer targets side by side, each for SECONDS seconds, starting
# from a scratch copy of its committed seed corpus (fuzz/corpus/<name>/ is never written to).
# A crash, sanitizer report, leak, or an input running longer than 10 s fails the run; the
# failing input is kept under BUILD_DIR/fuzz-artifacts/ and the fuzzer's log tail is printed.
#   usage: fuzz/run_fuzzers.sh BUILD_DIR SECONDS
set -uo pipefail
cd "$(dirname "$0")/.."
build=$1
seconds=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/kuai-fuzz.XXXXXX")
trap 'rm -rf "$work"' EXIT

names=(safetensors config tokenizer)
for name in "${names[@]}"; do
  mkdir -p "$work/$name" "$build/fuzz-artifacts/$name"
  cp fuzz/corpus/"$name"/* "$work/$name"/
  dict=()
  [ -f "fuzz/$name.dict" ] && dict=(-dict="fuzz/$name.dict")
  "$build/kuai_fuzz_$name" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    "${dict[@]}" -artifact_prefix="$build/fuzz-artifacts/$name/" \
    -print_final_stats=1 "$work/$name" >"$work/$name.log" 2>&1 &
  pids+=($!)
done

status=0
for i in "${!names[@]}"; do
  name=${names[$i]}
  if wait "${pids[$i]}"; then
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$work/$name.log" | grep -o '[0-9]*$')
    echo "fuzz $name: ok, ${runs:-?} inputs in ${seconds}s, corpus $(ls "$work/$name" | wc -l) files"
  else
    status=1
    echo "fuzz $name: FAILED (inputs kept in $build/fuzz-artifacts/$name/)"
    tail -n 40 "$work/$name.log"
  fi
done
exit $status
