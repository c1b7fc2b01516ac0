# egressproxy — build and test entry points.
#
#   make test   everything, as CI runs it (.ci/run runs exactly this). Needs
#               root. First, with network: the stack's packages
#               (scripts/teststack deps), the guest image for the end-to-end
#               test (scripts/guestimage build, cached in /var/cache/egressproxy
#               per recipe) and the Go modules (go mod download). Then, with
#               no network at all, `make test-in-netns` inside a private
#               network namespace (scripts/netns) with a stack of its own
#               (EGRESSPROXY_STACK_DIR in a fresh temp dir, removed afterwards),
#               so it never touches a stack already running on the machine and
#               nothing the tests start — libvirtd, sshd, squid, the guest and
#               its NAT network — reaches outside the namespace.
#   make test-in-netns   (internal; refuses to run outside scripts/netns)
#               check the API record (api-check; a difference stops the run
#               here, before anything starts), start the stack and a
#               LAB_HOSTS-host lab (scripts/lab, stopped
#               again at the end), run go vet, staticcheck and every test including the
#               integration- and e2e-tagged ones against it (the e2e package
#               as a step of its own, verbose, so every run logs its boot,
#               address source and timings; its guest boots on lab host 1,
#               so the lab must be up before it), the example operator's
#               vet, staticcheck and tests against a real kube-apiserver and
#               etcd, with kube-proxy in the ClusterIP rollout test
#               (operator-test; scripts/kubestack builds them before the
#               namespace, cached per recipe), scale-short (the scale
#               bench's CI variant), the 5-minute chaos soak on the
#               lab (CI_SOAK, fixed CI_SOAK_SEED), bench-short,
#               fuzz-short, then stop the stack again (always, even when a step
#               failed). The tests run even when vet fails, for the full
#               picture; the first failing step's exit status is kept.
#   make api    write api/v0.txt, the record of the exported API (one line
#               per exported identifier of every shipped package, by
#               cmd/apirecord). Run it when you change the API on purpose,
#               and commit the file with the change.
#   make api-check   fail, showing the difference, when the exported API is
#               not the one api/v0.txt records (the first step of make
#               test, offline).
#   make operator-image   the example operator's container image as an OCI
#               archive, built without a container daemon, reproducible
#               (examples/operator/README.md, "Deploy").
#   make unit   the unit tests only, no stack needed.
#   make fuzz-short   each go test -fuzz target for FUZZTIME (part of make test).
#   make stack-up / stack-down / stack-status   drive the (machine's) stack by
#               hand; then eval "$$(scripts/teststack env)" to run single tests
#               against it.

SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c

# Go may be installed under /usr/local/go without being on PATH (e.g. CI's
# non-login shell); appending keeps any go found earlier first.
export PATH := $(PATH):/usr/local/go/bin

GO ?= go
TESTSTACK := scripts/teststack
# The multi-host lab (docs/lab.md): make test brings up LAB_HOSTS emulated
# hypervisors behind shaped links for the multi-host tests.
LAB := scripts/lab
LAB_HOSTS ?= 2
GUESTIMAGE := scripts/guestimage
NETNS := scripts/netns
# The Kubernetes control plane (kube-apiserver + etcd) of the operator's
# tests, built from Go modules and cached like the guest image.
KUBESTACK := scripts/kubestack
OPERATOR := examples/operator
# operator-warm (internal) what operator-test compiles first — the example
#              operator's Kubernetes graph, vetted and staticchecked with
#              the same settings — so that make test can do it in place of
#              one of the stress step's busy loops (STRESS_WORK): the step
#              loads both cores on purpose, and a fresh machine spends
#              minutes on this compile that the operator step then skips.
operator-warm:
	@export CGO_ENABLED=0 GOFLAGS="$$GOFLAGS -trimpath"; \
	sc=$$($(GO) env GOPATH)/bin/staticcheck; \
	cd $(OPERATOR) && $(GO) vet -tags integration ./... && $(GO) test -vet=off -count=1 -run '^$$' ./... >/dev/null && \
		$(GO) test -vet=off -count=1 -tags integration -run '^$$' ./... >/dev/null && $$sc -tags integration ./... && $$sc ./...

