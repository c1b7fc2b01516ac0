package controller

import (
	"context"
	"errors"
	"maps"
	"regexp"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
	"github.com/egressproxy/egressproxy/health"
	"github.com/egressproxy/egressproxy/memprovider"
)

func credsSecret(uid, user, password string) *corev1.Secret {
	return &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "ns1", Name: "creds", UID: types.UID(uid)},
		Data: map[string][]byte{"username": []byte(user), "password": []byte(password)}}
}

// TestPoolRevision: the revision changes with the template and with the
// contents a proxy reads of the Secrets the template names (credentials,
// TLS, a Secret appearing), and with the Secret's UID (so the label is
// no test of a guessed password without the right to read the Secret);
// it does not change with another key, the Secret's labels or
// annotations, or from one call to the next. A Secret that cannot be read
// is an error that holds none of its data.
func TestPoolRevision(t *testing.T) {
	pool := newPool("p", 3)
	withTLS := pool.DeepCopy()
	withTLS.Spec.Template.TLSSecretRef = &v1alpha1.SecretReference{Name: "tls"}
	tlsSecret := func(cert string) *corev1.Secret {
		return &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "ns1", Name: "tls", UID: "uid-tls"}, Type: corev1.SecretTypeTLS,
			Data: map[string][]byte{SecretKeyTLSCert: []byte(cert), SecretKeyTLSKey: []byte("key")}}
	}
	base := revisionOf(t, pool, credsSecret("u1", "user", "pw1"))
	if !regexp.MustCompile(`^[0-9a-f]{10}$`).MatchString(base) {
		t.Fatalf("revision %q: want ten hex digits (a label value)", base)
	}
	if again := revisionOf(t, pool, credsSecret("u1", "user", "pw1")); again != base {
		t.Errorf("the same pool and Secret: %s, then %s", base, again)
	}
	relabelled := credsSecret("u1", "user", "pw1")
	relabelled.Labels = map[string]string{"team": "a"}
	relabelled.Annotations = map[string]string{"note": "rotated soon"}
	relabelled.Data["comment"] = []byte("not read by the proxy")
	template := pool.DeepCopy()
	template.Spec.Template.MachineType = "large"
	for _, tc := range []struct {
		name string
		pool *v1alpha1.EgressProxyPool
		objs []client.Object
		same bool
	}{
		{"another key, labels and annotations", pool, []client.Object{relabelled}, true},
		{"a new password", pool, []client.Object{credsSecret("u1", "user", "pw2")}, false},
		{"a new user name", pool, []client.Object{credsSecret("u1", "user2", "pw1")}, false},
		{"the Secret made again (another UID)", pool, []client.Object{credsSecret("u2", "user", "pw1")}, false},
		{"the Secret missing", pool, nil, false},
		{"a template change", template, []client.Object{credsSecret("u1", "user", "pw1")}, false},
		{"a TLS Secret named", withTLS, []client.Object{credsSecret("u1", "user", "pw1"), tlsSecret("cert1")}, false},
	} {
		if got := revisionOf(t, tc.pool, tc.objs...); (got == base) != tc.same {
			t.Errorf("%s: revision %s, base %s; want the same: %v", tc.name, got, base, tc.same)
		}
	}
	tls1 := revisionOf(t, withTLS, credsSecret("u1", "user", "pw1"), tlsSecret("cert1"))
	if tls2 := revisionOf(t, withTLS, credsSecret("u1", "user", "pw1"), tlsSecret("cert2")); tls2 == tls1 {
		t.Errorf("a new certificate kept the revision %s", tls1)
	}

	// A Secret that cannot be read: an error naming it, none of its data.
	c := fake.NewClientBuilder().WithScheme(testScheme(t)).WithObjects(credsSecret("u1", "user", "pw1")).
		WithInterceptorFuncs(interceptor.Funcs{Get: func(ctx context.Context, c client.WithWatch, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
			return errors.New("etcdserver: request timed out")
		}}).Build()
	_, err := (&PoolReconciler{APIReader: c}).poolRevision(context.Background(), pool)
	if err == nil || !strings.Contains(err.Error(), "ns1/creds") || strings.Contains(err.Error(), "pw1") {
		t.Errorf("unreadable Secret: %v, want an error naming ns1/creds", err)
	}
}

