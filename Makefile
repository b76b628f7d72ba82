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
#: FUZZ=FuzzParse      fuzz target for `make test-fuzz` in bpf/: FuzzParse (frames), FuzzChains (header chains and fragment trains), FuzzOracle (the kernel decides)
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

# Generated files that are committed (bpf2go output, controller-gen's deepcopy code and CRD);
# verify-generate fails when regenerating changes them.
GENERATED := 'bpf/*_bpfel.go' 'bpf/*_bpfel.o' 'bpf/*_bpfeb.go' 'bpf/*_bpfeb.o' api/v1alpha1/zz_generated.deepcopy.go deploy/crd.yaml client \
	deploy/namespace.yaml deploy/rbac.yaml deploy/demand-policy.yaml deploy/status-policy.yaml deploy/configmap.yaml deploy/daemonset.yaml deploy/helm/rlagent/crds

# Debian packages that provide clang, llvm-strip and <bpf/bpf_helpers.h>.
BPF_PACKAGES := clang llvm libbpf-dev

# Tests read this to turn "needs root" and "kernel lacks X" skips into failures (CI sets it).
export RLAGENT_REQUIRE_ROOT_TESTS

.PHONY: help deps-bpf deps-test deps-node generate verify-generate build test test-k8s test-node test-scale test-keyed test-limiter test-fuzz bench demo clean

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

# Debian packages the privileged tests run: nft (package nftables) loads the DNAT rules of
# internal/nettest's topologies, inside their own network namespaces only; bpftool dumps the
# pinned maps as the README shows (test/e2e TestBpftoolMapDump).
TEST_PACKAGES := nftables bpftool

deps-test: ## install the tools the privileged tests run (nft, package nftables; bpftool) with apt-get if missing (root only)
	@missing=; \
	for pkg in $(TEST_PACKAGES); do \
		case $$pkg in nftables) tool=nft;; *) tool=$$pkg;; esac; \
		if ! command -v $$tool >/dev/null && [ ! -x /usr/sbin/$$tool ]; then missing="$$missing $$pkg"; fi; \
	done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" -ne 0 ]; then \
		echo "deps-test: missing the packages$$missing; the tests that need them run only as root, which can install them: apt-get install$$missing" >&2; \
		exit 0; \
	fi; \
	if ! command -v apt-get >/dev/null; then \
		echo "deps-test: missing the packages$$missing: install them." >&2; \
		exit 1; \
	fi; \
	echo "deps-test: installing$$missing"; \
	apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing

# The RateLimit clientset, listers and informers (client/), generated from
# api/v1alpha1 by k8s.io/code-generator (hack/tools pins the release).
TOOL := $(GO) tool -modfile=hack/tools/go.mod
MODULE := github.com/rlagent/rlagent

generate: deps-bpf ## regenerate bpf/ (bpf2go), the api/ deepcopy code, deploy/crd.yaml (controller-gen), client/ (code-generator) and deploy/*.yaml from the Helm chart (hack/helm render)
	$(GO) generate ./bpf/...
	$(TOOL) controller-gen object paths=./api/... crd paths=./api/... output:crd:stdout > deploy/crd.yaml.tmp \
		&& mv deploy/crd.yaml.tmp deploy/crd.yaml || { rm -f deploy/crd.yaml.tmp; exit 1; }
	$(GO) -C hack/helm run . render --repo ../..
	rm -rf client
	$(TOOL) client-gen --go-header-file /dev/null --input-base $(MODULE) --input api/v1alpha1 \
		--clientset-name versioned --fake-clientset=false --output-dir client/clientset --output-pkg $(MODULE)/client/clientset
	$(TOOL) lister-gen --go-header-file /dev/null --output-dir client/listers --output-pkg $(MODULE)/client/listers $(MODULE)/api/v1alpha1
	$(TOOL) informer-gen --go-header-file /dev/null --versioned-clientset-package $(MODULE)/client/clientset/versioned \
		--listers-package $(MODULE)/client/listers --output-dir client/informers --output-pkg $(MODULE)/client/informers $(MODULE)/api/v1alpha1

