# rlagent developer entry points. `make` (or `make help`) lists them.
#
# Every recipe runs in bash with -e -u -o pipefail, so a failing command in a
# pipeline (go test | tee) fails the target.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

GO ?= go

# Variables a user sets on the command line; `#:` lines are what `make help` prints.
# (No comments after the values: make keeps the spaces before a `#` in the value.)
#: TESTFLAGS=          extra go test flags for `make test`, e.g. TESTFLAGS='-run TestXDP -v'
#: FUZZ=FuzzParse      fuzz target for `make test-fuzz` (must match exactly one Fuzz function in bpf/)
#: FUZZTIME=30s        how long `make test-fuzz` fuzzes
#: BENCH=.             benchmark regexp for `make bench`
#: BENCHTIME=2s        -benchtime for `make bench`
#: BENCHCOUNT=1        -count for `make bench` (above 1 the table reports medians)
#: RLAGENT_REQUIRE_ROOT_TESTS=1  (environment) turn "needs root"/"kernel lacks X" test skips into failures
TESTFLAGS ?=
FUZZ ?= FuzzParse
FUZZTIME ?= 30s
BENCH ?= .
BENCHTIME ?= 2s
BENCHCOUNT ?= 1

# bpf2go output that is committed; verify-generate fails when regenerating changes it.
GENERATED := 'bpf/*_bpfel.go' 'bpf/*_bpfel.o' 'bpf/*_bpfeb.go' 'bpf/*_bpfeb.o'

# Debian packages that provide clang, llvm-strip and <bpf/bpf_helpers.h>.
BPF_PACKAGES := clang llvm libbpf-dev

# Tests read this to turn "needs root" and "kernel lacks X" skips into failures (CI sets it).
export RLAGENT_REQUIRE_ROOT_TESTS

.PHONY: help deps-bpf generate verify-generate build test test-fuzz bench demo clean

help: ## list targets and variables
	@echo 'Usage: make <target> [VAR=value ...]'
	@echo
	@echo 'Targets:'
	@grep -E '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "} {printf "  %-16s %s\n", $$1, $$2}'
	@echo
	@echo 'Variables:'
	@grep -E '^#: ' $(MAKEFILE_LIST) | sed 's/^#: /  /'

deps-bpf: ## install clang, llvm-strip and libbpf headers with apt-get if any is missing (root only)
	@if command -v clang >/dev/null && command -v llvm-strip >/dev/null && [ -f /usr/include/bpf/bpf_helpers.h ]; then \
		exit 0; \
	fi; \
	if [ "$$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then \
		echo 'deps-bpf: clang, llvm-strip or /usr/include/bpf/bpf_helpers.h is missing.' >&2; \
		echo 'deps-bpf: install the packages $(BPF_PACKAGES) (Debian/Ubuntu: apt-get install $(BPF_PACKAGES)), or run make as root on Debian to install them.' >&2; \
		exit 1; \
	fi; \
	echo 'deps-bpf: installing $(BPF_PACKAGES)'; \
	apt-get update && \
	DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $(BPF_PACKAGES)

generate: deps-bpf ## regenerate the BPF objects and Go bindings in bpf/ (bpf2go)
	$(GO) generate ./bpf/...

verify-generate: generate ## fail if regenerating changes the committed bpf/*_bpfel.{go,o} (run in CI)
	@if ! git diff --exit-code --stat -- $(GENERATED); then \
		echo 'verify-generate: `make generate` changed committed generated files in bpf/ (listed above).' >&2; \
		echo 'verify-generate: commit the regenerated files, or check that your clang matches the one CI uses ('"$$(clang --version | head -n1)"' here).' >&2; \
		exit 1; \
	fi
	@untracked="$$(git ls-files --others -- $(GENERATED))"; \
	if [ -n "$$untracked" ]; then \
		echo "verify-generate: \`make generate\` produced generated files that are not committed:" >&2; \
		echo "$$untracked" >&2; \
		echo 'verify-generate: git add them (and check they are not ignored).' >&2; \
		exit 1; \
	fi
	@echo 'verify-generate: generated files are up to date'

VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)

build: ## go build ./... and bin/rlagent (version from git describe)
	$(GO) build ./...
	$(GO) build -ldflags '-X main.version=$(VERSION)' -o bin/rlagent ./cmd/rlagent

test: ## go vet and go test ./... (as root the BPF and end-to-end tests run; RLAGENT_REQUIRE_ROOT_TESTS=1 makes skips fail)
	$(GO) vet ./...
	$(GO) test -count=1 $(TESTFLAGS) ./...

test-fuzz: ## fuzz the bpf/ packet parser (FUZZ, default FuzzParse) for FUZZTIME
	$(GO) test -run '^$$' -fuzz '$(FUZZ)' -fuzztime $(FUZZTIME) ./bpf/

bench: ## run the data path and agent benchmarks into bench.out and print the summary table
	$(GO) test -run '^$$' -bench '$(BENCH)' -benchtime $(BENCHTIME) -count $(BENCHCOUNT) ./bpf/ ./agent/ ./test/e2e/ | tee bench.out
	$(GO) run ./internal/benchtable < bench.out

demo: ## as root: rate-limit real UDP between two network namespaces while the replica count changes (~45 s)
	$(GO) build -ldflags '-X main.version=$(VERSION)' -o bin/rlagent ./cmd/rlagent
	$(GO) build -o bin/rlagent-demo ./test/demo
	./bin/rlagent-demo --rlagent bin/rlagent

clean: ## remove bin/ and bench.out
	rm -rf bin/ bench.out
