//go:build integration

package kvm2

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/go-logr/logr/testr"
)

// replicaRounds is how many rounds each two-replica test runs; even rounds
// start replica a first, odd rounds replica b.
const replicaRounds = 8

// rounds is replicaRounds, or 2 (one per order) in a -short run.
func rounds() int {
	if testing.Short() {
		return 2
	}
	return replicaRounds
}

// twoReplicas opens two providers on one entry (two separate Opens: two
// SSH connections, two name-lock tables, as an old and a new leader
// during a handover have) and warms the entry's base.
func twoReplicas(t *testing.T) (*lifecycleEnv, [2]*provider, context.Context) {
	t.Helper()
	e := newLifecycleEnv(t)
	ps := [2]*provider{openT(t, e.cfg, testr.New(t)), openT(t, e.cfg, testr.New(t))}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	t.Cleanup(cancel)
	warm := egressproxy.Spec{Name: "warm", UID: "uid-warm"}
	if _, err := ps[0].Create(ctx, warm); err != nil {
		t.Fatalf("warm Create: %v", err)
	}
	if err := ps[0].Delete(ctx, warm.Ref()); err != nil {
		t.Fatal(err)
	}
	return e, ps, ctx
}

// raceOffset is how long the second of two racing calls starts after the
// first in round: 0, 0, 10ms, 10ms, 20ms, … It only varies which moments
// of the first call the second meets; no assertion depends on it.
func raceOffset(round int) time.Duration { return time.Duration(round/2) * 10 * time.Millisecond }

// race runs first and then, after offset, second, concurrently, and waits
// for both.
func race(offset time.Duration, first, second func()) {
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); first() }()
	go func() { defer wg.Done(); time.Sleep(offset); second() }()
	wg.Wait()
}

// createSettles calls Create until it succeeds, allowing at most two
// Transient failures (a race the caller retries), and fails t otherwise.
func createSettles(t *testing.T, ctx context.Context, p *provider, spec egressproxy.Spec, what string) egressproxy.Instance {
	t.Helper()
	for attempt := 1; ; attempt++ {
		inst, err := p.Create(ctx, spec)
		if err == nil {
			return inst
		}
		if errs.Code(err) != errs.Transient || attempt == 3 {
			t.Fatalf("%s: Create attempt %d: %v (code %v)", what, attempt, err, errs.Code(err))
		}
		t.Logf("%s: Create attempt %d transient (retried): %v", what, attempt, err)
	}
}

// assertComplete fails t unless the host holds spec's instance running with
// its overlay backed by the base and its seed carrying the user-data.
func assertComplete(t *testing.T, cfg Config, spec egressproxy.Spec, what string) {
	t.Helper()
	h := SettledHostInstanceT(t, cfg, spec.Name)
	if !h.Defined || h.State != libvirt.DomainRunning {
		t.Errorf("%s: domain defined %v state %d, want running", what, h.Defined, h.State)
	}
	if !h.Overlay || h.OverlayBacking != h.BasePath {
		t.Errorf("%s: overlay present %v backed by %q, want the base %q", what, h.Overlay, h.OverlayBacking, h.BasePath)
	}
	if !h.Seed || h.UserData != spec.UserData {
		t.Errorf("%s: seed present %v user-data %q, want %q", what, h.Seed, h.UserData, spec.UserData)
	}
}

// TestIntegrationTwoReplicasOneSpec: two providers on one entry create the
// same spec at the same moment. Each Create succeeds or fails Transient
// (never Permanent), a retry of a Transient one succeeds, both return the
// one instance, and it is complete on the host.
func TestIntegrationTwoReplicasOneSpec(t *testing.T) {
	e, ps, ctx := twoReplicas(t)
	transient := 0
	for round := range rounds() {
		spec := egressproxy.Spec{Name: fmt.Sprintf("twin-%d", round), UID: fmt.Sprintf("uid-twin-%d", round),
			UserData: fmt.Sprintf("#cloud-config\n# twin %d\n", round)}
		order := [2]int{0, 1}
		if round%2 == 1 {
			order = [2]int{1, 0}
		}
		var insts [2]egressproxy.Instance
		var problems [2]error
		run := func(i int) func() {
			return func() { insts[i], problems[i] = ps[i].Create(ctx, spec) }
		}
		race(raceOffset(round), run(order[0]), run(order[1]))
		what := fmt.Sprintf("round %d (replica %d first, offset %v)", round, order[0], raceOffset(round))
		for i, err := range problems {
			switch c := errs.Code(err); {
			case err == nil:
			case c == errs.Transient:
				transient++
				t.Logf("%s: replica %d got Transient (allowed, retried): %v", what, i, err)
				insts[i] = createSettles(t, ctx, ps[i], spec, what)
			default:
				t.Errorf("%s: replica %d: %v (code %v), want success or Transient", what, i, err, c)
				insts[i] = createSettles(t, ctx, ps[i], spec, what)
			}
		}
		if insts[0].UID != spec.UID || insts[1].UID != spec.UID || !insts[0].CreatedAt.Equal(insts[1].CreatedAt) {
			t.Errorf("%s: the replicas returned different instances: %+v and %+v", what, insts[0], insts[1])
		}
		for i, p := range ps {
			if got, err := p.Get(ctx, spec.Ref()); err != nil || got.State != egressproxy.StateProvisioning || !got.CreatedAt.Equal(insts[0].CreatedAt) {
				t.Errorf("%s: replica %d Get = %+v, %v; want Provisioning, created %v", what, i, got, err, insts[0].CreatedAt)
			}
		}
		assertComplete(t, e.cfg, spec, what)
		if err := ps[order[1]].Delete(ctx, spec.Ref()); err != nil {
			t.Fatalf("%s: Delete: %v", what, err)
		}
		AssertInstanceGoneT(t, e.cfg, spec.Name, " after Delete in "+what)
	}
	t.Logf("%d rounds, %d Transient results (each resolved by a retry)", rounds(), transient)
	assertOnlyBases(t, e.cfg, " after every round")
}

