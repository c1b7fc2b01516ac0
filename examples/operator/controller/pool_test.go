package controller

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
	"github.com/egressproxy/egressproxy/memprovider"
)

type poolFixture struct {
	c    client.Client
	r    *PoolReconciler
	ctl  map[string]*memprovider.Control
	key  types.NamespacedName
	ents map[string]*egressproxy.Client
}

// newPoolFixture is a pool reconciler over a fake client holding pool,
// with memory entries a, b and c (labels zone x, x, y) Checked once.
// settle makes *now the reconciler's clock and brings the pool to its
// replicas, every child Healthy: a reconcile, every child healed, and
// another reconcile.
func (f *poolFixture) settle(t *testing.T, now *time.Time) {
	t.Helper()
	f.r.Now = func() time.Time { return *now }
	f.reconcile(t)
	f.healAll(t)
	f.reconcile(t)
}

func newPoolFixture(t *testing.T, pool *v1alpha1.EgressProxyPool, objs ...client.Object) *poolFixture {
	t.Helper()
	c := fake.NewClientBuilder().WithScheme(testScheme(t)).
		WithStatusSubresource(&v1alpha1.EgressProxy{}, &v1alpha1.EgressProxyPool{}).
		WithObjects(append(objs, pool)...).Build()
	f := &poolFixture{c: c, ctl: map[string]*memprovider.Control{}, key: client.ObjectKeyFromObject(pool), ents: map[string]*egressproxy.Client{}}
	for _, name := range []string{"a", "b", "c"} {
		m := memprovider.New(nil)
		var ctl *memprovider.Control
		m.As(&ctl)
		f.ents[name], f.ctl[name] = m, ctl
	}
	t.Cleanup(func() {
		if err := CloseEntries(f.ents); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	hr, err := NewHealthRunnable(f.ents, HealthOptions{ConnectTarget: "127.0.0.1:9"})
	if err != nil {
		t.Fatal(err)
	}
	f.r = &PoolReconciler{Client: c, APIReader: c, Entries: f.ents, Health: hr, opts: PoolOptions{Resync: time.Minute},
		EntryLabels: map[string]map[string]string{"a": {"zone": "x"}, "b": {"zone": "x"}, "c": {"zone": "y"}}}
	f.check()
	return f
}

// check Checks every entry once, as the health runnable's loops do.
func (f *poolFixture) check() {
	for name, c := range f.ents {
		f.r.Health.checkEntry(context.Background(), name, c)
	}
}

func newPool(name string, replicas int32) *v1alpha1.EgressProxyPool {
	return &v1alpha1.EgressProxyPool{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns1", Name: name, UID: types.UID("uid-" + name), Generation: 1},
		Spec: v1alpha1.EgressProxyPoolSpec{Replicas: replicas,
			Template: v1alpha1.ProxyTemplate{Port: 3128, CredentialsSecretRef: &v1alpha1.SecretReference{Name: "creds"}}},
	}
}

func (f *poolFixture) reconcile(t *testing.T) (reconcile.Result, *v1alpha1.EgressProxyPool) {
	t.Helper()
	res, err := f.r.Reconcile(context.Background(), reconcile.Request{NamespacedName: f.key})
	if err != nil {
		t.Fatalf("Reconcile: %v", err)
	}
	var p v1alpha1.EgressProxyPool
	if err := f.c.Get(context.Background(), f.key, &p); err != nil {
		t.Fatal(err)
	}
	return res, &p
}

// children are the pool's children by name.
func (f *poolFixture) children(t *testing.T) map[string]*v1alpha1.EgressProxy {
	t.Helper()
	var l v1alpha1.EgressProxyList
	if err := f.c.List(context.Background(), &l, client.InNamespace(f.key.Namespace), client.MatchingLabels{LabelPool: f.key.Name}); err != nil {
		t.Fatal(err)
	}
	out := map[string]*v1alpha1.EgressProxy{}
	for i := range l.Items {
		out[l.Items[i].Name] = &l.Items[i]
	}
	return out
}

// spread is how many children each entry holds.
func spread(children map[string]*v1alpha1.EgressProxy) map[string]int {
	out := map[string]int{}
	for _, c := range children {
		out[c.Spec.Provider]++
	}
	return out
}

// setHealth writes a child's health and address, as its own reconciler
// would.
func (f *poolFixture) setHealth(t *testing.T, name string, h v1alpha1.Health, addr string) {
	t.Helper()
	var ep v1alpha1.EgressProxy
	if err := f.c.Get(context.Background(), client.ObjectKey{Namespace: f.key.Namespace, Name: name}, &ep); err != nil {
		t.Fatal(err)
	}
	ep.Status.Health, ep.Status.Address = h, addr
	if err := f.c.Status().Update(context.Background(), &ep); err != nil {
		t.Fatal(err)
	}
}

// listed are the addresses (ip:port) the pool's EndpointSlices list as
// ready.
func (f *poolFixture) listed(t *testing.T) []string {
	t.Helper()
	return f.endpoints(t, true)
}

// endpoints are the addresses the pool's EndpointSlices list as ready, or
// as terminating.
func (f *poolFixture) endpoints(t *testing.T, ready bool) []string {
	t.Helper()
	var l discoveryv1.EndpointSliceList
	if err := f.c.List(context.Background(), &l, client.InNamespace(f.key.Namespace),
		client.MatchingLabels{discoveryv1.LabelServiceName: f.key.Name, discoveryv1.LabelManagedBy: ManagedBy}); err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, s := range l.Items {
		for _, e := range s.Endpoints {
			if *e.Conditions.Ready != ready || *e.Conditions.Terminating == ready || !*e.Conditions.Serving {
				continue
			}
			for _, a := range e.Addresses {
				out = append(out, fmt.Sprintf("%s:%d", a, *s.Ports[0].Port))
			}
		}
	}
	slices.Sort(out)
	return out
}

func condition(p *v1alpha1.EgressProxyPool, typ string) string {
	c := meta.FindStatusCondition(p.Status.Conditions, typ)
	if c == nil {
		return ""
	}
	return string(c.Status) + "/" + c.Reason
}

// A pool of 6 on three reachable entries: 2/2/2, each child controlled by
// the pool and named by its index; a second reconcile changes nothing;
// the EndpointSlices list exactly the Healthy children; scaling to 4
// takes the unhealthy child first and keeps the spread within one.
func TestPoolSpreadsAndScales(t *testing.T) {
	pool := newPool("web", 6)
	pool.Spec.DrainPeriod = &metav1.Duration{Duration: 10 * time.Second}
	f := newPoolFixture(t, pool)
	now := time.Now()
	f.r.Now = func() time.Time { return now }
	res, p := f.reconcile(t)
	if res.RequeueAfter != time.Minute {
		t.Errorf("RequeueAfter %v, want the resync (1m)", res.RequeueAfter)
	}
	kids := f.children(t)
	if got, want := spread(kids), map[string]int{"a": 2, "b": 2, "c": 2}; !maps.Equal(got, want) {
		t.Fatalf("spread %v, want %v", got, want)
	}
	for i := range 6 {
		name := fmt.Sprintf("web-%d", i)
		c, ok := kids[name]
		if !ok {
			t.Fatalf("no child %s among %v", name, slices.Sorted(maps.Keys(kids)))
		}
		if !metav1.IsControlledBy(c, p) || c.Labels[LabelEntry] != c.Spec.Provider || c.Labels[LabelPoolIndex] != fmt.Sprint(i) {
			t.Errorf("child %s: owners %v, labels %v", name, c.OwnerReferences, c.Labels)
		}
		if c.Spec.Port != 3128 || c.Spec.CredentialsSecretRef == nil || c.Spec.CredentialsSecretRef.Name != "creds" {
			t.Errorf("child %s spec %+v, want the template's", name, c.Spec)
		}
	}
	if p.Status.CreatedReplicas != 6 || p.Status.HealthyReplicas != 0 || p.Status.DesiredReplicas != 6 || p.Status.ObservedGeneration != 1 {
		t.Errorf("status %+v", p.Status)
	}
	if got := condition(p, v1alpha1.ConditionPoolAvailable); got != "False/NotEnoughHealthy" {
		t.Errorf("Available %s", got)
	}
	if got := condition(p, v1alpha1.ConditionPoolPlaced); got != "True/Placed" {
		t.Errorf("Placed %s", got)
	}
	var svc corev1.Service
	if err := f.c.Get(context.Background(), f.key, &svc); err != nil {
		t.Fatalf("the pool's Service: %v", err)
	}
	if len(svc.Spec.Selector) != 0 || len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Port != 3128 || svc.Spec.Ports[0].Name != PoolPortName || !metav1.IsControlledBy(&svc, p) {
		t.Errorf("Service %+v, want selector-less, port proxy 3128, controlled by the pool", svc.Spec)
	}
	if got := f.listed(t); len(got) != 0 {
		t.Errorf("slices list %v before any child is Healthy", got)
	}

	f.reconcile(t)
	if n := len(f.children(t)); n != 6 {
		t.Fatalf("a second reconcile left %d children, want 6", n)
	}

	// Healthy children on one port: one slice lists them; memory-like
	// children on ports of their own: a slice per port.
	var want []string
	for i := range 6 {
		addr := fmt.Sprintf("192.0.2.%d:3128", 10+i)
		if i >= 4 {
			addr = fmt.Sprintf("127.0.0.1:%d", 40000+i)
		}
		f.setHealth(t, fmt.Sprintf("web-%d", i), v1alpha1.HealthHealthy, addr)
		if i >= 4 { // loopback: listed as an FQDN under localhost
			addr = fmt.Sprintf("127.0.0.1.localhost:%d", 40000+i)
		}
		want = append(want, addr)
	}
	slices.Sort(want)
	_, p = f.reconcile(t)
	if got := f.listed(t); !slices.Equal(got, want) {
		t.Errorf("slices list %v, want %v", got, want)
	}
	if p.Status.HealthyReplicas != 6 || condition(p, v1alpha1.ConditionPoolAvailable) != "True/Available" {
		t.Errorf("status %+v", p.Status)
	}

	// One child turns unhealthy: it leaves the slices.
	f.setHealth(t, "web-1", v1alpha1.HealthUnhealthy, "192.0.2.11:3128")
	f.reconcile(t)
	if got := f.listed(t); slices.Contains(got, "192.0.2.11:3128") || len(got) != 5 {
		t.Errorf("slices list %v, want the 5 Healthy children", got)
	}

	// Scale to 4: web-1 (unhealthy, on its entry) goes first.
	var cur v1alpha1.EgressProxyPool
	if err := f.c.Get(context.Background(), f.key, &cur); err != nil {
		t.Fatal(err)
	}
	cur.Spec.Replicas = 4
	if err := f.c.Update(context.Background(), &cur); err != nil {
		t.Fatal(err)
	}
	_, p = f.reconcile(t)
	// web-1 (not Healthy) is deleted at once; the Healthy one taken out
	// drains: listed as terminating until the drain period has passed.
	kids = f.children(t)
	var drained []string
	for name, c := range kids {
		if _, ok := c.Annotations[AnnotationDrainingSince]; ok {
			drained = append(drained, name)
		}
	}
	if len(kids) != 5 || len(drained) != 1 {
		t.Fatalf("after scaling to 4: %d children, draining %v; want 5, one draining", len(kids), drained)
	}
	if got := f.endpoints(t, false); len(got) != 1 || len(f.listed(t)) != 4 || p.Status.CreatedReplicas != 4 || p.Status.HealthyReplicas != 4 {
		t.Errorf("draining: terminating %v, ready %v, status %+v; want 1, 4 and 4 created, 4 Healthy", got, f.listed(t), p.Status)
	}
	now = now.Add(9 * time.Second)
	f.reconcile(t)
	if n := len(f.children(t)); n != 5 {
		t.Errorf("within the drain period: %d children, want 5", n)
	}
	now = now.Add(2 * time.Second)
	_, p = f.reconcile(t)
	kids = f.children(t)
	if len(kids) != 4 || len(f.endpoints(t, false)) != 0 {
		t.Fatalf("after the drain period: %d children, terminating %v", len(kids), f.endpoints(t, false))
	}
	if _, ok := kids["web-1"]; ok {
		t.Errorf("the unhealthy web-1 was kept: %v", slices.Sorted(maps.Keys(kids)))
	}
	sp := spread(kids)
	if lo, hi := slices.Min(slices.Collect(maps.Values(sp))), slices.Max(slices.Collect(maps.Values(sp))); hi-lo > 1 || len(sp) != 3 {
		t.Errorf("spread after scaling to 4: %v", sp)
	}
	if got := f.listed(t); len(got) != int(p.Status.HealthyReplicas) || len(got) != 4 {
		t.Errorf("after scaling to 4 the slices list %v, status says %d Healthy", got, p.Status.HealthyReplicas)
	}
	var dist int32
	for _, e := range p.Status.Entries {
		dist += e.Replicas
		if !e.Reachable || e.Replicas != int32(sp[e.Name]) {
			t.Errorf("status entry %+v, spread %v", e, sp)
		}
	}
	if dist != 4 || p.Status.CreatedReplicas != 4 {
		t.Errorf("status %+v", p.Status)
	}
}

// Placement takes only what the facts allow: no child on an entry whose
// last Check was not Reachable, none beyond maxPerEntry (a Shortfall that
// names why), none outside the entries the pool selects; a name taken by
// an object the pool does not control is skipped.
func TestPoolPlacementRules(t *testing.T) {
	t.Run("unreachable entry", func(t *testing.T) {
		f := newPoolFixture(t, newPool("p", 6))
		f.ctl["c"].InjectFault(memprovider.OpCheck, memprovider.Fault{Code: egressproxy.Transient})
		f.check()
		_, p := f.reconcile(t)
		if got, want := spread(f.children(t)), map[string]int{"a": 3, "b": 3}; !maps.Equal(got, want) {
			t.Errorf("spread %v, want %v", got, want)
		}
		if i := slices.IndexFunc(p.Status.Entries, func(e v1alpha1.PoolEntryStatus) bool { return e.Name == "c" }); i < 0 || p.Status.Entries[i].Reachable {
			t.Errorf("status entries %+v, want c unreachable", p.Status.Entries)
		}
	})
	t.Run("maxPerEntry", func(t *testing.T) {
		pool := newPool("p", 4)
		pool.Spec.MaxPerEntry = 1
		f := newPoolFixture(t, pool)
		_, p := f.reconcile(t)
		if got, want := spread(f.children(t)), map[string]int{"a": 1, "b": 1, "c": 1}; !maps.Equal(got, want) {
			t.Errorf("spread %v, want %v", got, want)
		}
		c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionPoolPlaced)
		if c == nil || c.Reason != ReasonShortfall || !strings.Contains(c.Message, "1 children fit on no entry") || !strings.Contains(c.Message, "a: MaxPerEntry") {
			t.Errorf("Placed %+v", c)
		}
	})
	for _, tc := range []struct {
		name string
		sel  v1alpha1.PoolEntries
		want map[string]int
	}{
		{"selector", v1alpha1.PoolEntries{Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"zone": "x"}}}, map[string]int{"a": 2, "b": 2}},
		{"names", v1alpha1.PoolEntries{Names: []string{"c"}}, map[string]int{"c": 4}},
		{"names or selector", v1alpha1.PoolEntries{Names: []string{"a"}, Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"zone": "y"}}}, map[string]int{"a": 2, "c": 2}},
		{"a name not configured", v1alpha1.PoolEntries{Names: []string{"b", "zz"}}, map[string]int{"b": 4}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pool := newPool("p", 4)
			pool.Spec.Entries = tc.sel
			f := newPoolFixture(t, pool)
			f.reconcile(t)
			if got := spread(f.children(t)); !maps.Equal(got, tc.want) {
				t.Errorf("spread %v, want %v", got, tc.want)
			}
		})
	}
	t.Run("invalid selector", func(t *testing.T) {
		pool := newPool("p", 2)
		pool.Spec.Entries.Selector = &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{Key: "zone", Operator: "Near"}}}
		f := newPoolFixture(t, pool)
		_, p := f.reconcile(t)
		if n := len(f.children(t)); n != 0 {
			t.Errorf("%d children with an invalid selector", n)
		}
		if c := meta.FindStatusCondition(p.Status.Conditions, v1alpha1.ConditionPoolPlaced); c == nil || c.Reason != ReasonInvalidEntries || !strings.Contains(c.Message, "spec.entries.selector") {
			t.Errorf("Placed %+v", c)
		}
	})
	t.Run("a taken name", func(t *testing.T) {
		other := &v1alpha1.EgressProxy{ObjectMeta: metav1.ObjectMeta{Namespace: "ns1", Name: "p-0"},
			Spec: v1alpha1.EgressProxySpec{Provider: "a"}}
		f := newPoolFixture(t, newPool("p", 2), other)
		f.reconcile(t)
		kids := f.children(t)
		if _, ok := kids["p-1"]; !ok || len(kids) != 2 {
			t.Errorf("children %v, want p-1 and p-2 (p-0 is another object's)", slices.Sorted(maps.Keys(kids)))
		}
		if _, ok := kids["p-0"]; ok {
			t.Errorf("the object p-0 was taken over by the pool")
		}
	})
}