# make operator-image: the image's name and the OCI archive it is written to.
OPERATOR_IMAGE ?= egressproxy-operator:dev
OPERATOR_IMAGE_TAR ?= $(OPERATOR)/bin/egressproxy-operator.tar
# Bound of one test binary; the e2e test boots a guest under TCG (minutes).
TEST_TIMEOUT ?= 25m
KEEP_STACK ?=

.PHONY: test test-in-netns operator-test operator-warm operator-image unit vet fuzz-short stack-up stack-down stack-status stress stress-in-netns stress-run api api-check

# The record of the exported API (make api writes it, make api-check
# compares the code with it).
API_FILE := api/v0.txt

# make stress   (root) the concurrency and fault tests under CPU load: on a
#               real stack of its own in a private network namespace (as make
#               test), the integration tests of $(STRESS_PKGS) run
#               STRESS_COUNT times (default 20) with -race while
#               scripts/cpuburn keeps every core busy. goleak in each
#               package's TestMain fails any run that leaves a goroutine.
#               make test runs the same step with CI_STRESS_COUNT=1 and
#               STRESS_FLAGS=-short as its run of those packages (-short
#               samples the exhaustive tables: 4 of kvm2's Create
#               interruption boundaries per kind from a logged seed, 2
#               replica rounds, no 1 GiB fetch), to stay within CI's time
#               (a -short run of the three packages took ~740 s under
#               load on 2026-12-02, and CI must stay under 45 minutes:
#               one run, not two, since make test also builds the
#               operator's control plane on a new machine and runs the
#               5-minute soak, which keeps the same packages busy under
#               faults; make stress is the repeated proof).
STRESS_PKGS := ./sshconn ./internal/libvirtconn ./internal/basecache ./kvm2
STRESS_COUNT ?= 20
STRESS_FLAGS ?=
CI_STRESS_COUNT ?= 1
# make test ends its tests with the chaos soak (make soak,
# docs/soak.md) for CI_SOAK on the LAB_HOSTS-host lab, with a fixed seed
# so that a red run replays exactly (make soak SOAK=5m SOAK_SEED=...
# SOAK_HOSTS=2); its report is printed, not written to docs/. Its test
# binary is bounded by CI_SOAK_TIMEOUT: the 5-minute run takes ~5.5 min
# (5 min, the end checks, cleanup); its convergence wait may add up to 3
# min (the bound), so 12 min is a hang, not a slow run.
CI_SOAK ?= 5m
CI_SOAK_SEED ?= 20261202
CI_SOAK_TIMEOUT ?= 12m
STRESS_TIMEOUT ?= 120m

# Every go test -fuzz target, as package:Target. fuzz-short runs each briefly
# (FUZZTIME) so the targets and their committed seed corpora cannot rot.
# FUZZTIME is an execution count, not a duration: with a duration Go's fuzz
# coordinator can fail a healthy target with "context deadline exceeded" when
# a loaded machine starves a worker at the deadline (golang/go#75804; seen
# here on FuzzParseNames in a CI run). 20000 runs take 2–16 s per target.
FUZZ_TARGETS := .:FuzzSpecValidate ./kvm2:FuzzDomainXML ./kvm2:FuzzSeed ./internal/isoseed:FuzzBuild ./kvm2:FuzzParseDomainXML \
	./health:FuzzReadResponseHead ./sshconn:FuzzValidate ./internal/basecache:FuzzParseNames \
	.:FuzzClientErrorText .:FuzzErrorText ./kvm2:FuzzConfigErrorText ./kvm2:FuzzParseEntries \
	./guest:FuzzUserData ./internal/guestconf:FuzzParse
FUZZTIME ?= 20000x

# Static analysis, pinned; installed by make test before it enters the
# namespace (which has no network), run after go vet.
STATICCHECK := honnef.co/go/tools/cmd/staticcheck@v0.8.2

