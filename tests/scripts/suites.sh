#!/usr/bin/env bash
# `make test`'s unit, property and test-bed suites: built once, then run in LANES lanes side by
# side (default 2; LANES=1 runs them one after another, as `cargo test --workspace` did), each
# lane's output in target/suite-logs/<lane>.log, then a table of every suite's time and one
# line with the totals. Exits non-zero if any lane failed.
#
# Why lanes: most suites wait (API servers, watches, hot-plug delays) more than they compute, so
# two run side by side in about the time of the longer. The suites that boot QEMU guests or use
# what exists once per machine (the Pod bridge, the NFS server's port 2049, the provider's default
# port 10258, /dev/disk/by-id) are all in lane `machine`, one after another, never beside each
# other; the rest is in lane `bed`. The CSI suites' reruns under the other gate sets use nothing
# once per machine; they run in lane `machine`, so that the lanes take about as long
# (docs/testbed.md, "Test time"), and on a fresh machine lane `machine` runs them while the node
# tools still build (they wait only for KubeVirt v1.6.1 and v1.7.0, built first).
# Ports, bed directories and network namespace names are per process (util::process::free_port
# reserves its ports across processes), so the lanes share nothing else.
# The real guest cluster's tools (tests/scripts/node-tools.sh: 14-15 minutes of Go builds beside the
# lanes on a fresh machine, a few seconds of checks once built) are built in the background while
# the lanes run the suites that do not need them. The three suites that need them (real_cluster,
# install_docs, images) run last in their lanes and wait for that build; if it failed, they fail
# with its log. The build runs at the lanes' priority (NODE_TOOLS_NICE, default 0), not niced: niced
# it took only what the lanes left (18-22 minutes on a fresh machine), and lane `machine` then
# waited for it 2-6 minutes before real_cluster and install_docs, which wait on the guest cluster
# more than they compute (the cores about 30 % busy) and so are the part of the run best overlapped
# with CPU-bound suites.
# KubeVirt's virt-api and virt-controller (tests/scripts/kubevirt.sh: three lines, about 5 minutes
# of Go builds each on a fresh machine, 0.04 s of checks once built) are built the same way, in the
# same background session (one Go build at a time beside the lanes): first v1.6.1 and v1.7.0, for
# every suite that hot-plugs and the CSI suites' reruns (build `kubevirt-first`), then the node
# tools, then v1.8.0 for the suite kubevirt_real and csi-sanity, last in lane `machine` (build
# `kubevirt`).
#
#   tests/scripts/suites.sh          # both lanes
#   LANES=1 tests/scripts/suites.sh  # one after another
set -euo pipefail
cd "$(dirname "$0")/../.."