// setUnhealthySince marks a child Unhealthy since t (its Healthy
// condition's transition), as its reconciler writes it.
func (f *poolFixture) setUnhealthySince(t *testing.T, name string, since time.Time) {
	t.Helper()
	var ep v1alpha1.EgressProxy
	if err := f.c.Get(context.Background(), client.ObjectKey{Namespace: f.key.Namespace, Name: name}, &ep); err != nil {
		t.Fatal(err)
	}
	ep.Status.Health = v1alpha1.HealthUnhealthy
	ep.Status.Conditions = []metav1.Condition{{Type: v1alpha1.ConditionHealthy, Status: metav1.ConditionFalse, Reason: "ProbeRefused",
		Message: "refused", LastTransitionTime: metav1.NewTime(since)}}
	if err := f.c.Status().Update(context.Background(), &ep); err != nil {
		t.Fatal(err)
	}
}

// healAll marks every child without a health Healthy at an address of its
// own (its index's), as the tracker would once it passed its probes.
func (f *poolFixture) healAll(t *testing.T) {
	t.Helper()
	for name, c := range f.children(t) {
		if c.Status.Health == "" {
			f.setHealth(t, name, v1alpha1.HealthHealthy, "192.0.2."+c.Labels[LabelPoolIndex]+":3128")
		}
	}
}

