//go:build integration

package operator_test

import (
	"context"
	"fmt"
	"maps"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
	"github.com/egressproxy/egressproxy/examples/operator/controller"
	"github.com/egressproxy/egressproxy/health"
	"github.com/egressproxy/egressproxy/memprovider"
)

// childSample is what a watcher saw of a pool's children at one moment.
type childSample struct {
	at time.Time
	// kept: children of the first set not being deleted (draining ones
	// included: they still serve open tunnels); fresh: the other
	// children not being deleted that the slices list as ready (the
	// tracker's Healthy, which the pool reads; a child's status.health
	// is written by its own reconciler, here up to seconds later).
	kept, fresh int
	// detail is every child's name, set (old/new), health and state.
	detail string
	// redone names a child of the first set whose status.specDigest
	// changed: its VM was made again in place.
	redone string
}

// watchChildren reads the pool key's children every 100 ms until the
// returned function is called, which returns what it saw. first are the
// children at the start (by UID, with their spec digests).
func watchChildren(c client.Client, key client.ObjectKey, first map[string]string) func() []childSample {
	return sampleEvery(100*time.Millisecond, func() (childSample, bool) {
		var l v1alpha1.EgressProxyList
		if err := c.List(context.Background(), &l, client.InNamespace(key.Namespace), client.MatchingLabels{controller.LabelPool: key.Name}); err != nil {
			return childSample{}, false
		}
		var sl discoveryv1.EndpointSliceList
		if err := c.List(context.Background(), &sl, client.InNamespace(key.Namespace), client.MatchingLabels{discoveryv1.LabelServiceName: key.Name}); err != nil {
			return childSample{}, false
		}
		ready := map[types.UID]bool{}
		for _, s := range sl.Items {
			for _, e := range s.Endpoints {
				if e.TargetRef != nil && e.Conditions.Ready != nil && *e.Conditions.Ready {
					ready[e.TargetRef.UID] = true
				}
			}
		}
		smp := childSample{at: time.Now()}
		for _, k := range l.Items {
			digest, old := first[string(k.UID)]
			_, draining := k.Annotations[controller.AnnotationDrainingSince]
			switch {
			case old && k.Status.SpecDigest != digest:
				smp.redone = k.Name
			case old && k.DeletionTimestamp.IsZero():
				smp.kept++
			case !old && ready[k.UID] && k.DeletionTimestamp.IsZero():
				smp.fresh++
			}
			smp.detail += fmt.Sprintf(" %s(old %v, ready %v, draining %v, deleting %v)", k.Name, old, ready[k.UID], draining, !k.DeletionTimestamp.IsZero())
		}
		return smp, true
	})
}

// firstSet is the children's spec digests by UID.
func firstSet(kids []v1alpha1.EgressProxy) map[string]string {
	out := map[string]string{}
	for _, k := range kids {
		out[string(k.UID)] = k.Status.SpecDigest
	}
	return out
}

// watchMove watches the pool key's slices and children (first: the
// children before the change) every 100 ms until the returned function is
// called, which checks what they saw since t0: the slices never list
// fewer than want ready, children of the first set not yet deleted plus
// successors listed ready are never fewer than want, and no child of the
// first set had its VM made again in place. It logs what it measured,
// what as the change.
func watchMove(t *testing.T, c client.Client, key client.ObjectKey, first map[string]string, want int) func(what string, t0 time.Time) {
	stopSlices := watchSlices(c, key)
	stopChildren := watchChildren(c, key, first)
	return func(what string, t0 time.Time) {
		t.Helper()
		took := time.Since(t0)
		slicesSeen, childrenSeen := stopSlices(), stopChildren()
		minReady, minAvailable := -1, -1
		for _, smp := range slicesSeen {
			if smp.at.After(t0) && (minReady < 0 || len(smp.ready) < minReady) {
				minReady = len(smp.ready)
			}
		}
		redone := ""
		for _, smp := range childrenSeen {
			if smp.redone != "" && redone == "" {
				redone = smp.redone
				t.Errorf("child %s's VM was made again in place (its spec digest changed)", smp.redone)
			}
			if n := smp.kept + smp.fresh; minAvailable < 0 || n < minAvailable {
				minAvailable = n
			}
			if smp.kept+smp.fresh < want {
				t.Logf("at %v: %d + %d:%s", smp.at.Sub(t0).Round(time.Millisecond), smp.kept, smp.fresh, smp.detail)
			}
		}
		t.Logf("%s in %v: the slices (%d samples) listed at least %d ready; predecessors not deleted + successors listed ready at least %d (%d samples)",
			what, took.Round(time.Millisecond), len(slicesSeen), minReady, minAvailable, len(childrenSeen))
		if minReady < want {
			t.Errorf("the slices listed as few as %d ready, want at least replicas - maxUnavailable = %d", minReady, want)
		}
		if minAvailable < want {
			t.Errorf("as few as %d predecessors not deleted or successors listed ready, want %d: a predecessor went before its successor was Healthy", minAvailable, want)
		}
	}
}

