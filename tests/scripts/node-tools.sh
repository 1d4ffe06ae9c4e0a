#!/usr/bin/env bash
# Builds what a real guest node of the test bed needs (issue 15) into a version-keyed cache outside
# the repo, and installs containerd, runc and the CNI plugins from Debian. Idempotent: a second run
# only checks. Not called by tools.sh or `make test` yet (`make node-tools`).
#
#   tests/scripts/node-tools.sh              # everything
#   tests/scripts/node-tools.sh --print-dir  # prints the node tool directory and exits
#
# Go binaries are built one at a time (the machine is shared); set NICE=0 to build at normal
# priority. Each build's log and time go to $CACHE_ROOT/logs/build-<name>.log.
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-1.34.4}
# CSI sidecars at versions the Go module proxy serves here (node-driver-registrar and livenessprobe
# are not served at all: the bed plays them with its own `registrar` and `livenessprobe` binaries,
# tests/src/real/{registrar,livenessprobe}.rs).
PROVISIONER_VERSION=${PROVISIONER_VERSION:-6.4.0}
ATTACHER_VERSION=${ATTACHER_VERSION:-4.13.0}
RESIZER_VERSION=${RESIZER_VERSION:-2.3.0}
SNAPSHOTTER_VERSION=${SNAPSHOTTER_VERSION:-8.7.0}

CACHE_ROOT=${HARVESTER_TESTBED_CACHE:-$HOME/.cache/harvester-testbed}
NODE_TOOLS_DIR="$CACHE_ROOT/node-tools-k8s$K8S_VERSION-prov$PROVISIONER_VERSION-att$ATTACHER_VERSION-res$RESIZER_VERSION-snap$SNAPSHOTTER_VERSION"

if [ "${1:-}" = "--print-dir" ]; then echo "$NODE_TOOLS_DIR"; exit 0; fi

mkdir -p "$NODE_TOOLS_DIR" "$CACHE_ROOT/logs"
export GOFLAGS=-buildvcs=false
export CGO_ENABLED=0
NICE=${NICE:-19}

say() { printf '[node-tools] %s\n' "$*"; }
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

# --- Debian packages ------------------------------------------------------------------------
# busybox-static: the shell and coreutils of the test Pods' image (a static binary, no libraries).
install_debs --no-install-recommends -- containerd runc containernetworking-plugins busybox-static iproute2
# Debian's containerd.service would start a second containerd on /run/containerd; the bed runs its
# own with its own config, so nothing here starts the packaged one (no systemd as PID 1 anyway).

# --- Go tools ------------------------------------------------------------------------------
# build NAME FUNCTION ARGS...: runs FUNCTION once unless $NODE_TOOLS_DIR/NAME exists; logs to the
# cache and records the build time beside the binary (NAME.build-seconds).
build() {
  local name=$1 fn=$2 log="$CACHE_ROOT/logs/build-$1.log" start secs
  shift 2
  if [ -x "$NODE_TOOLS_DIR/$name" ]; then return 0; fi
  say "building $name (log: $log)"
  start=$(date +%s)
  # In the background, so that set -e holds inside (an `if !` would switch it off there).
  ( "$fn" "$name" "$@" ) >"$log" 2>&1 &
  if ! wait $!; then
    say "FAILED to build $name; last lines of $log:" >&2
    tail -n 30 "$log" >&2
    exit 1
  fi
  secs=$(( $(date +%s) - start ))
  echo "$secs" >"$NODE_TOOLS_DIR/$name.build-seconds"
  say "built $name in ${secs}s"
}