verify-generate: generate ## fail if regenerating changes the committed generated files in bpf/, api/, deploy/ or client/ (run in CI)
	@if ! git diff --exit-code --stat -- $(GENERATED); then \
		echo 'verify-generate: `make generate` changed committed generated files (listed above).' >&2; \
		echo 'verify-generate: commit the regenerated files; for bpf/, also check that your clang matches the one CI uses ('"$$(clang --version | head -n1)"' here).' >&2; \
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

test: deps-test deps-node ## go vet and go test ./... (as root the BPF and end-to-end tests run; includes test-k8s and test-node; RLAGENT_REQUIRE_ROOT_TESTS=1 makes skips fail)
	$(GO) vet ./...
	$(GO) run ./internal/k8stest/k8sbin -node >/dev/null
	$(GO) test -count=1 -timeout 30m $(TESTFLAGS) ./...
	$(GO) -C hack/helm test -count=1 ./...

# k8sbin builds kube-apiserver and etcd into ~/.cache/rlagent/k8s (or finds them
# there) first, so that a cold build shows its progress instead of stalling a
# quiet go test; test/k8s/tools is its own module, so ./test/k8s/... skips it.
test-k8s: ## only the Kubernetes tests, against a real kube-apiserver and etcd (the first run builds them: ~8 min)
	$(GO) run ./internal/k8stest/k8sbin >/dev/null
	$(GO) test -count=1 $(TESTFLAGS) ./internal/k8stest/ ./test/k8s/...

# What StartNode (internal/k8stest) runs besides the Kubernetes binaries.
NODE_PACKAGES := containerd runc containernetworking-plugins iptables conntrack

deps-node: ## install containerd, runc, the CNI plugins, iptables and conntrack with apt-get if missing (root only; make test-node)
	@if command -v containerd >/dev/null && command -v runc >/dev/null && [ -x /usr/lib/cni/bridge ] && command -v iptables >/dev/null; then exit 0; fi; \
	if [ "$$(id -u)" -ne 0 ]; then \
		echo 'deps-node: containerd, runc, the CNI plugins or iptables are missing; the node tests run only as root, which can install them: apt-get install $(NODE_PACKAGES)' >&2; \
		exit 0; \
	fi; \
	if ! command -v apt-get >/dev/null; then \
		echo 'deps-node: install the packages $(NODE_PACKAGES) (Debian names).' >&2; \
		exit 1; \
	fi; \
	echo 'deps-node: installing $(NODE_PACKAGES)'; \
	apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $(NODE_PACKAGES)

test-node: deps-node ## only the image and the agent installed with the Helm chart on a real node (kubelet, containerd, kube-proxy, controller-manager, scheduler; the first run builds them: ~5 min more than test-k8s)
	$(GO) run ./internal/k8stest/k8sbin -node >/dev/null
	$(GO) test -count=1 $(TESTFLAGS) ./test/node/...

#: SCALE_AGENTS=300 SCALE_SERVICES=10000  the size of `make test-scale` (make test runs TestScale at 300 and 10000 too)
SCALE_AGENTS ?= 300
SCALE_SERVICES ?= 10000

test-scale: ## the scale test (test/k8s TestScale) at full size: SCALE_AGENTS agents, SCALE_SERVICES Services
	$(GO) run ./internal/k8stest/k8sbin >/dev/null
	RLAGENT_SCALE_AGENTS=$(SCALE_AGENTS) RLAGENT_SCALE_SERVICES=$(SCALE_SERVICES) \
		$(GO) test -count=1 -run '^TestScale$$' -v -timeout 30m $(TESTFLAGS) ./test/k8s/

#: KEYED_INTERVAL=15s  the report interval of `make test-keyed` (make test runs TestKeyedDemandShares at 1s; its stale age is 5 and its windows 3 intervals)
KEYED_INTERVAL ?= 15s

