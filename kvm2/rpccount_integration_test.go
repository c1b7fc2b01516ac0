//go:build integration

// This file is in the external test package so that it can use
// internal/benchutil's libvirt RPC counter: benchutil imports kvm2, which
// an internal test file could not import without a cycle.
package kvm2_test

import (
	"testing"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/testing/benchutil"
	"github.com/egressproxy/egressproxy/kvm2"
)

// TestIntegrationRPCCounts measures how many libvirt RPCs the operations
// make, by counting CALL packets on a proxy in front of libvirtd's socket,
// and bounds them generously (no timing assertions).
func TestIntegrationRPCCounts(t *testing.T) {
	var rc *benchutil.RPCCounter
	p, ctx := kvm2.OpenLifecycleT(t, func(cfg *kvm2.Config) {
		var err error
		rc, err = benchutil.NewRPCCounter(t.TempDir(), cfg.LibvirtSocket)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = rc.Close() })
		cfg.LibvirtSocket = rc.Path()
	})

	if _, err := p.Check(ctx); err != nil {
		t.Fatal(err)
	}
	checkCalls := rc.Take()
	t.Logf("connect + Check: %d RPCs: %s", len(checkCalls), benchutil.Summary(checkCalls))

	cold := egressproxy.Spec{Name: "cold", UID: "uid-cold"}
	start := time.Now()
	if _, err := p.Create(ctx, cold); err != nil {
		t.Fatal(err)
	}
	coldCalls := rc.Take()
	t.Logf("cold-cache Create: %d RPCs in %v: %s", len(coldCalls), time.Since(start).Round(time.Millisecond), benchutil.Summary(coldCalls))

	hot := egressproxy.Spec{Name: "hot", UID: "uid-hot"}
	start = time.Now()
	if _, err := p.Create(ctx, hot); err != nil {
		t.Fatal(err)
	}
	createDur := time.Since(start)
	hotCalls := rc.Take()
	t.Logf("cache-hit Create→Provisioning: %d RPCs in %v: %s", len(hotCalls), createDur.Round(time.Millisecond), benchutil.Summary(hotCalls))

	start = time.Now()
	inst, err := p.Get(ctx, hot.Ref())
	if err != nil {
		t.Fatal(err)
	}
	getCalls := rc.Take()
	t.Logf("Get (%s, no guest OS): %d RPCs in %v: %s", inst.State, len(getCalls), time.Since(start).Round(time.Millisecond), benchutil.Summary(getCalls))

	if _, err := p.List(ctx); err != nil {
		t.Fatal(err)
	}
	listCalls := rc.Take()
	t.Logf("List of 2: %d RPCs: %s", len(listCalls), benchutil.Summary(listCalls))

	if err := p.Delete(ctx, hot.Ref()); err != nil {
		t.Fatal(err)
	}
	delCalls := rc.Take()
	t.Logf("Delete: %d RPCs: %s", len(delCalls), benchutil.Summary(delCalls))

	// Bounds a little above the counts measured (cold 24, cache hit 9,
	// Get 6, Delete 11): a regression that adds calls fails here.
	for _, b := range []struct {
		what  string
		calls []uint32
		max   int
	}{
		{"cold Create", coldCalls, 26},
		{"cache-hit Create", hotCalls, 10},
		{"Get", getCalls, 8},
		{"Delete", delCalls, 11},
	} {
		if len(b.calls) == 0 || len(b.calls) > b.max {
			t.Errorf("%s made %d RPCs, want 1..%d", b.what, len(b.calls), b.max)
		}
	}
}