test:
	@rc=0; t0=$$SECONDS; \
	echo "+ [$$(date -u +%T)] $(TESTSTACK) deps"; \
	$(TESTSTACK) deps || rc=$$?; \
	if [ $$rc -eq 0 ]; then \
		stackdir=$$(mktemp -d /tmp/egp-test-stack.XXXXXX) || rc=$$?; \
	fi; \
	kubepid=; \
	if [ $$rc -eq 0 ]; then \
		echo "+ [$$(date -u +%T)] $(KUBESTACK) build &   (in the background, niced; operator-test waits for it; log: $$stackdir/kube-build.log)"; \
		( t1=$$SECONDS; $(KUBESTACK) build >"$$stackdir/kube-build.log" 2>&1; s=$$?; \
		  echo "make test: kube control plane ready in $$((SECONDS - t1))s (exit $$s)" >>"$$stackdir/kube-build.log"; \
		  echo $$s >"$$stackdir/kube-build.rc" ) </dev/null & kubepid=$$!; \
		echo "+ [$$(date -u +%T)] $(GUESTIMAGE) build"; t1=$$SECONDS; \
		$(GUESTIMAGE) build >/dev/null || rc=$$?; \
		echo "make test: guest image ready in $$((SECONDS - t1))s"; \
	fi; \
	if [ $$rc -eq 0 ]; then \
		echo "+ [$$(date -u +%T)] $(GO) mod download (and in $(OPERATOR))"; \
		$(GO) mod download && (cd $(OPERATOR) && $(GO) mod download) || rc=$$?; \
	fi; \
	if [ $$rc -eq 0 ]; then \
		echo "+ [$$(date -u +%T)] $(GO) install $(STATICCHECK)"; \
		GOBIN=$$($(GO) env GOPATH)/bin $(GO) install $(STATICCHECK) || rc=$$?; \
	fi; \
	if [ $$rc -eq 0 ]; then \
		echo "+ [$$(date -u +%T)] EGRESSPROXY_STACK_DIR=$$stackdir GOPROXY=off $(NETNS) run -- $(MAKE) test-in-netns"; \
		EGRESSPROXY_STACK_DIR=$$stackdir GOPROXY=off EGRESSPROXY_KUBE_BUILD_RC=$$stackdir/kube-build.rc \
			$(NETNS) run --name egp-test-$$$$ -- $(MAKE) --no-print-directory test-in-netns </dev/null || rc=$$?; \
	fi; \
	if [ -n "$$kubepid" ]; then \
		wait $$kubepid; \
		[ -s "$$stackdir/kube-build.rc" ] && [ "$$(cat "$$stackdir/kube-build.rc")" = 0 ] || { \
			tail -n 30 "$$stackdir/kube-build.log" >&2; echo "make test: kube control plane build failed" >&2; [ $$rc -ne 0 ] || rc=1; }; \
	fi; \
	[ -z "$$stackdir" ] || rm -rf "$$stackdir"; \
	echo "make test: $$((SECONDS - t0))s in all"; \
	if [ $$rc -ne 0 ]; then echo "make test: FAILED (exit $$rc)" >&2; fi; \
	exit $$rc