// settledOn says what is missing for the pool key to hold want children,
// spread as spread says, every one Healthy, listed, passing ok and not
// draining, and the entries to hold instances VMs ("" when nothing is).
func (pe *poolEnv) settledOn(ctx context.Context, key client.ObjectKey, want int, spread, instances map[string]int, ok func(v1alpha1.EgressProxy) string) ([]v1alpha1.EgressProxy, string) {
	kids, msg := poolState(ctx, pe.c, key, want, spread)
	if msg != "" {
		return nil, msg
	}
	for _, k := range kids {
		if _, draining := k.Annotations[controller.AnnotationDrainingSince]; draining {
			return nil, fmt.Sprintf("child %s is draining", k.Name)
		}
		if msg := ok(k); msg != "" {
			return nil, msg
		}
	}
	n, err := pe.instances(ctx)
	if err != nil {
		return nil, err.Error()
	}
	if !maps.Equal(n, instances) {
		return nil, fmt.Sprintf("instances %v, want %v", n, instances)
	}
	return kids, ""
}

// takesPassword counts the children that tunnel a CONNECT to target with
// the pool's user and password.
func takesPassword(ctx context.Context, kids []v1alpha1.EgressProxy, target, password string) (int, []string) {
	n, refusals := 0, []string(nil)
	for _, k := range kids {
		r := health.Probe(ctx, k.Status.Address, target, &health.ProbeOptions{Username: "pool-user", Password: password, Timeout: 5 * time.Second})
		if r.OK {
			n++
		} else {
			refusals = append(refusals, fmt.Sprintf("%s: %v (%s)", k.Name, r.Err, r.Kind))
		}
	}
	return n, refusals
}

