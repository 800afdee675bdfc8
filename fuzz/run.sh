#!/usr/bin/env bash
# make fuzz: with the harnesses of a fuzz build (fuzz/CMakeLists.txt),
#   1. replays the exact hostile inputs once each: tests/hostile/configs/* (and the generated ones too big for
#      git) through fuzz_config, tests/hostile/flags/* through fuzz_flags, tests/hostile/scenarios/* through
#      fuzz_scenario, and every input a fuzzer once found, tests/hostile/found/<harness>/*;
#   2. fuzzes each harness for FUZZ_SECONDS seconds (default 60) from its seed corpus (fuzz/corpus/<harness>,
#      copied into <build>/corpus/<harness>, where the inputs libFuzzer adds are kept: never in git) with its
#      dictionary (fuzz/<harness>.dict). A crash is written to <build>/artifacts/<harness>-crash-<sha1>; to keep
#      one as a regression input, copy it into tests/hostile/found/<harness>/.
# Exits 1 when a replay or a fuzzer fails; every harness runs either way.
#   usage: fuzz/run.sh [build-dir]      env: FUZZ_SECONDS, FUZZ_SEED, FUZZ_RUNS, FUZZERS ("fuzz_config fuzz_flags fuzz_scenario fuzz_snapshot")
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build-fuzz}
FUZZ_SECONDS=${FUZZ_SECONDS:-60}
# A fixed seed (FUZZ_SEED, default 1): from the same seed corpus the same inputs come in the same order, so a
# run that passed here passes in CI (a slower machine only stops earlier); FUZZ_SEED=0 lets libFuzzer pick.
FUZZ_SEED=${FUZZ_SEED:-1}
# At most FUZZ_RUNS executions per harness (default 100000, about 15-60 s each here): with the fixed seed, CI
# runs a prefix of the very sequence that passed before it was committed. FUZZ_RUNS=-1: only the time bounds it.
FUZZ_RUNS=${FUZZ_RUNS:-100000}
read -r -a FUZZERS <<< "${FUZZERS:-fuzz_config fuzz_flags fuzz_scenario fuzz_snapshot}"
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
COMMON=(-rss_limit_mb=2048 -timeout=10)
LOGS=$BUILD/fuzz-logs
mkdir -p "$LOGS" "$BUILD/artifacts"
status=0

replay_inputs() {
  case "$1" in
    fuzz_config)
      python3 tests/hostile/run_hostile.py --generate "$BUILD/hostile-work" >/dev/null
      ls -d tests/hostile/configs/* "$BUILD"/hostile-work/*.json 2>/dev/null ;;
    fuzz_flags) ls -d tests/hostile/flags/* 2>/dev/null ;;
    fuzz_scenario) ls -d tests/hostile/scenarios/* 2>/dev/null ;;
    fuzz_snapshot) ls -d tests/cli/data/snapshot_* 2>/dev/null ;;
  esac
  ls -d "tests/hostile/found/$1"/* 2>/dev/null
}

echo "== replaying the hostile and found inputs"
for h in "${FUZZERS[@]}"; do
  exe=$BUILD/fuzz/$h
  n=0 bad=0
  while IFS= read -r input; do
    [ -f "$input" ] || continue
    n=$((n + 1))
    log=$LOGS/replay-$h-$(basename "$input").log
    start=$(date +%s%N)
    if ! "$exe" "${COMMON[@]}" "$input" >"$log" 2>&1; then
      bad=$((bad + 1)) status=1
      echo "  FAIL $h $input ($(( ($(date +%s%N) - start) / 1000000 )) ms); log $log:"
      grep -aE "ERROR|runtime error|SUMMARY|fuzz_[a-z]+: |ALARM|Test unit written" "$log" | head -12 | sed 's/^/       /'
    fi
  done < <(replay_inputs "$h")
  echo "  $h: $n inputs replayed, $bad failed"
done

for h in "${FUZZERS[@]}"; do
  exe=$BUILD/fuzz/$h
  corpus=$BUILD/corpus/$h
  mkdir -p "$corpus"
  cp -n fuzz/corpus/"$h"/* "$corpus"/ 2>/dev/null || true
  echo "== $h: fuzzing for $FUZZ_SECONDS s (corpus $corpus, $(ls "$corpus" | wc -l) inputs)"
  log=$LOGS/$h.log
  start=$(date +%s)
  "$exe" -seed="$FUZZ_SEED" -runs="$FUZZ_RUNS" -max_total_time="$FUZZ_SECONDS" -dict="fuzz/$h.dict" -max_len=65536 "${COMMON[@]}" \
    -artifact_prefix="$BUILD/artifacts/$h-" -print_final_stats=1 "$corpus" >"$log" 2>&1
  rc=$?
  done_line=$(grep -E "^#[0-9]+[[:space:]]+DONE" "$log" | tail -1)
  runs=$(grep -E "^stat::number_of_executed_units:" "$log" | awk '{print $2}')
  if [ $rc -ne 0 ]; then
    status=1
    echo "  FAIL after $(( $(date +%s) - start )) s (exit $rc); log $log:"
    grep -aE "ERROR|runtime error|SUMMARY|fuzz_[a-z]+: |ALARM|Test unit written" "$log" | head -16 | sed 's/^/     /'
  else
    echo "  ok: ${runs:-?} executions; ${done_line:-no DONE line}"
  fi
done
exit $status
