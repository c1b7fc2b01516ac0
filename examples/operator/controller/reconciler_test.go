package controller

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/util/workqueue"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
	"github.com/egressproxy/egressproxy/health"
	"github.com/egressproxy/egressproxy/memprovider"
)

func testScheme(t *testing.T) *runtime.Scheme {
	t.Helper()
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	if err := v1alpha1.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	return s
}

type fixture struct {
	c   client.Client
	mem *egressproxy.Client
	ctl *memprovider.Control
	r   *Reconciler
	hr  *HealthRunnable
	key types.NamespacedName
}

// newFixture is a reconciler over a fake client holding one EgressProxy
// (with a credentials Secret) and a memprovider entry "mem".
func newFixture(t *testing.T, memOpts *memprovider.Options) *fixture {
	t.Helper()
	s := testScheme(t)
	ep := &v1alpha1.EgressProxy{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns1", Name: "proxy-a", UID: "uid-a", Generation: 1},
		Spec: v1alpha1.EgressProxySpec{Provider: "mem", ProxyTemplate: v1alpha1.ProxyTemplate{Port: 3128,
			CredentialsSecretRef: &v1alpha1.SecretReference{Name: "creds"}}},
	}
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "ns1", Name: "creds"},
		Data: map[string][]byte{"username": []byte("u1"), "password": []byte("p1")}}
	c := fake.NewClientBuilder().WithScheme(s).WithStatusSubresource(&v1alpha1.EgressProxy{}).WithObjects(ep, sec).Build()
	mem := memprovider.New(memOpts)
	var ctl *memprovider.Control
	mem.As(&ctl)
	entries := map[string]*egressproxy.Client{"mem": mem}
	t.Cleanup(func() {
		if err := CloseEntries(entries); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	hr, err := NewHealthRunnable(entries, HealthOptions{ConnectTarget: "127.0.0.1:9"})
	if err != nil {
		t.Fatal(err)
	}
	r := &Reconciler{Client: c, APIReader: c, Entries: entries, Health: hr}
	r.opts = Options{BackoffBase: time.Second, BackoffMax: time.Minute, PollInterval: 15 * time.Second, PermanentRetry: 10 * time.Minute}
	r.backoff = workqueue.NewTypedItemExponentialFailureRateLimiter[reconcile.Request](r.opts.BackoffBase, r.opts.BackoffMax)
	return &fixture{c: c, mem: mem, ctl: ctl, r: r, hr: hr, key: client.ObjectKeyFromObject(ep)}
}

func (f *fixture) reconcile(t *testing.T) (reconcile.Result, *v1alpha1.EgressProxy) {
	t.Helper()
	res, err := f.r.Reconcile(context.Background(), reconcile.Request{NamespacedName: f.key})
	if err != nil {
		t.Fatalf("Reconcile: %v", err)
	}
	var ep v1alpha1.EgressProxy
	if err := f.c.Get(context.Background(), f.key, &ep); err != nil {
		t.Fatalf("get: %v", err)
	}
	return res, &ep
}

func readyReason(ep *v1alpha1.EgressProxy) string {
	c := meta.FindStatusCondition(ep.Status.Conditions, v1alpha1.ConditionReady)
	if c == nil {
		return ""
	}
	return c.Reason
}

// TestErrorClassRequeue is the README's error-class -> requeue table.
func TestErrorClassRequeue(t *testing.T) {
	for _, tc := range []struct {
		name       string
		fault      memprovider.Fault
		wantReason string
		wantAfter  []time.Duration // RequeueAfter of two reconciles in a row
	}{
		{"transient backs off exponentially", memprovider.Fault{Code: egressproxy.Transient}, "Transient", []time.Duration{time.Second, 2 * time.Second}},
		{"unclassed is transient", memprovider.Fault{Err: errUnclassed{}}, "Transient", []time.Duration{time.Second, 2 * time.Second}},
		{"deadline backs off", memprovider.Fault{Code: egressproxy.DeadlineExceeded}, "DeadlineExceeded", []time.Duration{time.Second, 2 * time.Second}},
		{"permanent waits for a change", memprovider.Fault{Code: egressproxy.Permanent}, "Permanent", []time.Duration{10 * time.Minute, 10 * time.Minute}},
		{"spec conflict is permanent", memprovider.Fault{Code: egressproxy.Permanent, Err: egressproxy.ErrSpecConflict}, "SpecConflict", []time.Duration{10 * time.Minute, 10 * time.Minute}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, nil)
			f.ctl.InjectFault(memprovider.OpCreate, tc.fault)
			for i, want := range tc.wantAfter {
				res, ep := f.reconcile(t)
				if res.RequeueAfter != want {
					t.Errorf("reconcile %d: RequeueAfter %v, want %v", i, res.RequeueAfter, want)
				}
				if got := readyReason(ep); got != tc.wantReason {
					t.Errorf("reconcile %d: Ready reason %q, want %q", i, got, tc.wantReason)
				}
				if ep.Status.Phase != v1alpha1.PhasePending {
					t.Errorf("reconcile %d: phase %q, want Pending", i, ep.Status.Phase)
				}
			}
			// Once the fault is gone the object converges and the
			// backoff is forgotten.
			f.ctl.ClearFaults()
			if tc.wantReason == "SpecConflict" {
				return // conflict recovery is TestSpecDriftRecreates
			}
			_, ep := f.reconcile(t)
			if ep.Status.Phase != v1alpha1.PhaseRunning || readyReason(ep) != "Running" {
				t.Errorf("after clearing the fault: phase %q reason %q, want Running", ep.Status.Phase, readyReason(ep))
			}
			if n := f.r.backoff.NumRequeues(reconcile.Request{NamespacedName: f.key}); n != 0 {
				t.Errorf("backoff not forgotten after success: %d requeues", n)
			}
		})
	}
}

