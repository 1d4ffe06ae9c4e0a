#!/usr/bin/env bash
# The cloud provider's load-balancer suites against Harvester's real LB controller and webhook
# (harvester/load-balancer-harvester), built from a checkout you provide, instead of the bed's
# stand-ins (tests/src/sim/lb*.rs). `make test` cannot build them: no version of that module is on
# the Go module proxy. docs/testbed.md, "Harvester's real load balancer".
#
#   make lb-upstream LB_SRC=/path/to/load-balancer-harvester
#   LB_SRC=... LB_SUITES="lb_service bed" tests/scripts/lb-upstream.sh
#
# Builds `harvester-load-balancer` (main.go) and `webhook` (cmd/webhook) offline from the
# checkout's vendor/ into ~/.cache/harvester-testbed/lb-upstream-<id> (<id>: the tag and commit of
# a git checkout, else a hash of its files; a second run reuses it), then runs each suite with
# TESTBED_LB_UPSTREAM=<that dir>, one after another (the webhook serves on port 443, once per
# machine), and prints a table of the suites' results and times.
#
# A checkout whose vendor/ lacks the files of a package the programs import (a mirror without
# large blobs) is refused; LB_FILL_VENDOR=1 copies them into the checkout from the module
# (`go mod download` from the Go module proxy, the version vendor/modules.txt names). Files of
# packages the programs do not import may be missing: `go build -mod=vendor` does not read them.
set -euo pipefail
cd "$(dirname "$0")/../.."

CARGO=${CARGO:-cargo}
SUITES=${LB_SUITES:-bed lb_service lb_guest_pool lb_validator lb_bad_input_under_load lb_webhook lb_dhcp chaos_lb_malformed chaos_apiserver_restart chaos_ccm_kill dropin_args deploy_rbac deploy_rbac_forbidden}
say() { printf '[lb-upstream] %s\n' "$*"; }

src=${LB_SRC:-}
if [ -z "$src" ] || [ ! -f "$src/go.mod" ]; then
  say "LB_SRC must name a checkout of harvester/load-balancer-harvester (a directory with go.mod)" >&2
  exit 2
fi
src=$(cd "$src" && pwd)
grep -q '^module github.com/harvester/harvester-load-balancer$' "$src/go.mod" || {
  say "$src/go.mod is not github.com/harvester/harvester-load-balancer" >&2
  exit 2
}

# missing_vendor: the packages the two programs import whose vendor/ directory holds no .go file
# (vendor/modules.txt lists them), one "<module>@<version> <package>" a line.
missing_vendor() {
  local deps
  deps=$(cd "$src" && GOTOOLCHAIN=local GOFLAGS=-mod=vendor go list -e -deps . ./cmd/webhook)
  awk '/^# /{mod=$2; ver=$3; if ($4=="=>") {mod=$5; ver=$6}; next} /^##/{next} {print mod "@" ver, $1}' \
    "$src/vendor/modules.txt" |
    while read -r modver pkg; do
      grep -qxF "$pkg" <<<"$deps" || continue
      compgen -G "$src/vendor/$pkg/*.go" >/dev/null || echo "$modver $pkg"
    done
}

missing=$(missing_vendor)
if [ -n "$missing" ]; then
  if [ "${LB_FILL_VENDOR:-}" != 1 ]; then
    say "$src/vendor lacks the files of these packages (module, package):" >&2
    printf '  %s\n' "$missing" >&2
    say "rerun with LB_FILL_VENDOR=1 to copy them from the Go module proxy into the checkout" >&2
    exit 2
  fi
  while read -r modver pkg; do
    dir=$(cd "${TMPDIR:-/tmp}" && GOFLAGS= GOTOOLCHAIN=local go mod download -json "$modver" |
      sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
    [ -n "$dir" ] || { say "go mod download $modver gave no directory" >&2; exit 1; }
    sub=${pkg#"${modver%@*}"}
    say "vendor/$pkg <- $dir$sub"
    mkdir -p "$src/vendor/$pkg"
    find "$dir$sub" -maxdepth 1 -type f ! -name '*_test.go' -exec cp {} "$src/vendor/$pkg/" \;
    chmod -R u+w "$src/vendor/$pkg"
  done <<<"$missing"
fi

if git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
  id=$(git -C "$src" describe --tags --always --dirty)-$(git -C "$src" rev-parse --short=12 HEAD)
else
  id=files-$( (cd "$src" && find . -path ./.git -prune -o -type f -print0 | LC_ALL=C sort -z |
    xargs -0 sha256sum) | sha256sum | cut -c1-16)
fi
bin=${HOME}/.cache/harvester-testbed/lb-upstream-$id
if [ -x "$bin/harvester-load-balancer" ] && [ -x "$bin/webhook" ]; then
  say "built already: $bin"
else
  say "building harvester-load-balancer and webhook from $src into $bin"
  start=$(date +%s)
  mkdir -p "$bin.tmp"
  (cd "$src" && GOTOOLCHAIN=local GOFLAGS=-mod=vendor CGO_ENABLED=0 \
    go build -o "$bin.tmp/" . ./cmd/webhook)
  rm -rf "$bin" && mv "$bin.tmp" "$bin"
  say "built in $(( $(date +%s) - start ))s"
fi

# The release whose webhook rules the suites expect (TESTBED_LB_WEBHOOK): v1.9 keeps a network
# the provider sets and reads the management-network annotation; v1.7-v1.8 re-derive it.
if grep -q 'cloudprovider.harvesterhci.io/managementNetwork\|ManagementNetwork' \
  "$src/pkg/webhook/loadbalancer/mutator.go"; then rules=v1.9; else rules=v1.8; fi
say "webhook rules of $rules (TESTBED_LB_WEBHOOK)"

# The workspace's programs and only these suites' test binaries.
tests=()
for suite in $SUITES; do tests+=(--test "$suite"); done
$CARGO build --quiet --workspace --bins
$CARGO build --quiet -p testbed "${tests[@]}"
logs=target/lb-upstream-logs/$id
mkdir -p "$logs"
results=()
failed=0
for suite in $SUITES; do
  start=$(date +%s)
  say "suite $suite (log $logs/$suite.log)"
  if TESTBED_LB_UPSTREAM=$bin TESTBED_LB_WEBHOOK=$rules $CARGO test --quiet -p testbed --test "$suite" -- --test-threads=1 --nocapture \
    >"$logs/$suite.log" 2>&1; then status=ok; else status=FAILED; failed=1; fi
  counts=$(grep -E '^test result:' "$logs/$suite.log" | tail -1 |
    sed -E 's/.* ([0-9]+) passed; ([0-9]+) failed;.*/\1 passed, \2 failed/')
  skipped=$( (grep -o 'SKIPPED [a-z_0-9]*' "$logs/$suite.log" || true) | wc -l)
  results+=("$(printf '%-26s %-7s %-22s %3s skipped %5ss' "$suite" "$status" "${counts:-no result}" "$skipped" "$(( $(date +%s) - start ))")")
done
say "results against $id ($src):"
printf '  %s\n' "${results[@]}"
grep -ho 'SKIPPED .*' "$logs"/*.log | sed 's/^/  /' || true
exit $failed
