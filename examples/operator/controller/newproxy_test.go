package controller

import (
	"context"
	"sync"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/health"
	"github.com/egressproxy/egressproxy/internal/testing/eventually"
	"github.com/egressproxy/egressproxy/memprovider"
)

// A proxy registered anew is probed at HealthOptions.NewProxyInterval
// until the tracker decides it, not at the next round: with rounds an
// hour apart it is Healthy, and its object asked to reconcile, within
// seconds; then it is no newcomer any more. With the option negative it
// waits for the rounds.
func TestNewProxyProbedSoon(t *testing.T) {
	target := listenTarget(t)
	c := memprovider.New(&memprovider.Options{ServeProxies: true})
	t.Cleanup(func() { _ = c.Close() })
	ctx := context.Background()
	inst, err := c.Create(ctx, egressproxy.Spec{Name: "px-new", UID: "uid-new"})
	if err != nil {
		t.Fatal(err)
	}
	key := types.NamespacedName{Namespace: "ns", Name: "new"}
	for _, tt := range []struct {
		name     string
		interval time.Duration
		soon     bool
	}{
		{"on", 20 * time.Millisecond, true},
		{"off", -1, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			hr, err := NewHealthRunnable(map[string]*egressproxy.Client{"mem": c}, HealthOptions{Interval: time.Hour, ConnectTarget: target, NewProxyInterval: tt.interval})
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			var notified []types.NamespacedName
			hr.notify = func(k types.NamespacedName) { mu.Lock(); notified = append(notified, k); mu.Unlock() }
			rctx, cancel := context.WithCancel(ctx)
			done := make(chan struct{})
			go func() { defer close(done); _ = hr.Start(rctx) }()
			defer func() { cancel(); <-done }()

			hr.Register(Member{Key: key, ID: inst.Name, Addr: inst.Address()})
			healthy := func() bool { st, _ := hr.tracker.Get(inst.Name); return st.State == health.StateHealthy }
			if !tt.soon {
				time.Sleep(300 * time.Millisecond)
				if healthy() {
					t.Fatal("Healthy within 300ms with NewProxyInterval off and rounds an hour apart")
				}
				return
			}
			eventually.True(t, 10*time.Second, healthy, "the new proxy Healthy without waiting for a round")
			eventually.True(t, 10*time.Second, func() bool {
				mu.Lock()
				defer mu.Unlock()
				return len(notified) == 1 && notified[0] == key
			}, "one reconcile asked for %s", key)
			eventually.True(t, 10*time.Second, func() bool {
				hr.mu.Lock()
				defer hr.mu.Unlock()
				return len(hr.newcomers) == 0
			}, "the decided proxy no newcomer any more")
			// Registered again at the same address (every reconcile
			// does): no newcomer.
			hr.Register(Member{Key: key, ID: inst.Name, Addr: inst.Address()})
			hr.mu.Lock()
			n := len(hr.newcomers)
			hr.mu.Unlock()
			if n != 0 {
				t.Errorf("%d newcomers after registering a known proxy at its address again", n)
			}
		})
	}
}