type errUnclassed struct{}

func (errUnclassed) Error() string { return "a class-less backend error" }

// TestCanceledStops: a reconcile whose context ended (the manager stops)
// does not requeue.
func TestCanceledStops(t *testing.T) {
	f := newFixture(t, nil)
	f.ctl.InjectFault(memprovider.OpCreate, memprovider.Fault{Code: egressproxy.Canceled})
	res, ep := f.reconcile(t)
	if res != (reconcile.Result{}) {
		t.Errorf("Result %+v, want none", res)
	}
	if got := readyReason(ep); got != ReasonShuttingDown {
		t.Errorf("Ready reason %q, want %q", got, ReasonShuttingDown)
	}
}

// TestSpecDriftRecreates: a changed port deletes the VM and creates it
// with the new spec.
func TestSpecDriftRecreates(t *testing.T) {
	f := newFixture(t, nil)
	_, ep := f.reconcile(t)
	if ep.Status.Phase != v1alpha1.PhaseRunning {
		t.Fatalf("phase %q, want Running", ep.Status.Phase)
	}
	firstDigest := ep.Status.SpecDigest
	first, err := f.mem.Get(context.Background(), egressproxy.Ref{Name: ep.Status.Instance, UID: string(ep.UID)})
	if err != nil {
		t.Fatal(err)
	}
	ep.Spec.Port = 8080
	ep.Generation = 2
	if err := f.c.Update(context.Background(), ep); err != nil {
		t.Fatal(err)
	}
	res, ep := f.reconcile(t)
	if readyReason(ep) != ReasonRecreating || res.RequeueAfter == 0 {
		t.Fatalf("after the change: reason %q requeue %v, want Recreating and a requeue", readyReason(ep), res.RequeueAfter)
	}
	_, ep = f.reconcile(t)
	inst, err := f.mem.Get(context.Background(), egressproxy.Ref{Name: ep.Status.Instance, UID: string(ep.UID)})
	if err != nil {
		t.Fatal(err)
	}
	if inst.Port != 8080 || !inst.CreatedAt.After(first.CreatedAt) && inst.SpecDigest == first.SpecDigest {
		t.Errorf("instance after drift: port %d digest %s, want port 8080 and a new instance", inst.Port, inst.SpecDigest)
	}
	if ep.Status.SpecDigest == firstDigest || ep.Status.SpecDigest != inst.SpecDigest {
		t.Errorf("status digest %s (first %s), instance digest %s", ep.Status.SpecDigest, firstDigest, inst.SpecDigest)
	}
	if ep.Status.ObservedGeneration != 2 {
		t.Errorf("observedGeneration %d, want 2", ep.Status.ObservedGeneration)
	}
}