// stepRollout reconciles f's pool, marks new children Healthy and moves
// the clock by step, until done says the rollout is over (at most 60
// rounds). It returns the fewest ready and most children seen after the
// first round, and the rounds taken.
func (f *poolFixture) stepRollout(t *testing.T, now *time.Time, step time.Duration, done func(p *v1alpha1.EgressProxyPool, kids map[string]*v1alpha1.EgressProxy) bool) (minReady, maxHeld, steps int) {
	t.Helper()
	minReady = -1
	for ; steps < 60; steps++ {
		_, p := f.reconcile(t)
		kids := f.children(t)
		if n := len(f.listed(t)); minReady < 0 || n < minReady {
			minReady = n
		}
		maxHeld = max(maxHeld, len(kids))
		if done(p, kids) {
			return minReady, maxHeld, steps
		}
		f.healAll(t)
		*now = now.Add(step)
	}
	t.Fatalf("not done after %d rounds: spread %v", steps, spread(f.children(t)))
	return
}

// settled reports whether the pool has replicas Healthy children, none
// draining, each passing ok.
func settled(replicas int, ok func(*v1alpha1.EgressProxy) bool) func(*v1alpha1.EgressProxyPool, map[string]*v1alpha1.EgressProxy) bool {
	return func(p *v1alpha1.EgressProxyPool, kids map[string]*v1alpha1.EgressProxy) bool {
		if len(kids) != replicas || p.Status.HealthyReplicas != int32(replicas) {
			return false
		}
		for _, c := range kids {
			if _, draining := c.Annotations[AnnotationDrainingSince]; draining || !ok(c) {
				return false
			}
		}
		return true
	}
}

// A new password in the credentials Secret replaces a pool's children as
// a template change does: a successor of the new revision first, its
// predecessor taken out once the successor is Healthy, never fewer than
// replicas ready, never more than replicas + maxSurge; the template is
// unchanged. A change of a key the proxy does not read replaces nothing.
func TestPoolRollsOutSecretChange(t *testing.T) {
	pool := newPool("p", 3)
	pool.Spec.DrainPeriod = &metav1.Duration{Duration: 10 * time.Second}
	f := newPoolFixture(t, pool, credsSecret("u1", "user", "pw1"))
	now := time.Now()
	f.r.Now = func() time.Time { return now }
	f.reconcile(t)
	f.healAll(t)
	f.reconcile(t)
	old := f.children(t)
	oldRev := revisionOf(t, pool, credsSecret("u1", "user", "pw1"))
	for name, c := range old {
		if c.Labels[LabelPoolRevision] != oldRev {
			t.Fatalf("child %s: revision %q, want the pool's %s", name, c.Labels[LabelPoolRevision], oldRev)
		}
	}
	editSecret := func(edit func(*corev1.Secret)) {
		var s corev1.Secret
		if err := f.c.Get(context.Background(), client.ObjectKey{Namespace: "ns1", Name: "creds"}, &s); err != nil {
			t.Fatal(err)
		}
		edit(&s)
		if err := f.c.Update(context.Background(), &s); err != nil {
			t.Fatal(err)
		}
	}
	editSecret(func(s *corev1.Secret) { s.Data["comment"] = []byte("x") })
	f.reconcile(t)
	if kids := f.children(t); !maps.Equal(spread(kids), spread(old)) || len(kids) != 3 {
		t.Fatalf("a key the proxy does not read changed: spread %v, want %v", spread(kids), spread(old))
	}

	editSecret(func(s *corev1.Secret) { s.Data["password"] = []byte("pw2") })
	newRev := revisionOf(t, pool, credsSecret("u1", "user", "pw2"))
	_, p := f.reconcile(t)
	kids := f.children(t)
	if len(kids) != 4 || len(f.listed(t)) != 3 || p.Status.HealthyReplicas != 3 || condition(p, v1alpha1.ConditionPoolAvailable) != "True/Available" {
		t.Fatalf("right after the change: %d children, %d listed, status %+v; want a successor beside the 3 Healthy, listed, Available",
			len(kids), len(f.listed(t)), p.Status)
	}
	minReady, maxHeld, steps := f.stepRollout(t, &now, 4*time.Second, settled(3, func(c *v1alpha1.EgressProxy) bool {
		return c.Labels[LabelPoolRevision] == newRev
	}))
	for name, c := range f.children(t) {
		if c.Spec.CredentialsSecretRef == nil || c.Spec.CredentialsSecretRef.Name != "creds" || c.Spec.MachineType != "" {
			t.Errorf("child %s: spec %+v, want the unchanged template", name, c.Spec)
		}
	}
	if minReady < 3 || maxHeld > 4 {
		t.Errorf("as few as %d ready (want 3), as many as %d children (want at most 4)", minReady, maxHeld)
	}
	t.Logf("rolled out in %d rounds; at least %d ready, at most %d children", steps, minReady, maxHeld)
}