func healthyCount(kids map[string]*v1alpha1.EgressProxy) int {
	n := 0
	for _, c := range kids {
		if c.Status.Health == v1alpha1.HealthHealthy {
			n++
		}
	}
	return n
}

// Self-healing: children whose entry is unreachable but which pass their
// probes stay; once they are Unhealthy for longer than the grace, each is
// replaced on the other entries first and deleted only when the
// replacements are Healthy; when the entry is back, the pool surges one
// child there at a time and removes one from the fullest entry once it is
// Healthy, until the spread is 2/2/2. At no step are fewer than 6
// children Healthy while the lost ones are deleted.
// A child whose proxy stays silent on an entry that is still reachable
// is replaced on the other entries first, not beside itself.
func TestPoolReplacesOnAnotherEntry(t *testing.T) {
	pool := newPool("p", 6)
	pool.Spec.UnhealthyGrace = &metav1.Duration{Duration: time.Minute}
	f := newPoolFixture(t, pool)
	now := time.Now()
	f.settle(t, &now)
	var silent []string
	for name, c := range f.children(t) {
		if c.Spec.Provider == "c" {
			silent = append(silent, name)
		}
	}
	if len(silent) != 2 {
		t.Fatalf("children on c: %v", silent)
	}
	for _, name := range silent {
		f.setUnhealthySince(t, name, now)
	}
	now = now.Add(2 * time.Minute)
	f.reconcile(t)
	// One surge at a time (the lost children's VMs still run on c): the
	// replacement goes to a or b.
	if got := spread(f.children(t)); got["c"] != 2 || got["a"]+got["b"] != 5 {
		t.Fatalf("past the grace, c reachable: spread %v, want a replacement on a or b and c's 2 kept", got)
	}
}

