# OpenDsec. `make help` lists the targets.
SHELL := /bin/bash
GO ?= go
BIN := bin
VERSION ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -s -w -X github.com/kernflux/opendsec/internal/version.Version=$(VERSION)
GOLANGCI_LINT ?= $(shell $(GO) env GOPATH)/bin/golangci-lint
CMDS := opendsec opendsec-node opendsec-apiserver opendsec-watcher opendsec-e2b opendsecctl

.PHONY: help build agent base-images guest-assets generate test test-go test-live test-e2b test-unit fuzz-short fuzz lint build-other-os clean

help: ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

build: agent ## build every binary into bin/
	@mkdir -p $(BIN)
	@for c in $(CMDS); do [ -d cmd/$$c ] && $(GO) build -ldflags '$(LDFLAGS)' -o $(BIN)/$$c ./cmd/$$c || exit 1; done

agent: ## build the static in-sandbox agent and its init (PID 1), side by side, and crun's libsystemd without systemd
	@mkdir -p $(BIN)
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/opendsec-agent ./cmd/opendsec-agent
	bash scripts/build-init.sh $(BIN)/opendsec-init

base-images: ## the offline base root filesystems, built once and cached (the e2e tests and test-live start them)
	bash deploy/images/build.sh --no-import

guest-assets: ## VM guest kernel + initramfs from Debian packages, cached (docs/vm-guest.md)
	scripts/build-guest-assets.sh

test: build base-images ## every test: Go (incl. root and e2e), Python SDK and CLI against a live system
	$(GO) vet ./...
	OPENDSEC_ROOT_TESTS=1 $(GO) test -timeout 25m ./...
	OPENDSEC_ROOT_TESTS=1 OPENDSEC_TEST_OCI_RUNTIME=runc $(GO) test -timeout 10m ./internal/runtime/container/
	bash scripts/fuzz.sh
	bash scripts/test-live.sh
	bash scripts/test-e2b.sh

test-unit: ## the tests that need no root; run it as a normal user (as root it runs the root tests too)
	env -u OPENDSEC_ROOT_TESTS $(GO) test -timeout 15m ./...

fuzz-short: ## each fuzz target for 10 s (their seed corpora run in every go test too)
	FUZZTIME=10s bash scripts/fuzz.sh

fuzz: ## each fuzz target for FUZZTIME (default 5m), one at a time; record findings in bench/results
	FUZZTIME=$${FUZZTIME:-5m} bash scripts/fuzz.sh

test-go: base-images ## Go tests only
	OPENDSEC_ROOT_TESTS=1 $(GO) test -timeout 25m ./...
	OPENDSEC_ROOT_TESTS=1 OPENDSEC_TEST_OCI_RUNTIME=runc $(GO) test -timeout 10m ./internal/runtime/container/

test-live: build ## Python SDK, example and CLI against a live system
	bash scripts/test-live.sh

test-e2b: build ## the real E2B SDKs (PyPI and npm) against a live system and the E2B gateway
	bash scripts/test-e2b.sh

lint: build-other-os ## golangci-lint (.golangci.yml; pinned in scripts/install-deps.sh --dev) and the darwin build
	$(GOLANGCI_LINT) run ./...

build-other-os: ## the Linux-only code has stubs that compile: build and vet for darwin
	GOOS=darwin $(GO) build ./...
	GOOS=darwin $(GO) vet ./...

generate: ## regenerate protobuf code (Go and Python)
	bash scripts/gen-proto.sh

clean:
	rm -rf $(BIN)