test-keyed: ## keyed demand shares at full length (test/k8s TestKeyedDemandShares with KEYED_INTERVAL)
	$(GO) run ./internal/k8stest/k8sbin >/dev/null
	RLAGENT_KEYED_INTERVAL=$(KEYED_INTERVAL) \
		$(GO) test -count=1 -run '^TestKeyedDemandShares$$' -v -timeout 60m $(TESTFLAGS) ./test/k8s/

#: LIMITER_PHASE=30s  each measured window of `make test-limiter` (make test runs TestLimiterFanout's at 5s)
LIMITER_PHASE ?= 30s

test-limiter: ## the limiter library: its packages, and the fan-out example as 3 processes against a real API server (TestLimiterFanout, windows of LIMITER_PHASE)
	$(GO) run ./internal/k8stest/k8sbin >/dev/null
	$(GO) test -count=1 $(TESTFLAGS) ./limiter/...
	RLAGENT_LIMITER_PHASE=$(LIMITER_PHASE) \
		$(GO) test -count=1 -run '^(TestLimiterFanout|TestLimiterRBAC)$$' -v -timeout 30m $(TESTFLAGS) ./test/k8s/

test-fuzz: ## fuzz the bpf/ packet parser (FUZZ, default FuzzParse) for FUZZTIME
	$(GO) test -run '^$$' -fuzz '$(FUZZ)' -fuzztime $(FUZZTIME) ./bpf/

bench: ## run the data path and agent benchmarks (one package at a time) into bench.out and print the summary table
	$(GO) test -p 1 -run '^$$' -bench '$(BENCH)' -benchtime $(BENCHTIME) -count $(BENCHCOUNT) ./bpf/ ./agent/ ./cluster/ ./test/e2e/ ./limiter/ | tee bench.out
	$(GO) run ./internal/benchtable < bench.out

#: DEMO_STEP=10s      how long each replica count lasts in `make demo` (make test runs the demo at 3s: test/demo TestDemo)
DEMO_STEP ?= 10s

demo: ## as root: rate-limit real UDP between two network namespaces while the replica count changes (4 x DEMO_STEP, ~45 s)
	$(GO) build -ldflags '-X main.version=$(VERSION)' -o bin/rlagent ./cmd/rlagent
	$(GO) build -o bin/rlagent-demo ./test/demo
	./bin/rlagent-demo --rlagent bin/rlagent -phase $(DEMO_STEP)

# The agent's container image, built without a container daemon by
# hack/tools/image (go-containerregistry): an OCI image index of a linux/amd64
# and a linux/arm64 image, each one layer on an empty base, the static binary
# as its entrypoint (the BPF objects are embedded, little-endian, in both).
# File and creation times are the commit's, so that one commit builds one
# digest. rlagent.tar is this machine's image alone: docker's tarball holds
# no index.
#: IMAGE_REPO=ghcr.io/rlagent/rlagent  the image's repository (make image; deploy/kustomization.yaml names this one)
#: PUSH_TO=REGISTRY/REPO:TAG  where `make push` pushes bin/image (credentials from ~/.docker/config.json)
#: IMAGE_DIR=bin/image  where `make image` writes the image
IMAGE_REPO ?= ghcr.io/rlagent/rlagent
IMAGE_DIR ?= bin/image
PUSH_TO ?=
REVISION ?= $(shell git rev-parse HEAD 2>/dev/null)
CREATED ?= $(shell git log -1 --format=%ct 2>/dev/null || echo 0)
IMAGE_TOOL := $(GO) -C hack/tools/image run .

