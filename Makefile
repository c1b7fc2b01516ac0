# egressproxy — build and test entry points.
#
#   make test   start the real test stack (scripts/teststack up), run go vet and
#               every test including the integration-tagged ones against it, then
#               stop the stack again (always, even when a step failed). The
#               tests run even when vet fails, for the full picture; the first
#               failing step's exit status is kept. This is what CI runs
#               (.ci/run). Needs root (the stack starts libvirtd, sshd, squid).
#               KEEP_STACK=1 leaves the stack running afterwards.
#   make unit   the unit tests only, no stack needed.
#   make fuzz-short   each go test -fuzz target for FUZZTIME (part of make test).
#   make stack-up / stack-down / stack-status   drive the stack by hand; then
#               eval "$$(scripts/teststack env)" to run single tests against it.

SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c

# Go may be installed under /usr/local/go without being on PATH (e.g. CI's
# non-login shell); appending keeps any go found earlier first.
export PATH := $(PATH):/usr/local/go/bin

GO ?= go
TESTSTACK := scripts/teststack
KEEP_STACK ?=

.PHONY: test unit vet fuzz-short stack-up stack-down stack-status

# Every go test -fuzz target, as package:Target. fuzz-short runs each briefly
# (FUZZTIME) so the targets and their committed seed corpora cannot rot.
FUZZ_TARGETS := ./provider:FuzzSpecValidate ./kvm2:FuzzDomainXML ./kvm2:FuzzSeed \
	./health:FuzzReadResponseHead ./sshconn:FuzzValidate ./imagecache:FuzzParseNames
FUZZTIME ?= 8s

test:
	@rc=0; \
	$(TESTSTACK) up || rc=$$?; \
	if [ $$rc -eq 0 ]; then \
		stackenv=$$($(TESTSTACK) env) && eval "$$stackenv" || rc=$$?; \
	fi; \
	if [ $$rc -eq 0 ]; then \
		echo "+ $(GO) vet ./..."; \
		$(GO) vet ./... && $(GO) vet -tags integration ./... || rc=$$?; \
		echo "+ $(GO) test -race -p 1 -tags integration -count=1 ./..."; \
		$(GO) test -race -p 1 -tags integration -count=1 ./... || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
	fi; \
	if [ $$rc -eq 0 ]; then \
		$(MAKE) --no-print-directory bench-short || rc=$$?; \
	fi; \
	if [ $$rc -eq 0 ]; then \
		$(MAKE) --no-print-directory fuzz-short || rc=$$?; \
	fi; \
	if [ -z "$(KEEP_STACK)" ]; then \
		$(TESTSTACK) down || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
	fi; \
	if [ $$rc -ne 0 ]; then echo "make test: FAILED (exit $$rc)" >&2; fi; \
	exit $$rc

fuzz-short:
	@set -e; for t in $(FUZZ_TARGETS); do \
		pkg=$${t%%:*}; fn=$${t##*:}; \
		echo "+ $(GO) test -run '^$$' -fuzz '^$$fn$$' -fuzztime $(FUZZTIME) $$pkg"; \
		$(GO) test -run '^$$' -fuzz "^$$fn\$$" -fuzztime $(FUZZTIME) $$pkg; \
	done

unit:
	$(GO) test -race ./...

vet:
	$(GO) vet ./...
	$(GO) vet -tags integration ./...

stack-up:
	$(TESTSTACK) up

stack-down:
	$(TESTSTACK) down

stack-status:
	$(TESTSTACK) status

# make bench   (root) start the real stack, build and run the bench tool
#              (bench/) and write docs/benchmarks.md: uploads vs virsh and raw
#              ssh, peak RSS, control-path RPCs, concurrent Gets, health probes,
#              scaling to 100 instances (about 10 minutes). KEEP_STACK=1 leaves
#              the stack running; BENCH_FLAGS adds flags (see bench -h).
# make bench-short   every Go benchmark once (-benchtime 1x) against the
#              running stack (part of make test), so they cannot rot.
.PHONY: bench bench-short
BENCH_FLAGS ?=

bench:
	@rc=0; \
	if [ ! -x /usr/bin/time ]; then \
		apt-get install -y --no-install-recommends time || { apt-get update && apt-get install -y --no-install-recommends time; } || rc=$$?; \
	fi; \
	[ $$rc -ne 0 ] || $(TESTSTACK) up || rc=$$?; \
	if [ $$rc -eq 0 ]; then \
		stackenv=$$($(TESTSTACK) env) && eval "$$stackenv" || rc=$$?; \
	fi; \
	if [ $$rc -eq 0 ]; then \
		bin="$$EGRESSPROXY_STACK_DIR/bench/bench"; mkdir -p "$${bin%/*}"; \
		echo "+ $(GO) build -o $$bin ./bench && $$bin -out docs/benchmarks.md $(BENCH_FLAGS)"; \
		$(GO) build -o "$$bin" ./bench && "$$bin" -out docs/benchmarks.md $(BENCH_FLAGS) || rc=$$?; \
	fi; \
	if [ -z "$(KEEP_STACK)" ]; then \
		$(TESTSTACK) down || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
	fi; \
	if [ $$rc -ne 0 ]; then echo "make bench: FAILED (exit $$rc)" >&2; fi; \
	exit $$rc

bench-short:
	@pkgs=$$(grep -rl --include='*_test.go' '^func Benchmark' . | xargs -n1 dirname | sort -u); \
	echo "+ $(GO) test -tags integration -p 1 -run '^$$' -bench . -benchtime 1x" $$pkgs; \
	$(GO) test -tags integration -p 1 -run '^$$' -bench . -benchtime 1x $$pkgs
