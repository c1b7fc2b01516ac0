package controller

import (
	"context"
	"fmt"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/event"

	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
)

// A burst of reconcile requests far larger than the channel (a health
// round that changes 2,000 proxies) loses none: every key arrives once, in
// the order asked, a key asked again while pending is sent once; add never
// blocks, and Start ends with its context.
func TestNotifierLosesNone(t *testing.T) {
	ch := make(chan event.TypedGenericEvent[*v1alpha1.EgressProxy], 4)
	n := newNotifier(ch, proxyKey)
	const keys = 2000
	key := func(i int) types.NamespacedName {
		return types.NamespacedName{Namespace: "ns", Name: fmt.Sprintf("p-%05d", i)}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range keys {
			n.add(key(i))
			if i%2 == 0 {
				n.add(key(i)) // again while pending, or after sent: never lost
			}
		}
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("add blocked with nobody reading")
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	go func() { defer close(stopped); _ = n.Start(ctx) }()
	for i := range keys {
		select {
		case ev := <-ch:
			if got := (types.NamespacedName{Namespace: ev.Object.Namespace, Name: ev.Object.Name}); got != key(i) {
				t.Fatalf("event %d is for %s, want %s", i, got, key(i))
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("%d of %d requests arrived", i, keys)
		}
	}
	select {
	case ev := <-ch:
		t.Fatalf("an extra request for %s/%s (a key asked twice while pending is sent once)", ev.Object.Namespace, ev.Object.Name)
	case <-time.After(50 * time.Millisecond):
	}
	// Asked after the burst: sent too.
	n.add(key(7))
	select {
	case ev := <-ch:
		if ev.Object.Name != key(7).Name {
			t.Fatalf("got %s, want %s", ev.Object.Name, key(7).Name)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a request after the burst did not arrive")
	}
	n.add(key(8)) // pending when the context ends: Start still returns
	cancel()
	select {
	case <-stopped:
	case <-time.After(30 * time.Second):
		t.Fatal("Start did not end with its context")
	}
}
