#!/usr/bin/env bash
# Runs the whole unit-test binary again with the ISA tier capped at $3 (KUAI_MAX_ISA), so one
# machine tests every tier at or below its own. A tier the CPU lacks is reported and skipped
# (exit 77, ctest's SKIP_RETURN_CODE); the CPU's own tier is the main suite's.
# Usage: run_tier.sh KUAI_TESTS KUAI TIER [gtest args...]
set -u
tests=$1 kuai=$2 tier=$3
shift 3
order="baseline avx2 avx512 avx512_bf16 amx"
rank() { local i=0; for t in $order; do [ "$t" = "$1" ] && { echo $i; return; }; i=$((i + 1)); done; echo -1; }
cpu=$("$kuai" info --cpu-tier) || { echo "run_tier: '$kuai info --cpu-tier' failed"; exit 1; }
if [ "$(rank "$tier")" -gt "$(rank "$cpu")" ]; then
  echo "tier $tier not tested: this CPU's best tier is $cpu ($("$kuai" info | sed -n 's/^flags *//p'))"
  exit 77
fi
if [ "$tier" = "$cpu" ]; then
  echo "tier $tier is this CPU's own: the main suite runs it"
  exit 77
fi
echo "tier $tier (cpu $cpu): the whole suite with KUAI_MAX_ISA=$tier"
KUAI_MAX_ISA=$tier exec "$tests" --gtest_brief=1 "$@"
