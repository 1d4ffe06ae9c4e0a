# The two commands of the README: `make demo` and `make test`. Everything they need is installed by
# tests/scripts/tools.sh and tests/scripts/node-tools.sh (Debian packages with apt-get, Go tools into
# ~/.cache/harvester-testbed).

SHELL := /bin/bash
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never

.PHONY: demo cluster images release test tools node-tools kubevirt proto-check fmt-check clippy unit-and-integration help-check bench charts-check fuzz lb-upstream

demo: tools
	$(CARGO) run --quiet -p testbed --bin testbed -- demo

# The real guest cluster (kubelet, containerd, control plane, both charts installed with helm, an
# IP pool on the Harvester side, KubeVirt v1.6.1's virt-api and virt-controller) until Ctrl-C; root. Prints a PATH export with the bed's kubectl
# and helm, the KUBECONFIG exports of both clusters and commands to try (a LoadBalancer Service).
cluster: tools node-tools
	@KUBEVIRT_VERSIONS=1.6.1 bash tests/scripts/kubevirt.sh
	$(CARGO) build --quiet --workspace --bins
	$(CARGO) run --quiet -p testbed --bin testbed -- cluster

# Not part of `make test` (a release build): the images harvester-cloud-provider and
# harvester-csi-driver as OCI archives in target/images/, tagged with the workspace version,
# from the release binaries and this Debian 12 host's mkfs/mount programs (tools.sh installs
# them). Reproducible; prints each archive's path and digests. docs/install.md, "Images".
IMAGE_PREFIX ?= localhost
images: release
	$(CARGO) run --release --quiet -p testbed --bin testbed -- images --prefix '$(IMAGE_PREFIX)'

# The two programs' release binaries (`images` and `bench` build them). They link glibc statically,
# position-independent, with packed relocations (static-pie, DT_RELR): they fault in no shared
# libc/libm pages and no 440 KiB relocation table, 1.4-1.9 MiB less resident each (docs/
# benchmarks.md, section 4); DNS still answers from /etc/hosts and resolv.conf (glibc 2.36 has
# no NSS modules to load for them). `cargo rustc` gives the flags to each program's final link
# alone: RUSTFLAGS would reach every crate, build script and proc macro (another full build).
STATIC_LINK := -C target-feature=+crt-static -C link-arg=-Wl,-z,pack-relative-relocs
release:
	$(CARGO) rustc --release -p harvester-cloud-provider --bin harvester-cloud-provider -- $(STATIC_LINK)
	$(CARGO) rustc --release -p harvester-csi-driver --bin harvester-csi-driver -- $(STATIC_LINK)

# Not part of `make test`: the load-balancer suites against Harvester's real LB controller and
# webhook, built from the harvester/load-balancer-harvester checkout LB_SRC names (no version of
# it is on the Go module proxy) instead of the bed's stand-ins. LB_SUITES picks suites,
# LB_FILL_VENDOR=1 fetches files missing from its vendor/. Its webhook listens on port 443 of
# every address: not beside `make test`, whose real guest cluster serves 10.96.0.1:443.
# docs/testbed.md, "Harvester's real load balancer".
lb-upstream: tools
	@LB_SRC='$(LB_SRC)' bash tests/scripts/lb-upstream.sh

# node-tools and kubevirt are not steps of their own here: tests/scripts/suites.sh builds them in
# the background beside the suites that do not need them (on a fresh 2-core machine 14-15 and
# about 15 minutes of Go builds).
test: tools proto-check fmt-check clippy help-check charts-check unit-and-integration

tools:
	@bash tests/scripts/tools.sh

# kubelet, kube-controller-manager, kube-scheduler, kubectl, the CSI sidecars and the snapshot-controller
# (Go module proxy), containerd/runc/CNI plugins and busybox-static (Debian): the real guest
# cluster of `make test` and `make cluster`.
node-tools:
	@bash tests/scripts/node-tools.sh