func TestPoolReplacesLostChildren(t *testing.T) {
	pool := newPool("p", 6)
	pool.Spec.UnhealthyGrace = &metav1.Duration{Duration: time.Minute}
	pool.Spec.DrainPeriod = &metav1.Duration{Duration: 10 * time.Second}
	f := newPoolFixture(t, pool)
	now := time.Now()
	f.settle(t, &now)
	onC := func() []string {
		var out []string
		for name, c := range f.children(t) {
			if c.Spec.Provider == "c" {
				out = append(out, name)
			}
		}
		slices.Sort(out)
		return out
	}
	lostNames := onC()
	if len(lostNames) != 2 {
		t.Fatalf("children on c: %v", lostNames)
	}

	// c's management link is down, its proxies still pass: nothing moves.
	f.ctl["c"].InjectFault(memprovider.OpCheck, memprovider.Fault{Code: egressproxy.Transient})
	f.check()
	f.reconcile(t)
	if kids := f.children(t); len(kids) != 6 || healthyCount(kids) != 6 || len(f.listed(t)) != 6 {
		t.Fatalf("an unreachable entry with Healthy proxies: %d children, %d Healthy, %d listed; want 6, 6, 6", len(kids), healthyCount(kids), len(f.listed(t)))
	}

	// Its proxies go silent: within the grace they stay (not listed).
	for _, name := range lostNames {
		f.setUnhealthySince(t, name, now)
	}
	now = now.Add(30 * time.Second)
	f.reconcile(t)
	if kids := f.children(t); len(kids) != 6 || len(f.listed(t)) != 4 {
		t.Fatalf("within the grace: %d children, %d listed; want 6 and 4", len(kids), len(f.listed(t)))
	}

	// Past the grace: two replacements on a and b, the lost ones kept
	// until the replacements are Healthy.
	now = now.Add(time.Minute)
	f.reconcile(t)
	kids := f.children(t)
	if got, want := spread(kids), map[string]int{"a": 3, "b": 3, "c": 2}; !maps.Equal(got, want) {
		t.Fatalf("after the grace: spread %v, want %v", got, want)
	}
	f.reconcile(t)
	if n := len(f.children(t)); n != 8 {
		t.Fatalf("a second reconcile: %d children, want 8", n)
	}
	f.healAll(t)
	_, p := f.reconcile(t)
	kids = f.children(t)
	if got, want := spread(kids), map[string]int{"a": 3, "b": 3}; !maps.Equal(got, want) || healthyCount(kids) != 6 {
		t.Fatalf("replacements Healthy: spread %v, want %v (the lost children deleted), %d Healthy", got, want, healthyCount(kids))
	}
	if p.Status.HealthyReplicas != 6 || len(f.listed(t)) != 6 {
		t.Errorf("status %+v, %d listed", p.Status, len(f.listed(t)))
	}

	// c is back: surge one there, then remove one from the fullest, until
	// 2/2/2.
	f.ctl["c"].ClearFaults()
	f.check()
	var steps []map[string]int
	for i := 0; i < 10; i++ {
		f.reconcile(t)
		kids = f.children(t)
		if healthyCount(kids) < 6 {
			t.Fatalf("step %d: %d Healthy, want at least 6", i, healthyCount(kids))
		}
		if len(kids) > 7 {
			t.Fatalf("step %d: %d children, more than replicas + maxSurge", i, len(kids))
		}
		steps = append(steps, spread(kids))
		if maps.Equal(spread(kids), map[string]int{"a": 2, "b": 2, "c": 2}) && healthyCount(kids) == 6 {
			break
		}
		f.healAll(t)
		now = now.Add(11 * time.Second) // past a drain
	}
	if got := steps[len(steps)-1]; !maps.Equal(got, map[string]int{"a": 2, "b": 2, "c": 2}) {
		t.Fatalf("the spread went %v, never 2/2/2", steps)
	}
	t.Logf("the spread went %v", steps)
	f.reconcile(t)
	if got := spread(f.children(t)); !maps.Equal(got, map[string]int{"a": 2, "b": 2, "c": 2}) {
		t.Errorf("settled spread moved on: %v", got)
	}
}