test-in-netns:
	@if [ -z "$$EGRESSPROXY_NETNS" ]; then \
		echo "make test-in-netns: not inside scripts/netns (EGRESSPROXY_NETNS unset); run make test" >&2; exit 2; \
	fi; \
	rc=0; \
	echo "+ [$$(date -u +%T)] make api-check   (GOPROXY=$$($(GO) env GOPROXY))"; \
	$(MAKE) --no-print-directory api-check || exit $$?; \
	$(TESTSTACK) up || rc=$$?; \
	if [ $$rc -eq 0 ]; then \
		stackenv=$$($(TESTSTACK) env) && eval "$$stackenv" || rc=$$?; \
	fi; \
	if [ $$rc -eq 0 ]; then \
		guestenv=$$($(GUESTIMAGE) env) && eval "$$guestenv" || rc=$$?; \
	fi; \
	export EGRESSPROXY_LAB_DIR="$$EGRESSPROXY_STACK_DIR/lab"; \
	if [ $$rc -eq 0 ]; then \
		echo "+ [$$(date -u +%T)] $(LAB) up --hosts $(LAB_HOSTS)"; \
		$(LAB) up --hosts $(LAB_HOSTS) && labenv=$$($(LAB) env) && eval "$$labenv" || rc=$$?; \
	fi; \
	if [ $$rc -eq 0 ]; then \
		echo "+ [$$(date -u +%T)] $(GO) vet ./..."; \
		$(GO) vet ./... && $(GO) vet -tags integration,e2e ./... || rc=$$?; \
		echo "+ [$$(date -u +%T)] staticcheck ./... && staticcheck -tags integration,e2e ./..."; \
		sc=$$($(GO) env GOPATH)/bin/staticcheck; \
		$$sc ./... && $$sc -tags integration,e2e ./... || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
		pkgs=$$($(GO) list ./... | grep -v '/e2e$$' | grep -v -x -F -f <($(GO) list $(STRESS_PKGS))) || rc=$$?; \
		echo "+ [$$(date -u +%T)] $(GO) test -race -p 1 -tags integration,e2e -count=1 -timeout $(TEST_TIMEOUT) <every package but ./e2e and $(STRESS_PKGS)>"; \
		$(GO) test -race -p 1 -tags integration,e2e -count=1 -timeout $(TEST_TIMEOUT) $$pkgs || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
		$(MAKE) --no-print-directory stress-run STRESS_COUNT=$(CI_STRESS_COUNT) STRESS_FLAGS=-short STRESS_WORK=operator-warm STRESS_AFTER=$$EGRESSPROXY_KUBE_BUILD_RC || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
		echo "+ [$$(date -u +%T)] $(GO) test -race -tags integration,e2e -count=1 -timeout $(TEST_TIMEOUT) -v ./e2e"; \
		$(GO) test -race -tags integration,e2e -count=1 -timeout $(TEST_TIMEOUT) -v ./e2e || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
		$(MAKE) --no-print-directory kube-wait || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
		$(MAKE) --no-print-directory operator-test || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
		$(MAKE) --no-print-directory scale-short || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
		echo "+ [$$(date -u +%T)] SOAK=$(CI_SOAK) SOAK_SEED=$(CI_SOAK_SEED) $(GO) test -tags integration -count=1 -run '^TestSoak$$' -v ./internal/testing/soak   (on the $(LAB_HOSTS)-host lab)"; \
		SOAK=$(CI_SOAK) SOAK_SEED=$(CI_SOAK_SEED) SOAK_GUEST=0 SOAK_REPORT=$$EGRESSPROXY_STACK_DIR/soak.md SOAK_EVENTS=$$EGRESSPROXY_STACK_DIR/soak-events.jsonl \
			$(GO) test -tags integration -count=1 -timeout $(CI_SOAK_TIMEOUT) -run '^TestSoak$$' -v ./internal/testing/soak || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
		[ ! -f "$$EGRESSPROXY_STACK_DIR/soak.md" ] || cat "$$EGRESSPROXY_STACK_DIR/soak.md"; \
	fi; \
	if [ $$rc -eq 0 ]; then \
		$(MAKE) --no-print-directory bench-short || rc=$$?; \
	fi; \
	if [ $$rc -eq 0 ]; then \
		$(MAKE) --no-print-directory fuzz-short || rc=$$?; \
	fi; \
	$(LAB) down || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
	$(TESTSTACK) down || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
	if [ $$rc -ne 0 ]; then echo "make test-in-netns: FAILED (exit $$rc)" >&2; fi; \
	exit $$rc