# KubeVirt's virt-api, virt-controller and install-manifests for v1.6.1, v1.7.0 and v1.8.0 (Go
# module proxy): the suite kubevirt_real (docs/testbed.md, "Real KubeVirt").
kubevirt:
	@bash tests/scripts/kubevirt.sh

proto-check:
	@echo "[test] csi.proto and the kubelet's pluginregistration api.proto sha256"
	@echo "5b81236a3809f3ff0b877ff9b82215d0b74a8e291d7f3ec6ee1a44f537c0f86a  proto/csi/v1.12.0/csi.proto" | sha256sum --check --quiet
	@echo "7a67a0000a1a167c155286834bc9ccb489f8bcdb394e006daba270189c272afa  proto/pluginregistration/v0.34.4/api.proto" | sha256sum --check --quiet

fmt-check:
	@echo "[test] cargo fmt --check"
	$(CARGO) fmt --all --check

clippy:
	@echo "[test] cargo clippy"
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# The charts alone do not render (the image repository has no default: docs/install.md, "Images");
# ci/default-values.yaml is values.yaml's defaults plus the image.
charts-check: tools
	@echo "[test] helm lint --strict (both charts: every ci/*-values.yaml, default-values.yaml included)"
	@helm="$$(bash tests/scripts/tools.sh --print-dir)/helm"; \
	for chart in deploy/charts/*/; do \
	  [ -e "$${chart}ci/default-values.yaml" ] || { echo "$${chart}ci/default-values.yaml is missing"; exit 1; }; \
	  for values in "$$chart"ci/*-values.yaml; do \
	    "$$helm" lint --strict "$$chart" -f "$$values" >/dev/null \
	      || { "$$helm" lint --strict "$$chart" -f "$$values"; exit 1; }; \
	  done; \
	done

# The binaries the suites' build makes (`cargo test --workspace --no-run`, which
# tests/scripts/suites.sh runs again as a no-op): `cargo run --bin` would select one package and
# compile kube and the binary again with that package's features.
help-check:
	@echo "[test] both binaries answer --help"
	$(CARGO) test --workspace --no-run --quiet
	$${CARGO_TARGET_DIR:-target}/debug/harvester-cloud-provider --help >/dev/null
	$${CARGO_TARGET_DIR:-target}/debug/harvester-csi-driver --help >/dev/null

# Every unit, property and test-bed suite, built once and run in two lanes side by side (the
# suites that boot QEMU guests or use what exists once per machine in one lane, one after
# another; the CSI suites again under each KubeVirt hot-plug gate set Harvester can run), then a
# table of every suite's time. LANES=1 runs them one after another. The node tools and KubeVirt
# are built in the background meanwhile; the suites that need them come last and wait.
# tests/scripts/suites.sh.
LANES ?= 2
unit-and-integration:
	@echo "[test] cargo test (unit, property and test-bed integration tests; LANES=$(LANES))"
	@LANES=$(LANES) CARGO=$(CARGO) bash tests/scripts/suites.sh

# Not part of `make test`: end-to-end figures on the test bed, peak memory of the release binaries
# and criterion's IPAM estimates, written to docs/benchmarks.md (which has how long it takes on 2
# cores); root for the volume row. The first release build (one codegen unit, fat LTO) is the
# longest part.
bench: tools
	@echo "[bench] make release (the binaries under test and the bench program)"
	$(MAKE) release
	@echo "[bench] criterion: testbed::sim::ipam on a /16"
	$(CARGO) bench -p testbed --bench ipam -- --quick
	@echo "[bench] test bed -> docs/benchmarks.md"
	$(CARGO) run --release -p testbed --bin bench -- --out docs/benchmarks.md

# Not part of `make test`: each cargo-fuzz target of common/fuzz and ccm/dhcp/fuzz for FUZZ_SECONDS
# (stable Rust, no sanitizer; installs cargo-fuzz into ~/.cache/harvester-testbed when missing).
# docs/fuzzing.md.
FUZZ_SECONDS ?= 60
fuzz:
	@bash tests/scripts/fuzz.sh $(FUZZ_SECONDS)