// TestDeleteFinalizer: deleting the object deletes the VM, then the
// finalizer goes; a VM already gone is no error.
func TestDeleteFinalizer(t *testing.T) {
	f := newFixture(t, nil)
	_, ep := f.reconcile(t)
	ref := egressproxy.Ref{Name: ep.Status.Instance, UID: string(ep.UID)}
	if err := f.c.Delete(context.Background(), ep); err != nil {
		t.Fatal(err)
	}
	// The first delete attempt fails transiently: the object stays.
	f.ctl.InjectFault(memprovider.OpDelete, memprovider.Fault{Code: egressproxy.Transient, Times: 1})
	res, ep := f.reconcile(t)
	if res.RequeueAfter != time.Second || ep.Status.Phase != v1alpha1.PhaseDeleting {
		t.Errorf("failed delete: requeue %v phase %q, want 1s and Deleting", res.RequeueAfter, ep.Status.Phase)
	}
	if _, err := f.r.Reconcile(context.Background(), reconcile.Request{NamespacedName: f.key}); err != nil {
		t.Fatal(err)
	}
	if err := f.c.Get(context.Background(), f.key, &v1alpha1.EgressProxy{}); err == nil {
		t.Error("object still there after its VM was deleted")
	}
	if _, err := f.mem.Get(context.Background(), ref); egressproxy.Code(err) != egressproxy.NotFound {
		t.Errorf("VM after finalize: %v, want NotFound", err)
	}
}

// TestHealthFromTracker: a served proxy with the Secret's credentials
// becomes Healthy through the health runnable's rounds.
func TestHealthFromTracker(t *testing.T) {
	f := newFixture(t, &memprovider.Options{ServeProxies: true})
	target := listenTarget(t)
	f.hr.opts.ConnectTarget = target
	f.editSpec(t, func(s *v1alpha1.EgressProxySpec) {
		s.AllowedDestinations = []v1alpha1.Destination{{Ports: portsOf(t, target)}}
	})
	_, ep := f.reconcile(t)
	if ep.Status.Address == "" || ep.Status.Health != v1alpha1.HealthUnknown {
		t.Fatalf("after create: address %q health %q, want an address and Unknown", ep.Status.Address, ep.Status.Health)
	}
	var notified []types.NamespacedName
	f.hr.notify = func(k types.NamespacedName) { notified = append(notified, k) }
	for range 2 { // the tracker's default Rise
		f.hr.Round(context.Background())
	}
	_, ep = f.reconcile(t)
	c := meta.FindStatusCondition(ep.Status.Conditions, v1alpha1.ConditionHealthy)
	if ep.Status.Health != v1alpha1.HealthHealthy || c == nil || c.Status != metav1.ConditionTrue {
		t.Errorf("health %q condition %+v, want Healthy", ep.Status.Health, c)
	}
	if len(notified) == 0 {
		t.Error("no reconcile asked for on the health change")
	}
	pc := meta.FindStatusCondition(ep.Status.Conditions, v1alpha1.ConditionProviderReachable)
	if pc == nil || pc.Status != metav1.ConditionTrue {
		t.Errorf("ProviderReachable %+v, want True", pc)
	}
}