// A pool's children on entries it no longer selects are moved: a
// successor on a selected entry first, the child taken out once the
// successor is Healthy; until then they stay listed and count as
// available. Whatever made the entry ineligible: spec.entries' names or
// selector changed, the entry's labels changed, or the entry left the
// entries file.
func TestPoolMovesOffUnselectedEntries(t *testing.T) {
	for _, tc := range []struct {
		name  string
		start v1alpha1.PoolEntries
		edit  func(f *poolFixture, p *v1alpha1.EgressProxyPool)
		want  map[string]int
	}{
		{"names changed", v1alpha1.PoolEntries{Names: []string{"a", "b"}},
			func(_ *poolFixture, p *v1alpha1.EgressProxyPool) { p.Spec.Entries.Names = []string{"c"} }, map[string]int{"c": 4}},
		{"selector changed", v1alpha1.PoolEntries{Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"zone": "x"}}},
			func(_ *poolFixture, p *v1alpha1.EgressProxyPool) { p.Spec.Entries.Selector.MatchLabels["zone"] = "y" }, map[string]int{"c": 4}},
		{"an entry's labels changed", v1alpha1.PoolEntries{Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"zone": "x"}}},
			func(f *poolFixture, _ *v1alpha1.EgressProxyPool) {
				f.r.EntryLabels["b"] = map[string]string{"zone": "y"}
			}, map[string]int{"a": 4}},
		{"an entry left the entries file", v1alpha1.PoolEntries{Names: []string{"a", "b"}},
			func(f *poolFixture, _ *v1alpha1.EgressProxyPool) {
				f.r.Entries = map[string]*egressproxy.Client{"a": f.ents["a"], "c": f.ents["c"]}
			}, map[string]int{"a": 4}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pool := newPool("p", 4)
			pool.Spec.Entries = tc.start
			pool.Spec.DrainPeriod = &metav1.Duration{Duration: 10 * time.Second}
			f := newPoolFixture(t, pool)
			now := time.Now()
			f.settle(t, &now)
			before := spread(f.children(t))
			if before["c"] != 0 || before["a"]+before["b"] != 4 {
				t.Fatalf("before: spread %v, want 4 on a and b", before)
			}
			var cur v1alpha1.EgressProxyPool
			if err := f.c.Get(context.Background(), f.key, &cur); err != nil {
				t.Fatal(err)
			}
			tc.edit(f, &cur)
			if err := f.c.Update(context.Background(), &cur); err != nil {
				t.Fatal(err)
			}
			_, p := f.reconcile(t)
			if n := len(f.children(t)); n != 5 || len(f.listed(t)) != 4 || p.Status.HealthyReplicas != 4 ||
				condition(p, v1alpha1.ConditionPoolAvailable) != "True/Available" {
				t.Fatalf("right after the change: %d children, %d listed, status %+v; want one successor, the 4 listed and Available",
					n, len(f.listed(t)), p.Status)
			}
			minReady, maxHeld, steps := f.stepRollout(t, &now, 4*time.Second, settled(4, func(*v1alpha1.EgressProxy) bool { return true }))
			if got := spread(f.children(t)); !maps.Equal(got, tc.want) {
				t.Errorf("after the move: spread %v, want %v", got, tc.want)
			}
			if minReady < 4 || maxHeld > 5 {
				t.Errorf("as few as %d ready (want 4), as many as %d children (want at most 5)", minReady, maxHeld)
			}
			t.Logf("moved in %d rounds; at least %d ready, at most %d children", steps, minReady, maxHeld)
		})
	}
}

// A child made before pools had revisions (no revision label) is
// replaced once, one surge at a time.
func TestPoolReplacesChildWithoutRevision(t *testing.T) {
	pool := newPool("p", 1)
	pool.Spec.DrainPeriod = &metav1.Duration{Duration: 10 * time.Second}
	f := newPoolFixture(t, pool)
	now := time.Now()
	f.r.Now = func() time.Time { return now }
	f.reconcile(t)
	f.healAll(t)
	var ep v1alpha1.EgressProxy
	if err := f.c.Get(context.Background(), client.ObjectKey{Namespace: "ns1", Name: "p-0"}, &ep); err != nil {
		t.Fatal(err)
	}
	delete(ep.Labels, LabelPoolRevision)
	if err := f.c.Update(context.Background(), &ep); err != nil {
		t.Fatal(err)
	}
	rev := revisionOf(t, pool)
	minReady, _, _ := f.stepRollout(t, &now, 4*time.Second, settled(1, func(c *v1alpha1.EgressProxy) bool {
		return c.Labels[LabelPoolRevision] == rev && c.Name != "p-0"
	}))
	if minReady < 1 {
		t.Errorf("as few as %d ready, want 1", minReady)
	}
}

