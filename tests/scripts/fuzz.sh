#!/usr/bin/env bash
# Runs the cargo-fuzz targets of common/fuzz and ccm/dhcp/fuzz (each its own cargo-fuzz workspace)
# on stable Rust, each for a number of seconds.
# Installs cargo-fuzz into a cache outside the repo when it is missing. See docs/fuzzing.md.
#
#   tests/scripts/fuzz.sh                 # every target, 60 s each
#   tests/scripts/fuzz.sh 300 dhcp_reply  # one target, 5 minutes
#
# Stable Rust: `-s none` builds without a sanitizer (AddressSanitizer needs nightly's -Z flag;
# this code forbids `unsafe`, so a panic is what we look for), `-a` keeps debug assertions and
# overflow checks in the optimised build. In each fuzz directory <dir>, new corpus entries go to
# <dir>/corpus/<target> (not committed); the committed seeds are read from <dir>/seeds/<target>. A
# crash is saved in <dir>/artifacts/<target>/ and fails the script.
set -euo pipefail

CARGO_FUZZ_VERSION=${CARGO_FUZZ_VERSION:-0.13.2}
CACHE_ROOT=${HARVESTER_TESTBED_CACHE:-$HOME/.cache/harvester-testbed}
TOOL_ROOT="$CACHE_ROOT/cargo-tools"
SECONDS_EACH=${1:-60}
shift || true

say() { printf '[fuzz] %s\n' "$*"; }

export PATH="$TOOL_ROOT/bin:$PATH"
if ! cargo fuzz --version 2>/dev/null | grep -q "cargo-fuzz $CARGO_FUZZ_VERSION"; then
  say "cargo install cargo-fuzz $CARGO_FUZZ_VERSION into $TOOL_ROOT"
  cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked --root "$TOOL_ROOT" --quiet
fi

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
FUZZ_DIRS=(common/fuzz ccm/dhcp/fuzz)
FLAGS=(-s none -a)
wanted=("$@")
found=()

for dir in "${FUZZ_DIRS[@]}"; do
  cd "$ROOT/$dir"
  mapfile -t all < <(cargo fuzz list)
  targets=()
  for t in "${all[@]}"; do
    if [ ${#wanted[@]} -eq 0 ] || printf '%s\n' "${wanted[@]}" | grep -qx -- "$t"; then
      targets+=("$t")
    fi
  done
  [ ${#targets[@]} -gt 0 ] || continue
  found+=("${targets[@]}")

  say "$dir: cargo fuzz build ${FLAGS[*]} (${targets[*]})"
  cargo fuzz build "${FLAGS[@]}"

  for t in "${targets[@]}"; do
    mkdir -p "corpus/$t"
    say "$t: ${SECONDS_EACH}s"
    log=$(mktemp)
    status=0
    cargo fuzz run "${FLAGS[@]}" "$t" "corpus/$t" "seeds/$t" -- \
      -max_total_time="$SECONDS_EACH" -print_final_stats=1 >"$log" 2>&1 || status=$?
    if [ "$status" != 0 ]; then
      tail -n 40 "$log"
      rm -f "$log"
      say "$t: FAILED (input saved under $dir/artifacts/$t/)"
      exit "$status"
    fi
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 || true)
    rm -f "$log"
    say "$t: ok, $runs runs, $rate exec/s, ${cov:-cov: ?}, corpus $(find "corpus/$t" -type f | wc -l) files"
  done
done

for t in "${wanted[@]}"; do
  if ! printf '%s\n' "${found[@]}" | grep -qx -- "$t"; then
    say "no fuzz target named $t in ${FUZZ_DIRS[*]}"
    exit 2
  fi
done