.PHONY: image push
image: ## build the agent's OCI image index (linux/amd64, linux/arm64) into IMAGE_DIR (bin/image): oci/ (an OCI layout), ref (REPO:VERSION@DIGEST of the index), kustomization.yaml (deploy/ with the index by digest), rlagent.tar (this machine's image, for ctr/docker load)
	@mkdir -p $(IMAGE_DIR)
	CGO_ENABLED=0 GOOS=linux GOARCH=amd64 $(GO) build -trimpath -ldflags '-s -w -buildid= -X main.version=$(VERSION)' -o $(abspath $(IMAGE_DIR))/rlagent-amd64 ./cmd/rlagent
	CGO_ENABLED=0 GOOS=linux GOARCH=arm64 $(GO) build -trimpath -ldflags '-s -w -buildid= -X main.version=$(VERSION)' -o $(abspath $(IMAGE_DIR))/rlagent-arm64 ./cmd/rlagent
	$(IMAGE_TOOL) build --binary $(abspath $(IMAGE_DIR))/rlagent-amd64 --binary $(abspath $(IMAGE_DIR))/rlagent-arm64 --repo $(IMAGE_REPO) --version $(VERSION) \
		--revision '$(REVISION)' --created $(CREATED) --out $(abspath $(IMAGE_DIR)) --deploy $(abspath deploy)

# push pushes the whole index (both images; each node pulls its platform's),
# points IMAGE_DIR/kustomization.yaml at PUSH_TO's repository by the index's
# digest, and prints the `kustomize edit set image` line that pins another
# overlay (or deploy/) to the same digest.
push: image ## push the image index of `make image` (linux/amd64, linux/arm64) to PUSH_TO (e.g. make push PUSH_TO=registry.example.com/rlagent:v0.1.0); deploy it by digest: kubectl apply -k bin/image
	@if [ -z '$(PUSH_TO)' ]; then echo 'push: set PUSH_TO=REGISTRY/REPO:TAG, e.g. make push PUSH_TO=registry.example.com/rlagent:$(VERSION)' >&2; exit 1; fi
	$(IMAGE_TOOL) push --from $(abspath $(IMAGE_DIR))/oci --to '$(PUSH_TO)' --overlay $(abspath $(IMAGE_DIR))/kustomization.yaml

# The privileged suites on other kernels, each in a qemu VM in software emulation
# (test/vmtests). The binaries are static: the VM's initramfs has no libc.
#: KERNELS="6.1 6.12"  kernel series for `make vmtest`: the oldest supported and the newest available (5.10 also boots; the data path fails there)
#: VMTEST_RATE=800     RLAGENT_E2E_GLOBAL_RATE in the VMs (pkt/s, a multiple of 40; 8000 on the host)
#: VMTEST_TESTFLAGS=-test.v -test.short -test.timeout=20m  flags for every suite in the VMs, e.g. add -test.run TestX
KERNELS ?= 6.1 6.12
VMTEST_RATE ?= 800
# -test.short: bpf/ shares one loaded data path among its tests (the verifier
# takes seconds a program under software emulation).
VMTEST_TESTFLAGS ?= -test.v -test.short -test.timeout=20m
# veth for the pairs; sch_ingress (clsact) and cls_bpf for TC programs on
# kernels without tcx (before 6.6), where Debian builds them as modules.
VMTEST_MODULES ?= veth sch_ingress cls_bpf sch_fq
VMTEST_BIN := bin/vmtest
# The oldest kernel, which differs most from the host's (clsact instead of
# tcx, netlink XDP, no bpf_link updates of TC), runs bpf/, maps/ and test/e2e
# but the tests of VMTEST_E2E_SKIP, which check the agent's own logic (config
# reloads, the CLI, the pin lock and directory, the plan's uplink fallback,
# interfaces: auto's choice of uplinks, readiness, pins kept across a kill
# or a restart and refused under `ip netns exec`, each with unit tests of its
# own; TestRestartMigratesLayout restarts the agent on its pins in the VMs)
# and no kernel's, and the README's bpftool dump (the VMs have no bpftool).
# The newer one runs what the
# host cannot (fq pacing: the host has no sch_fq) and what the kernel shapes
# (TC egress, GSO and GRO skbs, link updates); each of those loads and
# verifies the whole data path there. ~30 + ~5 min under TCG (6.1's limit
# is 32).
#: VMTEST_ALL=6.1      the kernels of KERNELS that run all the suites; the others run VMTEST_E2E_RUN of test/e2e only
#: VMTEST_E2E_RUN=...  the end-to-end tests of the other kernels (VMTEST_E2E_RUN=. VMTEST_ALL="6.1 6.12" runs everything everywhere)
#: VMTEST_E2E_SKIP=... end-to-end tests VMTEST_ALL's kernels leave to the host (VMTEST_E2E_SKIP=^$ runs them)
VMTEST_ALL ?= 6.1
VMTEST_E2E_RUN ?= Pace|EgressLimitAtUplink|TCPSegmentsCounted|RestartMigratesLayout
VMTEST_E2E_SKIP ?= TestShareFollowsCount|TestReloadWithMissingInterfaceRejectedWhole|TestLimitsSetPickedUpByAgent|TestInvalidConfigKeepsLimits|TestSecondAgentOnPinDirRefused|TestXDPFallbackReloadToNoneRejected|TestLimitsCommands|TestPinDirNotOwnedByRootRefused|TestPinDirNotOnBPFFSRefused|TestEndpointFallsBackToUplink|TestInterfacesAuto|TestBpftoolMapDump|TestReadinessTellsTheTruth|TestLimitHoldsAfterSIGKILL|TestRestartAdoptsPins|TestIPNetnsExecPins