# The example operator (its own module): vet, staticcheck and its tests,
# the end-to-end one against a real kube-apiserver + etcd (envtest, binaries
# from $(KUBESTACK)) and the stack/lab already up. Run inside the netns by
# test-in-netns; CI=true makes a missing control plane or stack fail.
# go vet runs once, with -tags integration: the module has no file that only
# a plain build selects, and each tag set makes go vet recompute its facts
# for the whole Kubernetes dependency graph (minutes on a fresh machine).
# The plain build, test files included, is still compiled (go test -vet=off
# -run '^$$': compiles are shared through the build cache whatever the tags).
# Everything is built as the image's binary is (CGO_ENABLED=0, -trimpath:
# ociimage.BuildBinary), so the end-to-end test's binary and the two builds
# of make operator-image by TestOperatorImage compile nothing again (a
# build with other settings recompiles the whole Kubernetes graph: ~3 min
# on 2 cores). Its tests include the kustomize tree applied to a real
# kube-apiserver (TestDeployApply, ~5 s) and TestOperatorImage (two
# make operator-image, cached links).
operator-test:
	@rc=0; t0=$$SECONDS; \
	export CGO_ENABLED=0 GOFLAGS="$$GOFLAGS -trimpath"; \
	kubeenv=$$($(KUBESTACK) env) && eval "$$kubeenv" || rc=$$?; \
	if [ $$rc -eq 0 ]; then \
		sc=$$($(GO) env GOPATH)/bin/staticcheck; \
		echo "+ [$$(date -u +%T)] (cd $(OPERATOR) && go vet -tags integration && staticcheck, -tags integration and plain; plain test files compiled)"; \
		(cd $(OPERATOR) && $(GO) vet -tags integration ./... && $(GO) test -vet=off -count=1 -run '^$$' ./... >/dev/null && $$sc -tags integration ./... && $$sc ./...) || rc=$$?; \
		echo "+ [$$(date -u +%T)] (cd $(OPERATOR) && $(GO) test -p 1 -tags integration -count=1 -timeout $(TEST_TIMEOUT) -v ./...)"; \
		(cd $(OPERATOR) && $(GO) test -p 1 -tags integration -count=1 -timeout $(TEST_TIMEOUT) -v ./...) || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
	fi; \
	echo "make operator-test: $$((SECONDS - t0))s"; \
	exit $$rc

# make scale-short   the scale bench's CI variant (issue 36; docs/scale.md,
#              "CI variant"): cmd/scale -check runs N=200 objects over 2
#              memory entries on a real kube-apiserver and etcd with short
#              windows (~40 s) and fails when a figure is more than 2× the
#              one docs/scale.md documents, scaled to N=200. It writes no
#              docs. Built as operator-test builds (CGO_ENABLED=0,
#              -trimpath), so it shares its build cache. Part of make test,
#              right after operator-test.
.PHONY: scale-short
scale-short:
	@rc=0; t0=$$SECONDS; \
	export CGO_ENABLED=0 GOFLAGS="$$GOFLAGS -trimpath"; \
	kubeenv=$$($(KUBESTACK) env) && eval "$$kubeenv" || rc=$$?; \
	if [ $$rc -eq 0 ]; then \
		echo "+ [$$(date -u +%T)] (cd $(OPERATOR) && $(GO) run ./cmd/scale -check ../../docs/scale.md)"; \
		(cd $(OPERATOR) && $(GO) run ./cmd/scale -check ../../docs/scale.md) || rc=$$?; \
	fi; \
	echo "make scale-short: $$((SECONDS - t0))s"; \
	exit $$rc

# make operator-image   the example operator's container image, built
#              without a container daemon (go-containerregistry, in
#              $(OPERATOR)/cmd/operator-image): the command built static
#              and reproducible (CGO_ENABLED=0, -trimpath, no VCS stamp,
#              no build ID) as the only file of one layer on an empty base,
#              entrypoint /egressproxy-operator, user 65532; written as an
#              OCI archive (an OCI image layout in one tar) to
#              OPERATOR_IMAGE_TAR, named OPERATOR_IMAGE. It prints the
#              archive, the name and the image digest: the same source and
#              Go give the same digest. Load it where the cluster pulls from
#              (e.g. skopeo copy oci-archive:FILE docker://REGISTRY/NAME,
#              kind load image-archive FILE).
operator-image:
	@cd $(OPERATOR) && $(GO) run ./cmd/operator-image -ref $(OPERATOR_IMAGE) -o $(abspath $(OPERATOR_IMAGE_TAR))

stress:
	@rc=0; t0=$$SECONDS; \
	$(TESTSTACK) deps || rc=$$?; \
	[ $$rc -ne 0 ] || $(GO) mod download || rc=$$?; \
	if [ $$rc -eq 0 ]; then \
		stackdir=$$(mktemp -d /tmp/egp-stress-stack.XXXXXX) || rc=$$?; \
	fi; \
	if [ $$rc -eq 0 ]; then \
		EGRESSPROXY_STACK_DIR=$$stackdir GOPROXY=off \
			$(NETNS) run --name egp-stress-$$$$ -- $(MAKE) --no-print-directory stress-in-netns </dev/null || rc=$$?; \
		rm -rf "$$stackdir"; \
	fi; \
	echo "make stress: $$((SECONDS - t0))s in all"; \
	if [ $$rc -ne 0 ]; then echo "make stress: FAILED (exit $$rc)" >&2; fi; \
	exit $$rc