// TestPoolSecretChangeOnMemoryEntries: a new password in the credentials
// Secret of a pool of 6 (maxSurge 1, maxUnavailable 0) on three memory
// entries, whose proxies enforce the credentials their user-data holds,
// replaces the children one surge at a time: no child's VM is made again
// in place (its spec digest never changes; it serves the old password
// until it goes), a child of the old revision is deleted only when a
// successor is Healthy (those not deleted + successors listed ready
// never below 6, read every 100 ms), the slices never list fewer than 6
// ready, and at the end every child has the new revision and takes the
// new password, not the old one.
func TestPoolSecretChangeOnMemoryEntries(t *testing.T) {
	pe := startPoolEnv(t)
	ctx := context.Background()
	pool := pe.createPool(t, "rotate", 6, 0)
	key := client.ObjectKeyFromObject(pool)
	spread := map[string]int{"mem-a": 2, "mem-b": 2, "mem-c": 2}
	var kids []v1alpha1.EgressProxy
	waitFor(t, 2*time.Minute, "a pool of 6, 2/2/2, every child Healthy and listed", func() string {
		var msg string
		kids, msg = poolState(ctx, pe.c, key, 6, spread)
		return msg
	})
	oldRev := kids[0].Labels[controller.LabelPoolRevision]
	for _, k := range kids {
		if k.Status.SpecDigest == "" || k.Labels[controller.LabelPoolRevision] != oldRev || oldRev == "" {
			t.Fatalf("child %s: digest %q, revision %q (first child's %q)", k.Name, k.Status.SpecDigest, k.Labels[controller.LabelPoolRevision], oldRev)
		}
	}
	first := firstSet(kids)
	check := watchMove(t, pe.c, key, first, 6)

	var sec corev1.Secret
	if err := pe.c.Get(ctx, client.ObjectKey{Namespace: pe.ns, Name: "creds"}, &sec); err != nil {
		t.Fatal(err)
	}
	sec.Data["password"] = []byte("pool-password-2")
	if err := pe.c.Update(ctx, &sec); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	// A child of the old revision still serves the old password a moment
	// later: its VM was not made again.
	time.Sleep(2 * pe.interval)
	if n, _ := takesPassword(ctx, kids, pe.target, "pool-password"); n == 0 {
		t.Errorf("%v after the change no child of the old revision took the old password", 2*pe.interval)
	}
	var final []v1alpha1.EgressProxy
	waitFor(t, 3*time.Minute, "every child of the new revision, 2/2/2, Healthy, none draining, 6 VMs", func() string {
		var msg string
		final, msg = pe.settledOn(ctx, key, 6, spread, spread, func(k v1alpha1.EgressProxy) string {
			if _, old := first[string(k.UID)]; old || k.Labels[controller.LabelPoolRevision] == oldRev {
				return fmt.Sprintf("child %s has the old revision", k.Name)
			}
			return ""
		})
		return msg
	})
	check("a new password rolled out", t0)
	if n, refusals := takesPassword(ctx, final, pe.target, "pool-password-2"); n != len(final) {
		t.Errorf("CONNECTs with the new password refused: %v", refusals)
	}
	if n, refusals := takesPassword(ctx, final, pe.target, "pool-password"); n != 0 || len(refusals) != len(final) {
		t.Errorf("%d children took the old password, want none", n)
	} else if !strings.Contains(refusals[0], health.KindAuthRequired.String()) {
		t.Errorf("the old password refused with %s, want %s", refusals[0], health.KindAuthRequired)
	}
	pe.deletePool(t, pool)
}

// TestPoolMovesEntriesOnMemoryEntries: a pool of 4 on two of four memory
// entries (spec.entries.names mem-a and mem-b, 2/2) whose names change
// to mem-c and mem-d ends 2/2 there, the VMs on mem-a and mem-b deleted,
// each child moved successor first: those not deleted + successors
// listed ready never below 4 and the slices never list fewer than 4
// ready, read every 100 ms.
func TestPoolMovesEntriesOnMemoryEntries(t *testing.T) {
	entries := map[string]*egressproxy.Client{}
	for _, name := range []string{"mem-a", "mem-b", "mem-c", "mem-d"} {
		entries[name] = memprovider.New(&memprovider.Options{ServeProxies: true})
	}
	pe := startPoolEnvWith(t, poolEnvOptions{entries: entries})
	ctx := context.Background()
	pool := pe.createPool(t, "move", 4, 0, func(p *v1alpha1.EgressProxyPool) {
		p.Spec.Entries.Names = []string{"mem-a", "mem-b"}
	})
	key := client.ObjectKeyFromObject(pool)
	var kids []v1alpha1.EgressProxy
	waitFor(t, 2*time.Minute, "a pool of 4, 2/2 on mem-a and mem-b, every child Healthy and listed", func() string {
		var msg string
		kids, msg = poolState(ctx, pe.c, key, 4, map[string]int{"mem-a": 2, "mem-b": 2})
		return msg
	})
	check := watchMove(t, pe.c, key, firstSet(kids), 4)
	var cur v1alpha1.EgressProxyPool
	if err := pe.c.Get(ctx, key, &cur); err != nil {
		t.Fatal(err)
	}
	cur.Spec.Entries.Names = []string{"mem-c", "mem-d"}
	if err := pe.c.Update(ctx, &cur); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	waitFor(t, 3*time.Minute, "2/2 on mem-c and mem-d, Healthy, none draining, no VM left on mem-a and mem-b", func() string {
		_, msg := pe.settledOn(ctx, key, 4, map[string]int{"mem-c": 2, "mem-d": 2},
			map[string]int{"mem-a": 0, "mem-b": 0, "mem-c": 2, "mem-d": 2}, func(v1alpha1.EgressProxy) string { return "" })
		return msg
	})
	check("moved to mem-c and mem-d", t0)
	pe.deletePool(t, pool)
}