.PHONY: vmtest deps-vm
deps-vm: ## install xz-utils (to read the 6.12 kernel's compressed modules) with apt-get if missing (root only)
	@command -v xz >/dev/null && exit 0; \
	if [ "$$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then \
		echo 'deps-vm: xz is missing: install the package xz-utils, or run make as root on Debian to install it.' >&2; \
		exit 1; \
	fi; \
	apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends xz-utils

vmtest: deps-vm ## as root: bpf/, maps/ and test/e2e/ in a VM per kernel of KERNELS (fetches kernels and qemu; ~30 min)
	@mkdir -p $(VMTEST_BIN)
	CGO_ENABLED=0 $(GO) test -c -o $(VMTEST_BIN)/bpf.test ./bpf/
	CGO_ENABLED=0 $(GO) test -c -o $(VMTEST_BIN)/maps.test ./maps/
	CGO_ENABLED=0 $(GO) test -c -o $(VMTEST_BIN)/e2e.test ./test/e2e/
	CGO_ENABLED=0 $(GO) build -ldflags '-X main.version=$(VERSION)' -o $(VMTEST_BIN)/rlagent ./cmd/rlagent
	CGO_ENABLED=0 $(GO) build -o $(VMTEST_BIN)/vminit ./test/vmtests/cmd/vminit
	$(GO) build -o $(VMTEST_BIN)/vmtest ./test/vmtests/cmd/vmtest
	@rm -f $(VMTEST_BIN)/summary.txt; status=0; for k in $(KERNELS); do \
		case " $(VMTEST_ALL) " in \
		*" $$k "*) suites="-suite '$(VMTEST_BIN)/bpf.test $(VMTEST_TESTFLAGS)' -suite '$(VMTEST_BIN)/maps.test $(VMTEST_TESTFLAGS)' \
			-suite '$(VMTEST_BIN)/e2e.test $(VMTEST_TESTFLAGS) -test.skip $(VMTEST_E2E_SKIP)'";; \
		*) suites="-suite '$(VMTEST_BIN)/e2e.test $(VMTEST_TESTFLAGS) -test.run $(VMTEST_E2E_RUN)'";; \
		esac; \
		eval $(VMTEST_BIN)/vmtest -kernel $$k -timeout 32m -init $(VMTEST_BIN)/vminit -summary $(VMTEST_BIN)/summary.txt \
			$(addprefix -module ,$(VMTEST_MODULES)) \
			-rlagent $(VMTEST_BIN)/rlagent -env RLAGENT_E2E_GLOBAL_RATE=$(VMTEST_RATE) -env RLAGENT_VMTEST=1 \
			$$suites || status=1; \
	done; echo 'vmtest: every kernel:'; cat $(VMTEST_BIN)/summary.txt 2>/dev/null; exit $$status

clean: ## remove bin/ and bench.out
	rm -rf bin/ bench.out