// TestOrphanCollector: an owned instance whose UID has no object is
// deleted; the object's own instance is kept.
func TestOrphanCollector(t *testing.T) {
	f := newFixture(t, nil)
	_, ep := f.reconcile(t)
	if _, err := f.mem.Create(context.Background(), egressproxy.Spec{Name: "orphan-1", UID: "uid-gone"}); err != nil {
		t.Fatal(err)
	}
	gc := NewOrphanCollector(f.r.Entries, f.c, GCOptions{})
	deleted, err := gc.Collect(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(deleted) != 1 || deleted[0] != "mem/orphan-1" {
		t.Errorf("deleted %v, want [mem/orphan-1]", deleted)
	}
	if _, err := f.mem.Get(context.Background(), egressproxy.Ref{Name: ep.Status.Instance, UID: string(ep.UID)}); err != nil {
		t.Errorf("the object's own VM: %v", err)
	}
}

func TestKindReason(t *testing.T) {
	for k, want := range map[health.Kind]string{health.KindAuthRequired: "ProbeAuthRequired", health.KindRefused: "ProbeRefused", health.KindTunnelFailed: "ProbeTunnelFailed"} {
		if got := KindReason(k); got != want {
			t.Errorf("KindReason(%v) = %q, want %q", k, got, want)
		}
	}
}

// A new leader's tracker starts empty: until it has decided a proxy, the
// decision in status about the same address stands, so a failover writes
// no status of a healthy fleet (before, every object went Healthy →
// Unknown → Healthy, two writes and a transition each); a decision of the
// new tracker is written as before, and a proxy at another address is
// Unknown until decided.
func TestNewLeaderKeepsHealth(t *testing.T) {
	f := newFixture(t, &memprovider.Options{ServeProxies: true})
	target := listenTarget(t)
	f.hr.opts.ConnectTarget = target
	f.editSpec(t, func(s *v1alpha1.EgressProxySpec) {
		s.AllowedDestinations = []v1alpha1.Destination{{Ports: portsOf(t, target)}}
	})
	f.reconcile(t)
	for range 2 { // the tracker's default Rise
		f.hr.Round(context.Background())
	}
	_, before := f.reconcile(t)
	if before.Status.Health != v1alpha1.HealthHealthy {
		t.Fatalf("the first leader: health %q, want Healthy", before.Status.Health)
	}
	cond := *meta.FindStatusCondition(before.Status.Conditions, v1alpha1.ConditionHealthy)

	newLeader := func(connectTarget string) *HealthRunnable {
		hr, err := NewHealthRunnable(f.r.Entries, HealthOptions{ConnectTarget: connectTarget})
		if err != nil {
			t.Fatal(err)
		}
		f.hr, f.r.Health = hr, hr
		return hr
	}
	hr := newLeader(target)
	for round := range 3 { // undecided, undecided (one success), decided
		_, ep := f.reconcile(t)
		c := meta.FindStatusCondition(ep.Status.Conditions, v1alpha1.ConditionHealthy)
		if ep.ResourceVersion != before.ResourceVersion || ep.Status.Health != v1alpha1.HealthHealthy || c == nil || *c != cond {
			t.Fatalf("the new leader after %d rounds: resourceVersion %s (was %s), health %q, condition %+v; want no write, Healthy, %+v",
				round, ep.ResourceVersion, before.ResourceVersion, ep.Status.Health, c, cond)
		}
		hr.Round(context.Background())
	}

	// A new leader that finds the proxy broken writes Unhealthy once
	// its tracker decides (Fall: three failed probes).
	hr = newLeader("127.0.0.1:9")
	f.reconcile(t)
	for range 3 {
		hr.Round(context.Background())
	}
	if _, ep := f.reconcile(t); ep.Status.Health != v1alpha1.HealthUnhealthy {
		t.Errorf("the new leader decided the proxy broken: health %q, want Unhealthy", ep.Status.Health)
	}

	// A status about another address is no decision about this proxy.
	newLeader(target)
	var ep v1alpha1.EgressProxy
	if err := f.c.Get(context.Background(), f.key, &ep); err != nil {
		t.Fatal(err)
	}
	ep.Status.Address, ep.Status.Health = "127.0.0.1:1", v1alpha1.HealthHealthy
	meta.SetStatusCondition(&ep.Status.Conditions, cond)
	if err := f.c.Status().Update(context.Background(), &ep); err != nil {
		t.Fatal(err)
	}
	if _, got := f.reconcile(t); got.Status.Health != v1alpha1.HealthUnknown {
		t.Errorf("status of another address: health %q after the reconcile, want Unknown", got.Status.Health)
	}
}