// A template change replaces the children one surge at a time: a
// successor is created, and its predecessor is taken out (listed as
// terminating, deleted after the drain period) only once the successor is
// Healthy; the pool never lists fewer than replicas - maxUnavailable as
// ready, and never holds more than replicas + maxSurge.
func TestPoolRollsOutTemplateChange(t *testing.T) {
	for _, maxUnavailable := range []int32{0, 1} {
		t.Run(fmt.Sprintf("maxUnavailable %d", maxUnavailable), func(t *testing.T) {
			pool := newPool("p", 6)
			pool.Spec.MaxSurge, pool.Spec.MaxUnavailable = 1, maxUnavailable
			pool.Spec.DrainPeriod = &metav1.Duration{Duration: 10 * time.Second}
			f := newPoolFixture(t, pool)
			now := time.Now()
			f.settle(t, &now)

			var cur v1alpha1.EgressProxyPool
			if err := f.c.Get(context.Background(), f.key, &cur); err != nil {
				t.Fatal(err)
			}
			cur.Spec.Template.MachineType = "large"
			if err := f.c.Update(context.Background(), &cur); err != nil {
				t.Fatal(err)
			}
			minReady, maxHeld, steps := 6, 0, 0
			for ; steps < 60; steps++ {
				_, p := f.reconcile(t)
				kids := f.children(t)
				minReady = min(minReady, len(f.listed(t)))
				maxHeld = max(maxHeld, len(kids))
				done := len(kids) == 6 && p.Status.HealthyReplicas == 6
				for _, c := range kids {
					done = done && c.Spec.MachineType == "large"
					if _, ok := c.Annotations[AnnotationDrainingSince]; ok {
						done = false
					}
				}
				if done {
					break
				}
				f.healAll(t)
				now = now.Add(4 * time.Second)
			}
			kids := f.children(t)
			for name, k := range kids {
				if k.Spec.MachineType != "large" {
					t.Errorf("child %s still has the old template", name)
				}
			}
			if len(kids) != 6 || len(f.listed(t)) != 6 {
				t.Fatalf("after %d steps: %d children, %d listed", steps, len(kids), len(f.listed(t)))
			}
			if sp := spread(kids); !maps.Equal(sp, map[string]int{"a": 2, "b": 2, "c": 2}) {
				t.Errorf("spread after the rollout %v", sp)
			}
			if minReady < 6-int(maxUnavailable) {
				t.Errorf("as few as %d listed as ready, want at least %d", minReady, 6-maxUnavailable)
			}
			if maxHeld > 6+1+int(maxUnavailable) {
				t.Errorf("as many as %d children at once", maxHeld)
			}
			t.Logf("rolled out in %d steps; at least %d ready, at most %d children", steps, minReady, maxHeld)
		})
	}
}