// TestIntegrationCreateRacesDelete: one replica creates an instance while
// the other deletes it — an instance that does not exist yet (odd rounds)
// or one that already exists (even rounds), each side starting first in
// turn. Neither call may fail Permanent; a running domain keeps both its
// volumes; a retried Create then yields the complete instance and a Delete
// removes all of it.
func TestIntegrationCreateRacesDelete(t *testing.T) {
	e, ps, ctx := twoReplicas(t)
	var outcomes []string
	for round := range 2 * rounds() {
		spec := egressproxy.Spec{Name: fmt.Sprintf("cd-%d", round), UID: fmt.Sprintf("uid-cd-%d", round),
			UserData: fmt.Sprintf("#cloud-config\n# create-delete %d\n", round)}
		exists := round%2 == 0
		if exists {
			createSettles(t, ctx, ps[0], spec, "setup")
		}
		var cerr, derr error
		create := func() { _, cerr = ps[0].Create(ctx, spec) }
		del := func() { derr = ps[1].Delete(ctx, spec.Ref()) }
		deleteFirst := (round/2)%2 == 1
		offset := raceOffset(round / 2)
		if deleteFirst {
			race(offset, del, create)
		} else {
			race(offset, create, del)
		}
		what := fmt.Sprintf("round %d (exists %v, delete first %v, offset %v)", round, exists, deleteFirst, offset)
		for _, r := range []struct {
			op  string
			err error
		}{{"Create", cerr}, {"Delete", derr}} {
			if r.err != nil && errs.Code(r.err) != errs.Transient {
				t.Errorf("%s: %s: %v (code %v), want success or Transient", what, r.op, r.err, errs.Code(r.err))
			}
		}
		// Consistent: Get either finds nothing or the instance; a domain
		// that runs has both its volumes.
		got, gerr := ps[0].Get(ctx, spec.Ref())
		h := HostInstanceT(t, e.cfg, spec.Name)
		outcome := fmt.Sprintf("create=%v delete=%v get=%v", errs.Code(cerr), errs.Code(derr), errs.Code(gerr))
		if gerr == nil {
			outcome += "/" + string(got.State)
		}
		outcomes = append(outcomes, outcome)
		t.Logf("%s: %s; host: domain %v state %d overlay %v seed %v", what, outcome, h.Defined, h.State, h.Overlay, h.Seed)
		switch c := errs.Code(gerr); {
		case gerr == nil:
		case c == errs.NotFound:
		default:
			t.Errorf("%s: Get after the race: %v (code %v), want the instance or NotFound", what, gerr, c)
		}
		if h.Defined && h.State == libvirt.DomainRunning && (!h.Overlay || !h.Seed) {
			t.Errorf("%s: a running domain lost volumes: overlay %v seed %v", what, h.Overlay, h.Seed)
		}
		// Retryable: Create converges, Delete removes all of it.
		createSettles(t, ctx, ps[0], spec, what+" retry")
		assertComplete(t, e.cfg, spec, what+" after the retried Create")
		if err := ps[1].Delete(ctx, spec.Ref()); err != nil {
			t.Fatalf("%s: Delete: %v", what, err)
		}
		AssertInstanceGoneT(t, e.cfg, spec.Name, " after Delete in "+what)
	}
	t.Logf("%d rounds: %v", len(outcomes), outcomes)
	assertOnlyBases(t, e.cfg, " after every round")
}
