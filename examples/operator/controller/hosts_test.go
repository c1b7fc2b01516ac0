package controller

import (
	"context"
	"testing"

	"github.com/go-logr/logr"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
	"github.com/egressproxy/egressproxy/memprovider"
)

// TestHostsFromCheck: each round writes one EgressProxyHost per entry from
// its Check (Ready, reason, details, capacity, time); an unreachable entry
// turns not Ready with the library's reason and no capacity, and Ready
// again; the operator's objects of entries no longer configured are
// deleted, one made by hand is not.
func TestHostsFromCheck(t *testing.T) {
	ctx := context.Background()
	managed := map[string]string{ManagedByLabel: ManagedBy}
	c := fake.NewClientBuilder().WithScheme(testScheme(t)).WithStatusSubresource(&v1alpha1.EgressProxyHost{}).WithObjects(
		&v1alpha1.EgressProxyHost{ObjectMeta: metav1.ObjectMeta{Name: "removed", Labels: managed}},
		&v1alpha1.EgressProxyHost{ObjectMeta: metav1.ObjectMeta{Name: "by-hand"}},
	).Build()
	capacity := egressproxy.Capacity{MemoryAvailableBytes: 3 << 30, CPUs: 6, PoolAvailableBytes: 40 << 30}
	entries := map[string]*egressproxy.Client{
		"mem1": memprovider.New(&memprovider.Options{Capacity: capacity}),
		"mem2": memprovider.New(nil),
	}
	t.Cleanup(func() { _ = CloseEntries(entries) })
	if _, err := entries["mem1"].Create(ctx, egressproxy.Spec{Name: "px", UID: "uid-px"}); err != nil {
		t.Fatal(err)
	}
	hr, err := NewHealthRunnable(entries, HealthOptions{ConnectTarget: "127.0.0.1:9"})
	if err != nil {
		t.Fatal(err)
	}
	hr.hosts = newHostWriter(c, c, []string{"mem1", "mem2"}, logr.Discard())

	host := func(name string) *v1alpha1.EgressProxyHost {
		t.Helper()
		var h v1alpha1.EgressProxyHost
		if err := c.Get(ctx, client.ObjectKey{Name: name}, &h); err != nil {
			t.Fatalf("host %s: %v", name, err)
		}
		return &h
	}
	ready := func(h *v1alpha1.EgressProxyHost) *metav1.Condition {
		return meta.FindStatusCondition(h.Status.Conditions, v1alpha1.ConditionHostReady)
	}

	hr.Round(ctx)
	h1 := host("mem1")
	if c := ready(h1); c == nil || c.Status != metav1.ConditionTrue || c.Reason != ReasonReachable {
		t.Errorf("mem1 Ready %+v, want True/%s", c, ReasonReachable)
	}
	if h1.Labels[ManagedByLabel] != ManagedBy {
		t.Errorf("mem1 labels %v, want %s=%s", h1.Labels, ManagedByLabel, ManagedBy)
	}
	cp := h1.Status.Capacity
	if cp == nil || cp.PoolAvailable.Value() != capacity.PoolAvailableBytes || cp.MemoryAvailable.Value() != capacity.MemoryAvailableBytes ||
		cp.CPUs != 6 || cp.Instances != 1 {
		t.Errorf("mem1 capacity %+v, want pool %d, memory %d, 6 CPUs, 1 instance", cp, capacity.PoolAvailableBytes, capacity.MemoryAvailableBytes)
	}
	if cp != nil && cp.PoolAvailable.String() != "40Gi" {
		t.Errorf("mem1 pool available prints as %s, want 40Gi", cp.PoolAvailable.String())
	}
	if h1.Status.Details["backend"] != "memory" || h1.Status.LastCheckTime == nil {
		t.Errorf("mem1 details %v, last check %v", h1.Status.Details, h1.Status.LastCheckTime)
	}
	if cp := host("mem2").Status.Capacity; cp == nil || cp.Instances != 0 || cp.CPUs != 8 {
		t.Errorf("mem2 capacity %+v, want memprovider's defaults and no instance", cp)
	}
	if err := c.Get(ctx, client.ObjectKey{Name: "removed"}, &v1alpha1.EgressProxyHost{}); !apierrors.IsNotFound(err) {
		t.Errorf("the host of a removed entry: %v, want it deleted", err)
	}
	host("by-hand") // a host the operator did not write stays

	var ctl *memprovider.Control
	entries["mem2"].As(&ctl)
	ctl.InjectFault(memprovider.OpCheck, memprovider.Fault{Reason: egressproxy.ReasonUnreachable, Code: egressproxy.Transient})
	hr.Round(ctx)
	h2 := host("mem2")
	c2 := ready(h2)
	if c2 == nil || c2.Status != metav1.ConditionFalse || c2.Reason != string(egressproxy.ReasonUnreachable) || h2.Status.Capacity != nil {
		t.Errorf("mem2 unreachable: Ready %+v, capacity %+v; want False/Unreachable, no capacity", c2, h2.Status.Capacity)
	}
	if c := ready(host("mem1")); c == nil || c.Status != metav1.ConditionTrue || !c.LastTransitionTime.Equal(&ready(h1).LastTransitionTime) {
		t.Errorf("mem1 while mem2 is unreachable: %+v, want still True since the first round", c)
	}
	ctl.ClearFaults()
	hr.Round(ctx)
	if c := ready(host("mem2")); c == nil || c.Status != metav1.ConditionTrue || host("mem2").Status.Capacity == nil {
		t.Errorf("mem2 reachable again: Ready %+v", c)
	}
}