stress-in-netns:
	@if [ -z "$$EGRESSPROXY_NETNS" ]; then \
		echo "make stress-in-netns: not inside scripts/netns (EGRESSPROXY_NETNS unset); run make stress" >&2; exit 2; \
	fi; \
	rc=0; \
	$(TESTSTACK) up || rc=$$?; \
	if [ $$rc -eq 0 ]; then \
		stackenv=$$($(TESTSTACK) env) && eval "$$stackenv" || rc=$$?; \
	fi; \
	[ $$rc -ne 0 ] || $(MAKE) --no-print-directory stress-run || rc=$$?; \
	$(TESTSTACK) down || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
	exit $$rc

# kube-wait (internal) make test builds the control plane in the background
# from its start (outside the namespace, where the modules can be fetched):
# waits until that build has written its status to
# EGRESSPROXY_KUBE_BUILD_RC (nothing to wait for when it is unset), prints
# how long it waited and the build's last lines, and fails as the build did.
.PHONY: kube-wait
kube-wait:
	@f=$$EGRESSPROXY_KUBE_BUILD_RC; [ -n "$$f" ] || exit 0; t0=$$SECONDS; \
	echo "+ [$$(date -u +%T)] waiting for the control plane's build ($$f)"; \
	while [ ! -s "$$f" ]; do \
		[ $$((SECONDS - t0)) -lt 3600 ] || { echo "make kube-wait: no status after 3600s" >&2; exit 1; }; \
		sleep 2; \
	done; \
	tail -n 4 "$${f%.rc}.log"; \
	echo "make kube-wait: waited $$((SECONDS - t0))s"; \
	s=$$(cat "$$f"); [ "$$s" = 0 ] || { tail -n 30 "$${f%.rc}.log" >&2; exit 1; }

# stress-run (internal) the stress step against the stack in the environment:
# STRESS_COUNT runs, one go test process each (so every run is a fresh
# process and a line per run says how it went), all under scripts/cpuburn.
stress-run:
	@echo "+ [$$(date -u +%T)] scripts/cpuburn $(if $(STRESS_WORK),-w 'make $(STRESS_WORK)' )$(if $(STRESS_AFTER),-a $(STRESS_AFTER) )-- $(STRESS_COUNT) x $(GO) test -race -p 1 -tags integration -count=1 $(STRESS_FLAGS) -timeout $(STRESS_TIMEOUT) $(STRESS_PKGS)"; \
	scripts/cpuburn $(if $(STRESS_WORK),-w '$(MAKE) --no-print-directory $(STRESS_WORK)' )$(if $(STRESS_AFTER),-a '$(STRESS_AFTER)' )-- bash -c 't0=$$SECONDS; failed=0; \
		for i in $$(seq 1 $(STRESS_COUNT)); do \
			t1=$$SECONDS; \
			if $(GO) test -race -p 1 -tags integration -count=1 $(STRESS_FLAGS) -timeout $(STRESS_TIMEOUT) $(STRESS_PKGS); then r=ok; else r=FAILED; failed=$$((failed + 1)); fi; \
			echo "stress: run $$i/$(STRESS_COUNT) $$r in $$((SECONDS - t1))s"; \
		done; \
		echo "stress: $(STRESS_COUNT) runs of $(STRESS_PKGS) under CPU load in $$((SECONDS - t0))s, $$failed failed"; \
		[ $$failed -eq 0 ]'