// secretChangeFixture is a reconciler fixture whose object (a pool's
// child when pooled) runs a served memory proxy, Healthy through the
// health runnable's probes with its Secret's credentials ("u1", "p1");
// the Secret's password is then changed to "p2" and the object
// reconciled once. It returns the fixture, the probes' target, the object
// and its VM before the change.
func secretChangeFixture(t *testing.T, pooled bool) (*fixture, string, *v1alpha1.EgressProxy, egressproxy.Instance) {
	t.Helper()
	f := newFixture(t, &memprovider.Options{ServeProxies: true})
	target := listenTarget(t)
	f.hr.opts.ConnectTarget = target
	f.editSpec(t, func(s *v1alpha1.EgressProxySpec) {
		s.AllowedDestinations = []v1alpha1.Destination{{Ports: portsOf(t, target)}}
	})
	if pooled {
		var ep v1alpha1.EgressProxy
		if err := f.c.Get(context.Background(), f.key, &ep); err != nil {
			t.Fatal(err)
		}
		yes := true
		ep.OwnerReferences = []metav1.OwnerReference{{APIVersion: v1alpha1.GroupVersion.String(), Kind: "EgressProxyPool", Name: "p", UID: "uid-p", Controller: &yes}}
		if err := f.c.Update(context.Background(), &ep); err != nil {
			t.Fatal(err)
		}
	}
	f.reconcile(t)
	for range 2 { // the tracker's default Rise
		f.hr.Round(context.Background())
	}
	_, ep := f.reconcile(t)
	if ep.Status.Health != v1alpha1.HealthHealthy {
		t.Fatalf("before the change: health %q, want Healthy", ep.Status.Health)
	}
	first, err := f.mem.Get(context.Background(), egressproxy.Ref{Name: ep.Status.Instance, UID: string(ep.UID)})
	if err != nil {
		t.Fatal(err)
	}
	var sec corev1.Secret
	if err := f.c.Get(context.Background(), f.keyOf("creds"), &sec); err != nil {
		t.Fatal(err)
	}
	sec.Data["password"] = []byte("p2")
	if err := f.c.Update(context.Background(), &sec); err != nil {
		t.Fatal(err)
	}
	_, ep = f.reconcile(t)
	return f, target, ep, first
}

// The EgressProxy reconciler recreates a standalone object's VM in place
// when its credentials Secret changes, as before.
func TestSecretChangeRecreatesStandalone(t *testing.T) {
	f, _, ep, first := secretChangeFixture(t, false)
	if readyReason(ep) != ReasonRecreating {
		t.Fatalf("Ready reason %q, want Recreating", readyReason(ep))
	}
	if _, err := f.mem.Get(context.Background(), egressproxy.Ref{Name: first.Name, UID: string(ep.UID)}); egressproxy.Code(err) != egressproxy.NotFound {
		t.Errorf("the old VM: %v, want deleted", err)
	}
}

// The EgressProxy reconciler keeps a pool's child's VM when its Secret
// changes, which its pool replaces: the VM stays with its spec digest,
// Ready True with reason Superseded, and its probes keep the credentials
// it was registered with, so it stays Healthy through real CONNECTs that
// the new password would not pass.
func TestSecretChangeKeepsPoolChild(t *testing.T) {
	f, target, ep, first := secretChangeFixture(t, true)
	inst, err := f.mem.Get(context.Background(), egressproxy.Ref{Name: first.Name, UID: string(ep.UID)})
	if err != nil || inst.SpecDigest != first.SpecDigest || inst.Address() != first.Address() {
		t.Fatalf("the VM %+v, %v; want the first one kept", inst, err)
	}
	c := meta.FindStatusCondition(ep.Status.Conditions, v1alpha1.ConditionReady)
	if c == nil || c.Status != metav1.ConditionTrue || c.Reason != ReasonSuperseded || strings.Contains(c.Message, "p2") {
		t.Errorf("Ready %+v, want True/Superseded", c)
	}
	if ep.Status.SpecDigest != first.SpecDigest || ep.Status.Phase != v1alpha1.PhaseRunning {
		t.Errorf("status digest %s phase %s, want the VM's %s and Running", ep.Status.SpecDigest, ep.Status.Phase, first.SpecDigest)
	}
	for range 4 { // more than the tracker's default Fall
		f.hr.Round(context.Background())
	}
	_, ep = f.reconcile(t)
	if ep.Status.Health != v1alpha1.HealthHealthy {
		t.Errorf("after probe rounds: health %q, want Healthy (probed with the credentials it was made with)", ep.Status.Health)
	}
	// The VM really refuses the new password.
	if r := health.Probe(context.Background(), ep.Status.Address, target, &health.ProbeOptions{Username: "u1", Password: "p2", Timeout: 2 * time.Second}); r.OK {
		t.Error("the kept VM accepted the new password: the test proves nothing")
	}
}