// The discovery endpoint answers the pools' ready endpoints as JSON, from
// their EndpointSlices: a terminating one is not among them.
func TestDiscoveryHandler(t *testing.T) {
	pool := newPool("web", 3)
	pool.Spec.DrainPeriod = &metav1.Duration{Duration: time.Minute}
	f := newPoolFixture(t, pool)
	f.reconcile(t)
	for i := range 3 {
		f.setHealth(t, fmt.Sprintf("web-%d", i), v1alpha1.HealthHealthy, fmt.Sprintf("192.0.2.%d:3128", 10+i))
	}
	f.reconcile(t)
	var cur v1alpha1.EgressProxyPool
	if err := f.c.Get(context.Background(), f.key, &cur); err != nil {
		t.Fatal(err)
	}
	cur.Spec.Replicas = 2 // one drains: listed as terminating
	if err := f.c.Update(context.Background(), &cur); err != nil {
		t.Fatal(err)
	}
	f.reconcile(t)
	if got := f.endpoints(t, false); len(got) != 1 {
		t.Fatalf("terminating %v, want one", got)
	}
	srv := httptest.NewServer(DiscoveryHandler(f.c, logr.Discard()))
	defer srv.Close()
	for _, q := range []string{"", "?namespace=ns1"} {
		resp, err := http.Get(srv.URL + DiscoveryPath + q)
		if err != nil {
			t.Fatal(err)
		}
		var d Discovery
		err = json.NewDecoder(resp.Body).Decode(&d)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "application/json" {
			t.Fatalf("GET %s: %s, %v", q, resp.Status, err)
		}
		want := []PoolEndpoints{{Namespace: "ns1", Name: "web", Service: "web", Endpoints: f.listed(t)}}
		if len(d.Pools) != 1 || !reflect.DeepEqual(d.Pools, want) || len(want[0].Endpoints) != 2 {
			t.Errorf("GET %s = %+v, want %+v", q, d.Pools, want)
		}
	}
	resp, err := http.Get(srv.URL + DiscoveryPath + "?namespace=other")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if strings.TrimSpace(string(body)) != `{"pools":[]}` {
		t.Errorf("another namespace: %s", body)
	}
	resp, err = http.Post(srv.URL+DiscoveryPath, "text/plain", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST: %s", resp.Status)
	}
}

