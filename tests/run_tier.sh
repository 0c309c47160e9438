#!/usr/bin/env bash
# Runs the unit-test binary again with the ISA tier capped at $3 (KUAI_MAX_ISA), so one
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
# Left out at the lower tiers: tests of orchestration whose assertions do not depend on the kernels
# (the plan's command line and its fit search, the ablation tables, a killed or failing save, the
# run lock, the README's example run); every kernel, op, model, golden, autocast, compile and
# training test runs at every tier, with resume bit for bit in fp32, bf16 and fp16. They take about
# half the suite's time; the CPU's own tier runs them (the main suite).
orchestration='Plan.Fit*:PlanCli.*:Ablation.*:Checkpoint.Sigkill*:Checkpoint.Failing*:Checkpoint.Llama*:RunLock.*:ReadmeExample.*'
echo "tier $tier (cpu $cpu): the suite with KUAI_MAX_ISA=$tier, less $orchestration"
KUAI_MAX_ISA=$tier exec "$tests" --gtest_brief=1 --gtest_filter="-$orchestration" "$@"