fuzz-short:
	@set -e; for t in $(FUZZ_TARGETS); do \
		pkg=$${t%%:*}; fn=$${t##*:}; \
		echo "+ [$$(date -u +%T)] $(GO) test -run '^$$' -fuzz '^$$fn$$' -fuzztime $(FUZZTIME) $$pkg"; \
		$(GO) test -run '^$$' -fuzz "^$$fn\$$" -fuzztime $(FUZZTIME) $$pkg; \
	done

# api-check regenerates the record into a temporary file and compares it
# with the committed one. It needs only the go command and the module cache
# (cmd/apirecord reads the compiler's export data), so it runs offline.
api:
	$(GO) run ./cmd/apirecord -o $(API_FILE)

api-check:
	@tmp=$$(mktemp /tmp/egp-api.XXXXXX) || exit $$?; \
	trap 'rm -f "$$tmp"' EXIT; \
	$(GO) run ./cmd/apirecord -o "$$tmp" || exit $$?; \
	if ! diff -u --label "$(API_FILE) (recorded)" --label "$(API_FILE) (the code)" $(API_FILE) "$$tmp"; then \
		echo "make api-check: the exported API is not the one $(API_FILE) records (diff above: - recorded, + the code)." >&2; \
		echo "make api-check: if the change is meant, run 'make api', commit $(API_FILE) with it and say what changed for callers in CHANGELOG.md; if not, undo it." >&2; \
		exit 1; \
	fi; \
	echo "make api-check: the exported API is the one $(API_FILE) records"

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
#              ssh with a CPU profile, peak RSS, control-path RPCs, concurrent
#              Gets, health probes, scaling to 100 instances, the control path
#              through a 50 ms delay proxy (rtt), and on a 4-host lab the bench
#              brings up and stops itself (scripts/lab, under the stack dir)
#              the link rows at 1 Gbit/s and 100 Mbit/s, and the image
#              fan-out rows (phase fanout: the lab's mirror behind a
#              100 Mbit/s link, 4 + 1 hosts behind 1 Gbit/s links, a
#              256 MiB image; about 8 more minutes) (about 50 minutes).
#              KEEP_STACK=1 leaves the stack running; BENCH_FLAGS adds flags
#              (see bench -h), e.g. BENCH_FLAGS='-phases lab,rtt -merge' to
#              remeasure two phases and keep the other sections.
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
		echo "+ [$$(date -u +%T)] $(GO) build -o $$bin ./cmd/bench && $$bin -out docs/benchmarks.md $(BENCH_FLAGS)"; \
		cmd="make bench"; [ -z "$(BENCH_FLAGS)" ] || cmd="make bench BENCH_FLAGS='$(BENCH_FLAGS)'"; \
		$(GO) build -o "$$bin" ./cmd/bench && "$$bin" -out docs/benchmarks.md -command "$$cmd" $(BENCH_FLAGS) || rc=$$?; \
	fi; \
	if [ -z "$(KEEP_STACK)" ]; then \
		$(TESTSTACK) down || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
	fi; \
	if [ $$rc -ne 0 ]; then echo "make bench: FAILED (exit $$rc)" >&2; fi; \
	exit $$rc

bench-short:
	@pkgs=$$(grep -rl --include='*_test.go' '^func Benchmark' . | xargs -n1 dirname | sort -u); \
	echo "+ [$$(date -u +%T)] $(GO) test -tags integration -p 1 -run '^$$' -bench . -benchtime 1x" $$pkgs; \
	$(GO) test -tags integration -p 1 -run '^$$' -bench . -benchtime 1x $$pkgs

# make soak   (root) the chaos soak (internal/testing/soak, docs/soak.md):
#             on a stack of its own in a private network namespace (as make
#             test) with a SOAK_HOSTS-host lab, TestSoak runs a driver
#             process (the test binary re-executed: the model operator) that
#             drives 8-12 proxies per host (24-36 on 3 hosts) through
#             egressproxy.Client, each entry through its host's delay
#             proxy, with faults from a seeded
#             schedule (sshd frozen and killed, link down, link rate dropped
#             to 1 Mbit/s, RTT raised to 400 ms, libvirtd restarted, host 1's
#             tmpfs pool filled up, the driver process SIGKILLed and started
#             again with nothing but the desired set and List, a second
#             driver process for a while, the image mirror answering 503,
#             stalling, cutting the body short; foreign volumes and domains
#             planted on every host) for SOAK (default 1h; SOAK=5m for a
#             short run), checks its invariants all along and after a quiet
#             period, and writes docs/soak.md. SOAK_SEED replays a run (the
#             seed is printed and in the report); the event log (JSON lines)
#             goes to SOAK_EVENTS. With SOAK_GUEST=1 (the default here) one
#             proxy of the project's guest image boots on lab host 2 before
#             the schedule starts and its health rounds probe a real Squid
#             (scripts/guestimage build first; ~3 min of setup on a busy
#             machine, ~570 MB in host 2's pool, one TCG guest). make test
#             runs the 5-minute variant (CI_SOAK) without the guest, its
#             report printed, not written.
.PHONY: soak soak-in-netns
SOAK ?= 1h
SOAK_SEED ?=
SOAK_HOSTS ?= 3
SOAK_GUEST ?= 1
# Bound of the test binary: SOAK plus setup, convergence and cleanup.
SOAK_TIMEOUT ?= 3h
SOAK_EVENTS ?= /tmp/egressproxy-soak-events.jsonl

soak:
	@rc=0; t0=$$SECONDS; \
	$(TESTSTACK) deps || rc=$$?; \
	[ $$rc -ne 0 ] || [ "$(SOAK_GUEST)" != 1 ] || $(GUESTIMAGE) build >/dev/null || rc=$$?; \
	[ $$rc -ne 0 ] || $(GO) mod download || rc=$$?; \
	if [ $$rc -eq 0 ]; then \
		stackdir=$$(mktemp -d /tmp/egp-soak-stack.XXXXXX) || rc=$$?; \
	fi; \
	if [ $$rc -eq 0 ]; then \
		EGRESSPROXY_STACK_DIR=$$stackdir GOPROXY=off \
			$(NETNS) run --name egp-soak-$$$$ -- $(MAKE) --no-print-directory soak-in-netns </dev/null || rc=$$?; \
		rm -rf "$$stackdir"; \
	fi; \
	echo "make soak: $$((SECONDS - t0))s in all"; \
	if [ $$rc -ne 0 ]; then echo "make soak: FAILED (exit $$rc)" >&2; fi; \
	exit $$rc

soak-in-netns:
	@if [ -z "$$EGRESSPROXY_NETNS" ]; then \
		echo "make soak-in-netns: not inside scripts/netns (EGRESSPROXY_NETNS unset); run make soak" >&2; exit 2; \
	fi; \
	rc=0; \
	$(TESTSTACK) up || rc=$$?; \
	if [ $$rc -eq 0 ]; then \
		stackenv=$$($(TESTSTACK) env) && eval "$$stackenv" || rc=$$?; \
	fi; \
	if [ $$rc -eq 0 ] && [ "$(SOAK_GUEST)" = 1 ]; then \
		guestenv=$$($(GUESTIMAGE) env) && eval "$$guestenv" || rc=$$?; \
	fi; \
	export EGRESSPROXY_LAB_DIR="$$EGRESSPROXY_STACK_DIR/lab"; \
	if [ $$rc -eq 0 ]; then \
		echo "+ [$$(date -u +%T)] $(LAB) up --hosts $(SOAK_HOSTS)"; \
		$(LAB) up --hosts $(SOAK_HOSTS) && labenv=$$($(LAB) env) && eval "$$labenv" || rc=$$?; \
	fi; \
	if [ $$rc -eq 0 ]; then \
		echo "+ [$$(date -u +%T)] SOAK=$(SOAK) SOAK_SEED=$(SOAK_SEED) SOAK_GUEST=$(SOAK_GUEST) $(GO) test -tags integration -count=1 -run '^TestSoak$$' -v ./internal/testing/soak"; \
		SOAK=$(SOAK) SOAK_SEED=$(SOAK_SEED) SOAK_GUEST=$(SOAK_GUEST) SOAK_REPORT=$(CURDIR)/docs/soak.md SOAK_EVENTS=$(SOAK_EVENTS) \
			$(GO) test -tags integration -count=1 -timeout $(SOAK_TIMEOUT) -run '^TestSoak$$' -v ./internal/testing/soak || rc=$$?; \
	fi; \
	$(LAB) down || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
	$(TESTSTACK) down || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
	if [ $$rc -ne 0 ]; then echo "make soak-in-netns: FAILED (exit $$rc)" >&2; fi; \
	exit $$rc
