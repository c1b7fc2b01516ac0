//go:build integration

package kvm2_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/testing/benchutil"
	"github.com/egressproxy/egressproxy/internal/testing/lab/delayproxy"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// TestIntegrationListScaleRTT is the libvirtscale bench phase
// (docs/scale-libvirt.md) at a small count: 100 stopped instances of the
// entry's owner (clones of one Create made: defined, never started) beside
// 10 foreign domains (5 named like the entry's instances with another
// owner's metadata, 5 of other names without metadata), listed through a
// delay proxy adding 50 ms of round-trip time in front of the stack's
// sshd. List returns exactly the owner's instances, reads the XML of the
// domains named like them and no other (1 + 105 RPCs), and takes 2 round
// trips on the critical path (the stats call, then every XML read at
// once): its reads are pipelined listInFlight (256) at a time, so up to
// that many the round trips do not grow with the count. The bound allows
// one round of slack; the 32 reads in flight of before took 5.
func TestIntegrationListScaleRTT(t *testing.T) {
	const (
		n, foreign = 100, 10
		rtt        = 50 * time.Millisecond
		maxRounds  = 3
	)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	k, remote, want := listScaleFixture(ctx, t, n, foreign, rtt)
	for run := range 2 {
		k.Counter.Take()
		start := time.Now()
		got, err := remote.List(ctx)
		d := time.Since(start)
		rounds := k.Counter.Rounds(rtt / 2)
		calls := k.Counter.Take()
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("run %d: List of %d beside %d foreign through +%v: %d RPCs, %d round trips, %v: %s",
			run, n, foreign, rtt, len(calls), rounds, d.Round(time.Millisecond), benchutil.Summary(calls))
		checkListed(t, got, want)
		if wantRPCs := 1 + n + foreign/2; len(calls) != wantRPCs {
			t.Errorf("%d RPCs, want %d (the stats call, the XML of each domain named like the entry's)", len(calls), wantRPCs)
		}
		if rounds > maxRounds {
			t.Errorf("%d round trips on the critical path, want ≤ %d whatever the count up to 256", rounds, maxRounds)
		}
	}
}

// checkListed fails t unless got is exactly want's instances (name → UID),
// all stopped.
func checkListed(t *testing.T, got []egressproxy.Instance, want map[string]string) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("listed %d instances, want %d", len(got), len(want))
	}
	for _, inst := range got {
		if uid, ok := want[inst.Name]; !ok || uid != inst.UID || inst.State != egressproxy.StateStopped {
			t.Errorf("listed %s (UID %s, %s): not one of the owner's stopped instances", inst.Name, inst.UID, inst.State)
		}
	}
}

// listScaleFixture makes n stopped instances of a fresh entry (clones of
// one Create made) and foreign domains beside them, and opens the entry
// through a delay proxy of rtt: it returns the entry, that client and the
// instances (name → UID).
func listScaleFixture(ctx context.Context, t *testing.T, n, foreign int, rtt time.Duration) (*benchutil.KVM, *egressproxy.Client, map[string]string) {
	t.Helper()
	env := teststack.Require(t)
	sfx := fmt.Sprintf("%04x", rand.IntN(1<<16))
	k, err := benchutil.NewKVM(ctx, env, t.TempDir(), "lsc"+sfx, "vblsc"+sfx, "10.213."+strconv.Itoa(150+rand.IntN(50)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(k.Close)

	tmpl := k.Spec("t", 0)
	if _, err := k.Plain.Create(ctx, tmpl); err != nil {
		t.Fatal(err)
	}
	if err := k.Stop(ctx, tmpl.Name); err != nil {
		t.Fatal(err)
	}
	tp, err := k.Template(ctx, tmpl)
	if err != nil {
		t.Fatal(err)
	}
	if err := k.Plain.Delete(ctx, tmpl.Ref()); err != nil {
		t.Fatal(err)
	}
	specs := make([]egressproxy.Spec, n)
	want := map[string]string{}
	for i := range specs {
		specs[i] = k.Spec("i", i)
		want[specs[i].Name] = specs[i].UID
	}
	if err := k.Clone(ctx, tp, specs, 16); err != nil {
		t.Fatal(err)
	}
	if err := k.CloneForeign(ctx, tp, foreign, 16); err != nil {
		t.Fatal(err)
	}

	px, err := delayproxy.New(delayproxy.Config{Target: env.SSHAddr, RTT: rtt})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = px.Close() })
	remote, err := k.OpenVia(ctx, px.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := remote.Check(ctx); err != nil { // dials
		t.Fatal(err)
	}
	return k, remote, want
}