CARGO=${CARGO:-cargo}
LANES=${LANES:-2}
LOGS=target/suite-logs
mkdir -p "$LOGS"
rm -f "$LOGS"/*.log

say() { printf '[suites] %s\n' "$*"; }

# The suites of lane `machine`: QEMU guests (guest_vm, contract_guestosinfo), the real guest
# cluster (real_cluster, install_docs), the NFS server on port 2049 (csi_rwx) and the provider's
# default HTTPS port 10258, which the real cluster's hostNetwork provider binds too (dropin_args).
MACHINE=(real_cluster install_docs guest_vm csi_rwx contract_guestosinfo dropin_args)
# The suites that start the real guest cluster or build its images: they wait for node-tools.sh.
NEEDS_NODE_TOOLS=(real_cluster install_docs images)
# The suites that hot-plug: their beds run KubeVirt's own virt-api and virt-controller
# (BedOptions::hotplugging: v1.6.1 with HotplugVolumes, Harvester v1.7's line, unless
# TESTBED_KUBEVIRT names another); they wait for the build kubevirt-first.
HOTPLUGGING=(csi_sanity csi_node csi_hardening chaos_csi csi_backup deploy_rbac csi_listing
  csi_tenancy ops_csi contract_hotplug contract_kubevirt_admission csi_hotplug_mode guest_vm csi_rwx)
# The suite that runs every KubeVirt line: it waits for kubevirt.sh (lane `machine`, last, where
# it balances the lanes).
NEEDS_KUBEVIRT=(kubevirt_real)
# The CSI suites again under each other gate set Harvester can run: v1.8's
# DeclarativeHotplugVolumes alone (KubeVirt v1.7.0) and (a focused subset) both gates.
CSI_SUITES=(csi_sanity csi_node csi_hardening chaos_csi csi_backup deploy_rbac)
CSI_BOTH_GATES=(csi_sanity chaos_csi)
# csi-sanity alone on KubeVirt v1.8.0 with the declarative gate (Harvester v1.9), last in lane
# `machine` once that line is built: the driver's hot-plug requests are the same on v1.7.0 and
# v1.8.0 (pkg/virt-api/rest/volumes.go, docs/testbed.md's contract table), and kubevirt_real runs
# each line's own cases.
CSI_OTHER_LINES=(csi_sanity)
# Not rerun under the other gate sets, since a gate changes how a volume is hot-plugged and
# nothing else: csi-sanity's size and order variants (the full mount and block runs, which are
# rerun, reach every hot-plug path csi-sanity does), the cloud provider's RBAC tests in
# deploy_rbac (the provider hot-plugs nothing), the two tests of requests refused before any
# hot-plug, and the tests that set each gate set themselves.
GATE_RERUN_SKIP=(csi_sanity_passes_with_1_byte_volumes_root
  csi_sanity_passes_with_1_gib_plus_1_byte_volumes_root csi_sanity_passes_in_random_order_root
  cloud_provider_runs_node_and_load_balancer_flows_with_only_the_documented_rbac
  cloud_provider_leader_election_fits_the_chart_role csi_node_plugin_account_reads_only
  requests_missing_a_field_get_invalid_argument_naming_it bad_backup_input_is_refused_naming_it
  node_paths_outside_the_kubelet_dir_are_refused
  a_volume_of_a_powered_off_node_moves_after_the_out_of_service_taint_on_harvester_1_7_root
  a_volume_of_a_powered_off_node_moves_after_the_out_of_service_taint_on_harvester_1_8_root
  a_volume_of_a_powered_off_node_moves_after_the_out_of_service_taint_with_both_gates_root)

tests_args() { local t; for t in "$@"; do printf -- '--test %s ' "$t"; done; }
# The test filter of a gate rerun: `-- --exact --skip NAME ...` for each of GATE_RERUN_SKIP.
rerun_filter() { local t; printf -- '-- --exact '; for t in "${GATE_RERUN_SKIP[@]}"; do printf -- '--skip %s ' "$t"; done; }
# listed LIST_NAME SUITE: whether SUITE is in the array named LIST_NAME.
listed() { local -n list=$1; local m; for m in "${list[@]}"; do [ "$m" = "$2" ] && return 0; done; return 1; }

# Each lane's suites in three parts: those that run at once, those that wait for KubeVirt's
# first lines, and those that wait for node-tools.sh.
BED=() BED_HOTPLUG=() BED_LATE=() MACHINE_EARLY=() MACHINE_HOTPLUG=() MACHINE_LATE=()
for f in tests/tests/*.rs; do
  t=$(basename "$f" .rs)
  if listed MACHINE "$t" || listed NEEDS_KUBEVIRT "$t"; then continue; fi
  if listed NEEDS_NODE_TOOLS "$t"; then BED_LATE+=("$t");
  elif listed HOTPLUGGING "$t"; then BED_HOTPLUG+=("$t");
  else BED+=("$t"); fi
done
for t in "${MACHINE[@]}"; do
  if listed NEEDS_NODE_TOOLS "$t"; then MACHINE_LATE+=("$t");
  elif listed HOTPLUGGING "$t"; then MACHINE_HOTPLUG+=("$t");
  else MACHINE_EARLY+=("$t"); fi
done

# The integration tests of the other packages (ccm/tests, csi/tests, ...), in lane `bed`.
OTHERS=()
for f in */tests/*.rs */*/tests/*.rs; do
  [ -e "$f" ] && [ "${f#tests/}" = "$f" ] && OTHERS+=("$(basename "$f" .rs)")
done

# The lanes: each runs its cargo commands in order and stops at the first failure. Every command
# selects the whole workspace, as the build below does: cargo resolves features over the selected
# packages, so `-p testbed` or `--exclude testbed` would compile kube, the binaries and the bed
# again with another feature set inside the lanes (4 minutes of a cold run's 2 cores).
lane_bed() {
  $CARGO test --workspace --lib --bins
  $CARGO test --workspace --doc
  # shellcheck disable=SC2046
  $CARGO test --workspace $(tests_args "${OTHERS[@]}" "${BED[@]}")
  wait_build kubevirt-first
  # shellcheck disable=SC2046
  $CARGO test --workspace $(tests_args "${BED_HOTPLUG[@]}")
  wait_build node-tools
  # shellcheck disable=SC2046
  $CARGO test --workspace $(tests_args "${BED_LATE[@]}")
}
lane_machine() {
  # shellcheck disable=SC2046
  $CARGO test --workspace $(tests_args "${MACHINE_EARLY[@]}")
  wait_build kubevirt-first
  # shellcheck disable=SC2046
  $CARGO test --workspace $(tests_args "${MACHINE_HOTPLUG[@]}")
  say "the CSI suites again on Harvester v1.8, real KubeVirt v1.7.0 (TESTBED_KUBEVIRT=v1.7-declarative)"
  # shellcheck disable=SC2046
  TESTBED_KUBEVIRT=v1.7-declarative $CARGO test --workspace $(tests_args "${CSI_SUITES[@]}") $(rerun_filter)
  say "a CSI subset with HotplugVolumes enabled again, real KubeVirt v1.7.0 (TESTBED_KUBEVIRT=v1.7-both)"
  # shellcheck disable=SC2046
  TESTBED_KUBEVIRT=v1.7-both $CARGO test --workspace $(tests_args "${CSI_BOTH_GATES[@]}") $(rerun_filter)
  wait_build node-tools
  # shellcheck disable=SC2046
  $CARGO test --workspace $(tests_args "${MACHINE_LATE[@]}")
  wait_build kubevirt
  # shellcheck disable=SC2046
  $CARGO test --workspace $(tests_args "${NEEDS_KUBEVIRT[@]}")
  say "csi-sanity on real KubeVirt v1.8.0 (TESTBED_KUBEVIRT=v1.8-declarative)"
  # shellcheck disable=SC2046
  TESTBED_KUBEVIRT=v1.8-declarative $CARGO test --workspace $(tests_args "${CSI_OTHER_LINES[@]}") $(rerun_filter)
}

# The background builds, one after another in a session of their own (killed as a whole if this
# script ends first): kubevirt-first, node-tools, kubevirt. Each holds an exclusive flock on
# $LOGS/<name>.lock until it ends: the lanes, started after, wait for it with a shared flock (no
# polling) and read its exit code from $LOGS/<name>.status; its output goes to $LOGS/<name>.log.
builds_pid=
start_builds() {
  rm -f "$LOGS"/{kubevirt-first,node-tools,kubevirt}.status
  exec 7>"$LOGS/kubevirt-first.lock" 8>"$LOGS/node-tools.lock" 9>"$LOGS/kubevirt.lock"
  flock -x 7
  flock -x 8
  flock -x 9
  # shellcheck disable=SC2016
  NICE=${NODE_TOOLS_NICE:-0} setsid bash -c '
    KUBEVIRT_VERSIONS="1.6.1 1.7.0" bash tests/scripts/kubevirt.sh >"$1/kubevirt-first.log" 2>&1
    echo $? >"$1/kubevirt-first.status"
    exec 7>&-
    bash tests/scripts/node-tools.sh >"$1/node-tools.log" 2>&1; echo $? >"$1/node-tools.status"
    exec 8>&-
    bash tests/scripts/kubevirt.sh >"$1/kubevirt.log" 2>&1; echo $? >"$1/kubevirt.status"' \
    _ "$LOGS" &
  builds_pid=$!
  # The background session alone holds the locks now.
  exec 7>&- 8>&- 9>&-
}
stop_builds() {
  [ -n "$builds_pid" ] && kill -- -"$builds_pid" 2>/dev/null || true
}
# wait_build NAME: waits for the background build NAME (kubevirt-first, node-tools or kubevirt);
# fails with the end of its log if it failed.
wait_build() {
  local t0 rc
  t0=$(date +%s)
  say "waiting for the build $1 (log: $LOGS/$1.log)"
  flock -s "$LOGS/$1.lock" true
  rc=$(cat "$LOGS/$1.status" 2>/dev/null || echo "none (killed?)")
  if [ "$rc" != 0 ]; then
    say "the build $1 failed (exit $rc); the last lines of its log:"
    tail -n 30 "$LOGS/$1.log"
    return 1
  fi
  say "$1 ready (waited $(( $(date +%s) - t0 ))s)"
}

start=$(date +%s)
trap stop_builds EXIT
say "building KubeVirt v1.6.1 and v1.7.0, the node tools, then KubeVirt v1.8.0 in the background (logs: $LOGS/kubevirt-first.log, $LOGS/node-tools.log, $LOGS/kubevirt.log)"
start_builds
say "building every test target once"
$CARGO test --workspace --no-run
say "built in $(( $(date +%s) - start ))s"

# run_lane NAME: runs lane_NAME with its output in $LOGS/NAME.log (and, with one lane, on the
# terminal too); records its exit code and time.
run_lane() {
  local name=$1 t0 rc
  t0=$(date +%s)
  set +e
  if [ "$LANES" = 1 ]; then
    ( set -e; "lane_$name" ) 2>&1 | tee "$LOGS/$name.log"
    rc=${PIPESTATUS[0]}
  else
    ( set -e; "lane_$name" ) >"$LOGS/$name.log" 2>&1
    rc=$?
  fi
  set -e
  echo "$rc $(( $(date +%s) - t0 ))" >"$LOGS/$name.status"
}

runs_start=$(date +%s)
if [ "$LANES" = 1 ]; then
  run_lane bed
  run_lane machine
else
  say "lanes bed and machine side by side; logs: $LOGS/bed.log, $LOGS/machine.log"
  run_lane machine &
  machine_pid=$!
  run_lane bed
  wait "$machine_pid" || true
  for name in bed machine; do
    echo "===== lane $name ====="
    cat "$LOGS/$name.log"
  done
fi
echo "===== KubeVirt v1.6.1 and v1.7.0 (background) ====="
cat "$LOGS/kubevirt-first.log" 2>/dev/null || echo "(not started)"
echo "===== node tools (background) ====="
cat "$LOGS/node-tools.log"
echo "===== KubeVirt (background) ====="
cat "$LOGS/kubevirt.log" 2>/dev/null || echo "(not started)"

# Per suite: `Running <target>` then its `test result: ... finished in Xs`; the gate reruns are
# named by the TESTBED_KUBEVIRT they ran under.
echo
say "suite times (seconds; lane, suite, tests, result)"
for name in bed machine; do
  awk -v lane="$name" '
    /TESTBED_KUBEVIRT=v1.7-declarative/ { gate = " (KubeVirt v1.7 declarative)" }
    /TESTBED_KUBEVIRT=v1.7-both/ { gate = " (KubeVirt v1.7 both gates)" }
    /TESTBED_KUBEVIRT=v1.8-declarative/ { gate = " (KubeVirt v1.8)" }
    /waiting for the build / { gate = "" }
    /^ *Running / {
      target = $2
      if ($2 == "unittests") { target = $4; sub(/.*\//, "", target); sub(/-[0-9a-f]+\)$/, "", target); target = "unittests " target }
    }
    /^ *Doc-tests / { target = "doc " $2 }
    /^test result:/ {
      t = $0; sub(/.*finished in /, "", t); sub(/s.*/, "", t)
      printf "%8.1f  %-7s %s%s  %s passed, %s failed\n", t, lane, target, gate, $4, $6
    }' "$LOGS/$name.log"
done | sort -rn
passed=0 failed=0
for name in bed machine; do
  read -r p f < <(awk '/^test result:/ { p += $4; f += $6 } END { print p + 0, f + 0 }' "$LOGS/$name.log")
  passed=$((passed + p)); failed=$((failed + f))
done
status=0
for name in bed machine; do
  read -r rc secs <"$LOGS/$name.status"
  say "lane $name: exit $rc in ${secs}s"
  [ "$rc" = 0 ] || status=1
done
say "suites ran in $(( $(date +%s) - runs_start ))s (with the build: $(( $(date +%s) - start ))s)"
echo "suites: $passed passed, $failed failed"
exit "$status"
