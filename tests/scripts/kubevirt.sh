#!/usr/bin/env bash
# Builds KubeVirt's virt-api and virt-controller, and tests/kubevirt/install-manifests (what
# virt-operator would install: CRDs, webhooks, APIServices, RBAC), from the Go module proxy into
# a version-keyed cache outside the repo, one directory per KubeVirt line. Idempotent: a second
# run only checks. `make test` runs it in the background (tests/scripts/suites.sh) for the suite
# kubevirt_real; `make kubevirt` alone.
#
#   tests/scripts/kubevirt.sh                      # every version in KUBEVIRT_VERSIONS
#   KUBEVIRT_VERSIONS=1.7.0 tests/scripts/kubevirt.sh
#   tests/scripts/kubevirt.sh --print-dir 1.7.0    # prints that version's directory and exits
set -euo pipefail

KUBEVIRT_VERSIONS=${KUBEVIRT_VERSIONS:-1.6.1 1.7.0 1.8.0}

CACHE_ROOT=${HARVESTER_TESTBED_CACHE:-$HOME/.cache/harvester-testbed}
SRC_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/../kubevirt" && pwd)

kv_dir() { echo "$CACHE_ROOT/kubevirt-v$1"; }

if [ "${1:-}" = "--print-dir" ]; then
  [ -n "${2:-}" ] || { echo "usage: $0 --print-dir VERSION" >&2; exit 2; }
  kv_dir "${2#v}"; exit 0
fi

mkdir -p "$CACHE_ROOT/logs"
export GOFLAGS=-buildvcs=false
export CGO_ENABLED=0
# The kubevirt lines ask for go 1.23/1.24; never let a go directive download another toolchain.
export GOTOOLCHAIN=local

say() { printf '[kubevirt] %s\n' "$*"; }

BINS=(virt-api virt-controller install-manifests)

# The hash of install-manifests' source, kept beside it: an edit rebuilds install-manifests.
src_hash() { (cd "$SRC_DIR" && find . -type f -name '*.go' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16); }

# build_version VERSION BINARY...: one wrapper module next to kubevirt.io/kubevirt@vVERSION, then
# the named binaries.
build_version() {
  set -euo pipefail
  local v=$1 dir w gomod m r rv api_v cg_v ld b; shift
  dir=$(kv_dir "$v")
  w=$(mktemp -d); trap "rm -rf '$w'" EXIT
  cd "$w"
  go mod init local.test/kubevirt
  mkdir install-manifests && cp "$SRC_DIR"/install-manifests/*.go install-manifests/
  gomod=$(go mod download -json "kubevirt.io/kubevirt@v$v" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  # kubevirt's replace directives apply only in its own module: copy the versioned ones (k8s.io/*
  # pins, openshift, ...), and point its two staging modules (./staging/src/kubevirt.io/{api,
  # client-go}, not in the module zip) at their published copies.
  sed -n '/^replace (/,/^)/p' "$gomod" | grep '=>' | grep -v '=> \./' | while read -r m _ r rv; do
    go mod edit -replace="$m=$r@$rv"
  done
  api_v=$(served kubevirt.io/api "$v")
  cg_v=$(served kubevirt.io/client-go "$v")
  echo "kubevirt.io/api@$api_v kubevirt.io/client-go@$cg_v"
  go mod edit -replace="kubevirt.io/api=kubevirt.io/api@$api_v" \
    -replace="kubevirt.io/client-go=kubevirt.io/client-go@$cg_v"
  go get "kubevirt.io/kubevirt@v$v"
  go mod tidy
  # tidy keeps only what install-manifests imports; the commands' dependencies (and go.sum lines)
  # come from a go get of their packages.
  go get "kubevirt.io/kubevirt/cmd/virt-api@v$v" "kubevirt.io/kubevirt/cmd/virt-controller@v$v"
  # What virt-api reports at /version and virt-controller writes as the observed version.
  ld="-s -w -X kubevirt.io/client-go/version.gitVersion=v$v -X kubevirt.io/client-go/version.gitTreeState=clean"
  mkdir -p "$dir"
  cp go.mod "$dir/wrapper-go.mod"
  for b in "$@"; do
    case $b in
      install-manifests) go build -trimpath -ldflags "$ld" -o "$dir/$b.tmp" ./install-manifests ;;
      *) go build -trimpath -ldflags "$ld" -o "$dir/$b.tmp" "kubevirt.io/kubevirt/cmd/$b" ;;
    esac
    mv "$dir/$b.tmp" "$dir/$b"
  done
}

# served MODULE VERSION: VERSION if the proxy serves MODULE@vVERSION, else the highest lower patch
# of the same minor that it serves (kubevirt.io/client-go v1.6.1 is not published; v1.6.0 is).
served() {
  local m=$1 v=$2 maj min p
  IFS=. read -r maj min p <<<"$v"
  while [ "$p" -ge 0 ]; do
    if go mod download -json "$m@v$maj.$min.$p" >/dev/null 2>&1; then echo "v$maj.$min.$p"; return 0; fi
    p=$((p - 1))
  done
  echo "no version of $m for $v on the module proxy" >&2; return 1
}

total_start=$(date +%s)
hash=$(src_hash)
for v in $KUBEVIRT_VERSIONS; do
  v=${v#v}
  dir=$(kv_dir "$v") log="$CACHE_ROOT/logs/build-kubevirt-v$v.log"
  # install-manifests is rebuilt when its source changes (the hash in install-manifests.source).
  todo=()
  for b in virt-api virt-controller; do [ -x "$dir/$b" ] || todo+=("$b"); done
  if [ ! -x "$dir/install-manifests" ] || [ "$(cat "$dir/install-manifests.source" 2>/dev/null)" != "$hash" ]; then
    todo+=(install-manifests)
  fi
  [ ${#todo[@]} -eq 0 ] && continue
  say "building ${todo[*]} v$v (log: $log)"
  start=$(date +%s)
  # In the background, so that set -e holds inside (an `if !` or `||` would switch it off).
  ( build_version "$v" "${todo[@]}" ) >"$log" 2>&1 &
  if ! wait $!; then
    say "FAILED to build v$v; last lines of $log:" >&2
    tail -n 30 "$log" >&2
    exit 1
  fi
  echo "$hash" >"$dir/install-manifests.source"
  say "built v$v in $(( $(date +%s) - start ))s: $(cd "$dir" && du -m "${BINS[@]}" | awk '{printf "%s %s MiB; ", $2, $1}')"
done
say "kubevirt ready ($(( $(date +%s) - total_start ))s)"
