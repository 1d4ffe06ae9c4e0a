#!/usr/bin/env bash
# Builds the test bed's Go tools from the Go module proxy into a version-keyed cache outside the
# repo, and installs the Debian packages the tests use. Idempotent: a second run only checks.
#
#   tests/scripts/tools.sh            # everything
#   tests/scripts/tools.sh --print-dir  # prints the tool directory and exits
#
# Versions are pinned here; the cache directory name carries them, so a change rebuilds.
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-1.34.4}
ETCD_VERSION=${ETCD_VERSION:-3.6.16}
CSI_TEST_VERSION=${CSI_TEST_VERSION:-5.6.0}
HELM_VERSION=${HELM_VERSION:-3.19.0}

CACHE_ROOT=${HARVESTER_TESTBED_CACHE:-$HOME/.cache/harvester-testbed}
TOOLS_DIR="$CACHE_ROOT/tools-k8s$K8S_VERSION-etcd$ETCD_VERSION-csitest$CSI_TEST_VERSION-helm$HELM_VERSION"

if [ "${1:-}" = "--print-dir" ]; then echo "$TOOLS_DIR"; exit 0; fi

mkdir -p "$TOOLS_DIR" "$CACHE_ROOT/logs"
export GOFLAGS=-buildvcs=false
export CGO_ENABLED=0

say() { printf '[tools] %s\n' "$*"; }
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

# --- Debian packages ------------------------------------------------------------------------
DEBS=(e2fsprogs xfsprogs util-linux mount dnsmasq-base iproute2 openssl)
install_debs -- "${DEBS[@]}"
# skopeo: the images test copies the OCI archives of `make images` with it, as docs/install.md
# pushes them (Debian 12: skopeo 1.9.3).
install_debs --no-install-recommends -- skopeo
# The NFS server of the RWX tests (the stand-in's networkfs-manager exports volumes with it): a
# userspace NFSv4 server, since the host kernel has no nfsd. Debian 12: nfs-ganesha 4.3. nfs-common:
# mount.nfs for the CSI node image (tests/src/real/images/).
install_debs --no-install-recommends -- nfs-common nfs-ganesha nfs-ganesha-vfs

# --- Go tools ------------------------------------------------------------------------------
# build NAME FUNCTION: runs FUNCTION once unless $TOOLS_DIR/NAME exists; logs to the cache.
build() {
  local name=$1 fn=$2 log="$CACHE_ROOT/logs/build-$1.log" start
  if [ -x "$TOOLS_DIR/$name" ]; then return 0; fi
  say "building $name (log: $log)"
  start=$(date +%s)
  # In the background, so that set -e holds inside (an `if !` would switch it off there).
  ( "$fn" ) >"$log" 2>&1 &
  if ! wait $!; then
    say "FAILED to build $name; last lines of $log:" >&2
    tail -n 30 "$log" >&2
    exit 1
  fi
  say "built $name in $(( $(date +%s) - start ))s"
}

# kube-apiserver: k8s.io/kubernetes replaces its staging modules with ./staging paths, so
# `go install` refuses it. A wrapper module replaces each with its published v0.X.Y instead.
build_kube_apiserver() {
  set -euo pipefail
  local minor staging w gomod
  minor=$(echo "$K8S_VERSION" | cut -d. -f2)
  staging="v0.${K8S_VERSION#1.}"
  w=$(mktemp -d); trap "rm -rf '$w'" EXIT
  cd "$w"
  go mod init local.test/kube-apiserver
  gomod=$(go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  for m in $(sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => \./staging/.*#\1#p' "$gomod"); do
    go mod edit -replace="$m=$m@$staging"
  done
  go get "k8s.io/kubernetes/cmd/kube-apiserver@v$K8S_VERSION"
  local ld="-s -w -X k8s.io/component-base/version.gitVersion=v$K8S_VERSION \
    -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor \
    -X k8s.io/component-base/version.gitTreeState=clean"
  go build -trimpath -pgo=off -ldflags "$ld" -o "$TOOLS_DIR/kube-apiserver.tmp" k8s.io/kubernetes/cmd/kube-apiserver
  mv "$TOOLS_DIR/kube-apiserver.tmp" "$TOOLS_DIR/kube-apiserver"
}

# etcd: server/v3 has replace directives too; its require lines pin the siblings, so a wrapper
# module with no replaces resolves.
build_etcd() {
  set -euo pipefail
  local w; w=$(mktemp -d); trap "rm -rf '$w'" EXIT
  cd "$w"
  go mod init local.test/etcd
  go get "go.etcd.io/etcd/server/v3@v$ETCD_VERSION"
  go build -trimpath -ldflags "-s -w" -o "$TOOLS_DIR/etcd.tmp" go.etcd.io/etcd/server/v3
  mv "$TOOLS_DIR/etcd.tmp" "$TOOLS_DIR/etcd"
}

build_csi_sanity() {
  GOBIN="$TOOLS_DIR" go install -trimpath -ldflags "-s -w" \
    "github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity@v$CSI_TEST_VERSION"
}

build_helm() {
  GOBIN="$TOOLS_DIR" go install -trimpath -ldflags "-s -w" "helm.sh/helm/v3/cmd/helm@v$HELM_VERSION"
}

total_start=$(date +%s)
build etcd build_etcd
build kube-apiserver build_kube_apiserver
build csi-sanity build_csi_sanity
build helm build_helm
say "tools ready in $TOOLS_DIR ($(( $(date +%s) - total_start ))s)"

# --- guest VM image (kernel + initramfs from Debian's packages) for the VM backend -------------
guest_start=$(date +%s)
bash "$(dirname "${BASH_SOURCE[0]}")/guest.sh"
say "guest image checked in $(( $(date +%s) - guest_start ))s"