# The kubelet, kube-controller-manager, kube-scheduler, kubectl: k8s.io/kubernetes replaces its staging
# modules with ./staging paths, so `go install` refuses them. A wrapper module replaces each with
# its published v0.X.Y instead (the recipe of tools.sh's kube-apiserver; same go build cache).
build_k8s() {
  set -euo pipefail
  local name=$1 minor staging w gomod
  minor=$(echo "$K8S_VERSION" | cut -d. -f2)
  staging="v0.${K8S_VERSION#1.}"
  w=$(mktemp -d); trap "rm -rf '$w'" EXIT
  cd "$w"
  go mod init "local.test/$name"
  gomod=$(go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  for m in $(sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => \./staging/.*#\1#p' "$gomod"); do
    go mod edit -replace="$m=$m@$staging"
  done
  go get "k8s.io/kubernetes/cmd/$name@v$K8S_VERSION"
  local ld="-s -w -X k8s.io/component-base/version.gitVersion=v$K8S_VERSION \
    -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor \
    -X k8s.io/component-base/version.gitTreeState=clean"
  nice -n "$NICE" go build -trimpath -pgo=off -ldflags "$ld" -o "$NODE_TOOLS_DIR/$name.tmp" "k8s.io/kubernetes/cmd/$name"
  mv "$NODE_TOOLS_DIR/$name.tmp" "$NODE_TOOLS_DIR/$name"
}

# The CSI sidecars. Each MODULE@VERSION carries `replace` lines in its go.mod, which only apply when
# it is the main module, so `go install MODULE/cmd/X@VERSION` fails. A wrapper module repeats every
# replace that points at a published module version; a replace to a local path (the snapshotter's
# `client/v8 => ./client`) is dropped and the version its require line pins is used instead.
#
# The sidecars of one group share one wrapper module: one set of dependency versions (the highest
# any of them requires; a module two of them replace differently takes the later one, logged), so
# client-go, apimachinery, grpc and the rest are compiled once for the group instead of once per
# sidecar. The provisioner pins k8s.io/* to 0.36.1 where the others pin 0.37.0; it comes first, so
# the others' replaces win and it builds against 0.37.0 too (its binary imports no package of the
# k8s.io/kubernetes its go.mod requires, and its code compiles unchanged): built apart it compiled
# 1 113 packages beside the standard library (`go list -deps`), about 550 s of the cold node tools
# on 2 cores; in the group it adds 58 to the other four's 1 107.
#
# sidecar_group GROUP NAME:MODULE:VERSION:PKG...: builds each NAME of the group that is missing.
sidecar_group() {
  local group=$1 spec name missing=0
  shift
  for spec in "$@"; do
    name=${spec%%:*}
    [ -x "$NODE_TOOLS_DIR/$name" ] || missing=1
  done
  [ "$missing" = 1 ] || return 0
  local log="$CACHE_ROOT/logs/build-$group.log" start secs
  say "building $group: ${*%%:*} (log: $log)"
  start=$(date +%s)
  ( build_sidecar_group "$@" ) >"$log" 2>&1 &
  if ! wait $!; then
    say "FAILED to build $group; last lines of $log:" >&2
    tail -n 30 "$log" >&2
    exit 1
  fi
  secs=$(( $(date +%s) - start ))
  for spec in "$@"; do echo "$secs" >"$NODE_TOOLS_DIR/${spec%%:*}.build-seconds"; done
  say "built $group in ${secs}s"
}

build_sidecar_group() {
  set -euo pipefail
  local spec name module version pkg w gomod old new ver gets=()
  w=$(mktemp -d); trap "rm -rf '$w'" EXIT
  cd "$w"
  go mod init "local.test/csi-sidecars"
  for spec in "$@"; do
    IFS=: read -r name module version pkg <<<"$spec"
    gomod=$(go mod download -json "$module@v$version" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
    # single-line `replace A => B V` and lines inside a `replace ( ... )` block
    while read -r old new ver; do
      case "$new" in ./*|../*) echo "$name: dropping local replace $old => $new"; continue ;; esac
      if go mod edit -json | grep -q "\"Path\": \"$old\""; then
        echo "$name: replace $old => $new $ver (over an earlier sidecar's)"
      else
        echo "$name: replace $old => $new $ver"
      fi
      go mod edit -replace="$old=$new@$ver"
    done < <(awk '
      /^replace \($/ { inblock = 1; next }
      inblock && /^\)/ { inblock = 0; next }
      inblock && $2 == "=>" { print $1, $3, $4; next }
      /^replace / && $3 == "=>" { print $2, $4, $5 }
    ' "$gomod")
    gets+=("$module/$pkg@v$version")
  done
  go get "${gets[@]}"
  for spec in "$@"; do
    IFS=: read -r name module version pkg <<<"$spec"
    nice -n "$NICE" go build -trimpath -ldflags "-s -w -X main.version=v$version" -o "$NODE_TOOLS_DIR/$name.tmp" "$module/$pkg"
    mv "$NODE_TOOLS_DIR/$name.tmp" "$NODE_TOOLS_DIR/$name"
  done
}

total_start=$(date +%s)
build kubelet build_k8s
build kube-controller-manager build_k8s
build kube-scheduler build_k8s
# kubectl for the user of `make cluster` (its banner prints commands with this path). `build` checks
# each binary, so a cache made before kubectl was added gets it on the next run without a new key.
build kubectl build_k8s
sidecar_group csi-sidecars \
  "csi-provisioner:github.com/kubernetes-csi/external-provisioner/v6:$PROVISIONER_VERSION:cmd/csi-provisioner" \
  "csi-attacher:github.com/kubernetes-csi/external-attacher/v4:$ATTACHER_VERSION:cmd/csi-attacher" \
  "csi-resizer:github.com/kubernetes-csi/external-resizer/v2:$RESIZER_VERSION:cmd/csi-resizer" \
  "csi-snapshotter:github.com/kubernetes-csi/external-snapshotter/v8:$SNAPSHOTTER_VERSION:cmd/csi-snapshotter" \
  "snapshot-controller:github.com/kubernetes-csi/external-snapshotter/v8:$SNAPSHOTTER_VERSION:cmd/snapshot-controller"
say "node tools ready in $NODE_TOOLS_DIR ($(( $(date +%s) - total_start ))s)"
