# The two commands of the README: `make demo` and `make test`. Everything they need is installed by
# tests/scripts/tools.sh (Debian packages with apt-get, Go tools into ~/.cache/harvester-testbed).

SHELL := /bin/bash
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never

.PHONY: demo test tools proto-check fmt-check clippy unit-and-integration help-check bench

demo: tools
	$(CARGO) run --quiet -p testbed --bin testbed -- demo

test: tools proto-check fmt-check clippy help-check unit-and-integration

tools:
	@bash tests/scripts/tools.sh

proto-check:
	@echo "[test] csi.proto sha256"
	@echo "5b81236a3809f3ff0b877ff9b82215d0b74a8e291d7f3ec6ee1a44f537c0f86a  proto/csi/v1.12.0/csi.proto" | sha256sum --check --quiet

fmt-check:
	@echo "[test] cargo fmt --check"
	$(CARGO) fmt --all --check

clippy:
	@echo "[test] cargo clippy"
	$(CARGO) clippy --workspace --all-targets -- -D warnings

help-check:
	@echo "[test] both binaries answer --help"
	$(CARGO) run --quiet --bin harvester-cloud-provider -- --help >/dev/null
	$(CARGO) run --quiet --bin harvester-csi-driver -- --help >/dev/null

unit-and-integration:
	@echo "[test] cargo test (unit, property and test-bed integration tests)"
	$(CARGO) test --workspace