// maxAge replaces a child older than it as a template change does: one
// surge at a time, never fewer than replicas ready.
func TestPoolMaxAge(t *testing.T) {
	pool := newPool("p", 3)
	pool.Spec.MaxAge = &metav1.Duration{Duration: time.Hour}
	pool.Spec.DrainPeriod = &metav1.Duration{Duration: 10 * time.Second}
	f := newPoolFixture(t, pool)
	now := time.Now()
	f.r.Now = func() time.Time { return now }
	f.reconcile(t)
	f.healAll(t)
	old := metav1.NewTime(now.Add(-2 * time.Hour).Truncate(time.Second)) // as stored
	for name := range f.children(t) {
		var ep v1alpha1.EgressProxy
		if err := f.c.Get(context.Background(), client.ObjectKey{Namespace: "ns1", Name: name}, &ep); err != nil {
			t.Fatal(err)
		}
		ep.CreationTimestamp = old
		if err := f.c.Update(context.Background(), &ep); err != nil {
			t.Fatal(err)
		}
	}
	if c := f.children(t)["p-0"]; !c.CreationTimestamp.Equal(&old) {
		t.Fatalf("the fake client kept no creationTimestamp: %v", c.CreationTimestamp)
	}
	minReady, steps := 3, 0
	for ; steps < 40; steps++ {
		_, p := f.reconcile(t)
		kids := f.children(t)
		minReady = min(minReady, len(f.listed(t)))
		done := len(kids) == 3 && p.Status.HealthyReplicas == 3
		for _, c := range kids {
			_, draining := c.Annotations[AnnotationDrainingSince]
			done = done && !c.CreationTimestamp.Equal(&old) && !draining
		}
		if done {
			break
		}
		if len(kids) > 4 {
			t.Fatalf("step %d: %d children, more than replicas + maxSurge", steps, len(kids))
		}
		f.healAll(t)
		now = now.Add(4 * time.Second)
	}
	if steps == 40 || minReady < 3 {
		t.Fatalf("after %d steps: children %v, at least %d ready", steps, slices.Sorted(maps.Keys(f.children(t))), minReady)
	}
	t.Logf("the 3 old children replaced in %d steps, at least %d ready", steps, minReady)
}

// TestPoolGraceWaitsForBoot: a child whose VM still boots on a reachable
// entry uses up no grace before BootTimeout from its creation (a real
// guest boots for about a minute, longer than a short grace), one on an
// unreachable entry does; a child whose VM just got its address has its
// grace from then; a child that had its address all along keeps the
// tracker's since. Past BootTimeout a VM that never booted is lost.
func TestPoolGraceWaitsForBoot(t *testing.T) {
	pool := newPool("p", 3)
	pool.Spec.UnhealthyGrace = &metav1.Duration{Duration: 15 * time.Second}
	f := newPoolFixture(t, pool)
	f.r.opts.BootTimeout = 5 * time.Minute
	f.ctl["c"].InjectFault(memprovider.OpCheck, memprovider.Fault{Code: egressproxy.Transient})
	f.check()
	created := time.Now().Add(-time.Minute)
	unhealthy := created.Add(3 * time.Second) // the tracker's fall after three failed probes
	ep := func(entry string, phase v1alpha1.Phase, ready *time.Time) *v1alpha1.EgressProxy {
		e := &v1alpha1.EgressProxy{ObjectMeta: metav1.ObjectMeta{Name: "x", CreationTimestamp: metav1.NewTime(created)},
			Spec: v1alpha1.EgressProxySpec{Provider: entry}, Status: v1alpha1.EgressProxyStatus{Phase: phase}}
		if ready != nil {
			meta.SetStatusCondition(&e.Status.Conditions, metav1.Condition{Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue, Reason: "Running", LastTransitionTime: metav1.NewTime(*ready)})
		}
		return e
	}
	addressed := created.Add(50 * time.Second)
	early := created.Add(-time.Hour)
	for _, tc := range []struct {
		name string
		ep   *v1alpha1.EgressProxy
		want time.Time
	}{
		{"booting on a reachable entry", ep("a", v1alpha1.PhaseProvisioning, nil), created.Add(5 * time.Minute)},
		{"pending on a reachable entry", ep("b", v1alpha1.PhasePending, nil), created.Add(5 * time.Minute)},
		{"booting on an unreachable entry", ep("c", v1alpha1.PhaseProvisioning, nil), unhealthy},
		{"an entry never Checked", ep("z", v1alpha1.PhaseProvisioning, nil), unhealthy},
		{"just got its address", ep("a", v1alpha1.PhaseRunning, &addressed), addressed},
		{"had its address all along", ep("a", v1alpha1.PhaseRunning, &early), unhealthy},
		{"running on an unreachable entry", ep("c", v1alpha1.PhaseRunning, &early), unhealthy},
	} {
		if got := f.r.graceStart(tc.ep, unhealthy); !got.Equal(tc.want) {
			t.Errorf("%s: grace from %v, want %v", tc.name, got.Sub(created), tc.want.Sub(created))
		}
	}
	// Through Reconcile: a pool of 2 whose children (on a and b) were
	// created at born, the one on a still booting, is left alone within
	// BootTimeout; past BootTimeout + grace the booting child is lost and
	// replaced.
	born := time.Now().Add(-time.Hour)
	pool2 := newPool("q", 2)
	pool2.Spec.UnhealthyGrace = &metav1.Duration{Duration: 15 * time.Second}
	isController := true
	rev := revisionOf(t, pool2)
	kid := func(i int, entry string, phase v1alpha1.Phase, h v1alpha1.Health) client.Object {
		e := &v1alpha1.EgressProxy{
			ObjectMeta: metav1.ObjectMeta{Namespace: pool2.Namespace, Name: childName(pool2.Name, i), CreationTimestamp: metav1.NewTime(born),
				Labels:          map[string]string{LabelPool: pool2.Name, LabelEntry: entry, LabelPoolIndex: fmt.Sprint(i), LabelPoolRevision: rev},
				OwnerReferences: []metav1.OwnerReference{{APIVersion: v1alpha1.GroupVersion.String(), Kind: "EgressProxyPool", Name: pool2.Name, UID: pool2.UID, Controller: &isController}}},
			Spec:   v1alpha1.EgressProxySpec{Provider: entry, ProxyTemplate: *pool2.Spec.Template.DeepCopy()},
			Status: v1alpha1.EgressProxyStatus{Phase: phase, Health: h, Address: map[bool]string{true: "127.0.0.1:3128"}[h == v1alpha1.HealthHealthy]},
		}
		return e
	}
	g := newPoolFixture(t, pool2, kid(0, "a", v1alpha1.PhaseProvisioning, v1alpha1.HealthUnknown), kid(1, "b", v1alpha1.PhaseRunning, v1alpha1.HealthHealthy))
	g.r.opts.BootTimeout = 5 * time.Minute
	g.ctl["c"].InjectFault(memprovider.OpCheck, memprovider.Fault{Code: egressproxy.Transient})
	g.check()
	now := born.Add(4 * time.Minute)
	g.r.Now = func() time.Time { return now }
	g.reconcile(t)
	if kids := g.children(t); len(kids) != 2 {
		t.Fatalf("a child booting for 4 min (BootTimeout 5 min): spread %v, want a:1 b:1 (no replacement)", spread(kids))
	}
	now = born.Add(5*time.Minute + 16*time.Second)
	g.reconcile(t)
	if kids := g.children(t); len(kids) != 3 {
		t.Fatalf("a child booting past BootTimeout + grace: spread %v, want 3 children (a replacement beside it)", spread(kids))
	}
}

// revisionOf is pool's revision with objs (its Secrets) in the cluster.
func revisionOf(t *testing.T, pool *v1alpha1.EgressProxyPool, objs ...client.Object) string {
	t.Helper()
	r := &PoolReconciler{APIReader: fake.NewClientBuilder().WithScheme(testScheme(t)).WithObjects(objs...).Build()}
	rev, err := r.poolRevision(context.Background(), pool)
	if err != nil {
		t.Fatal(err)
	}
	return rev
}
