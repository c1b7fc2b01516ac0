//go:build integration

package operator_test

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	"github.com/go-logr/logr/testr"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
	"github.com/egressproxy/egressproxy/examples/operator/controller"
	"github.com/egressproxy/egressproxy/health"
	"github.com/egressproxy/egressproxy/memprovider"
)

// poolEnv is a real kube-apiserver and etcd with the operator's
// controllers running in this process over three memory entries.
type poolEnv struct {
	env      *envtest.Environment
	c        client.Client
	op       client.Client // the operator's user's
	restCfg  *rest.Config  // the admin's
	entries  map[string]*egressproxy.Client
	controls map[string]*memprovider.Control
	target   string // the probes' CONNECT target
	ns       string // the pools' namespace, with the Secret "creds"
	interval time.Duration
	drain    time.Duration // the pools' drain period
}

// startPoolEnv starts the control plane with the CRDs and the operator's
// controllers, as the operator's user with config/rbac's ClusterRole (it
// must allow everything they do), with a health interval of one second,
// over three memory entries (mem-a, mem-b, mem-c) whose proxies are real
// CONNECT proxies on loopback.
func startPoolEnv(t *testing.T) *poolEnv { return startPoolEnvWith(t, poolEnvOptions{}) }

// poolEnvOptions are what startPoolEnvWith changes from startPoolEnv.
type poolEnvOptions struct {
	// entries the controllers use, closed when the test ends (nil: the
	// three memory entries).
	entries map[string]*egressproxy.Client
	// target is the probes' CONNECT target ("": one on loopback).
	target string
	// probeTimeout is each probe's (zero: 2 s).
	probeTimeout time.Duration
	// proxyAddress is where the memory entries' proxies listen (zero:
	// 127.0.0.1, memprovider's default).
	proxyAddress netip.Addr
	// controlPlane changes the control plane's environment before it
	// starts (nil: no change).
	controlPlane func(*envtest.Environment)
}

// startPoolEnvWith is startPoolEnv over o's entries and target.
func startPoolEnvWith(t *testing.T, o poolEnvOptions) *poolEnv {
	assets := controlPlaneAssets(t)
	// The manager and the controllers log to this test; what logs
	// through controller-runtime's global logger, which only its first
	// SetLogger sets for the whole process (-count=3 runs several tests
	// in one), goes to stderr instead of to a test that may have ended.
	log := testr.NewWithOptions(t, testr.Options{Verbosity: 0})
	logf.SetLogger(funcr.New(func(prefix, args string) { fmt.Fprintln(os.Stderr, prefix, args) }, funcr.Options{}))

	var configure []func(*envtest.Environment)
	if o.controlPlane != nil {
		configure = append(configure, o.controlPlane)
	}
	env, restCfg, c := startControlPlane(t, assets, configure...)
	ctx := context.Background()
	pe := &poolEnv{env: env, c: c, restCfg: restCfg, ns: "pools", entries: map[string]*egressproxy.Client{}, controls: map[string]*memprovider.Control{}, interval: time.Second, drain: time.Second}
	for _, name := range []string{operatorNS, pe.ns} {
		if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: pe.ns, Name: "creds"},
		Data: map[string][]byte{"username": []byte("pool-user"), "password": []byte("pool-password")}}); err != nil {
		t.Fatal(err)
	}
	pe.target = o.target
	if pe.target == "" {
		pe.target = acceptingTarget(t)
	}

	opCfg, err := clientcmd.BuildConfigFromFlags("", operatorKubeconfig(t, ctx, env, c))
	if err != nil {
		t.Fatal(err)
	}
	if pe.op, err = client.New(opCfg, client.Options{Scheme: c.Scheme()}); err != nil {
		t.Fatal(err)
	}
	if o.entries != nil {
		pe.entries = o.entries
	} else {
		for _, name := range []string{"mem-a", "mem-b", "mem-c"} {
			m := memprovider.New(&memprovider.Options{ServeProxies: true, ProxyAddress: o.proxyAddress, Logger: log.WithName(name)})
			var ctl *memprovider.Control
			m.As(&ctl)
			pe.entries[name], pe.controls[name] = m, ctl
		}
	}
	mopts := controller.ManagerOptions(operatorNS)
	mopts.Scheme = c.Scheme()
	mopts.Metrics = metricsserver.Options{BindAddress: "0"}
	mopts.Logger = log
	// Each test (and each -count) has a manager of its own in this
	// process: the controllers' names repeat.
	skip := true
	mopts.Controller.SkipNameValidation = &skip
	mgr, err := ctrl.NewManager(opCfg, mopts)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := controller.Setup(mgr, controller.Config{
		Entries: pe.entries,
		// A short backoff: a child whose finalizer failed while its
		// entry was unreachable is retried soon after it is back.
		Reconciler: controller.Options{PollInterval: pe.interval, BackoffMax: 2 * time.Second},
		Health:     controller.HealthOptions{Interval: pe.interval, ConnectTarget: pe.target, Probe: health.ProbeOptions{Timeout: cmp.Or(o.probeTimeout, 2*time.Second)}},
		Logger:     log,
	}); err != nil {
		t.Fatal(err)
	}
	mctx, stop := context.WithCancel(ctx)
	stopped := make(chan error, 1)
	go func() { stopped <- mgr.Start(mctx) }()
	t.Cleanup(func() {
		stop()
		if err := <-stopped; err != nil {
			t.Errorf("manager: %v", err)
		}
		if err := controller.CloseEntries(pe.entries); err != nil {
			t.Errorf("close entries: %v", err)
		}
	})
	return pe
}

// createPool creates a pool of replicas whose children allow the probes'
// target.
func (pe *poolEnv) createPool(t *testing.T, name string, replicas int32, grace time.Duration, edit ...func(*v1alpha1.EgressProxyPool)) *v1alpha1.EgressProxyPool {
	t.Helper()
	_, targetPort, _ := net.SplitHostPort(pe.target)
	port, _ := strconv.Atoi(targetPort)
	pool := &v1alpha1.EgressProxyPool{
		ObjectMeta: metav1.ObjectMeta{Namespace: pe.ns, Name: name},
		Spec: v1alpha1.EgressProxyPoolSpec{Replicas: replicas, Template: v1alpha1.ProxyTemplate{
			CredentialsSecretRef: &v1alpha1.SecretReference{Name: "creds"},
			AllowedDestinations:  []v1alpha1.Destination{{Ports: []int32{int32(port)}}},
		}},
	}
	if grace > 0 {
		pool.Spec.UnhealthyGrace = &metav1.Duration{Duration: grace}
	}
	// A short drain: a child taken out is listed as terminating for a
	// second, then deleted.
	pool.Spec.DrainPeriod = &metav1.Duration{Duration: pe.drain}
	for _, e := range edit {
		e(pool)
	}
	if err := pe.c.Create(context.Background(), pool); err != nil {
		t.Fatal(err)
	}
	return pool
}

// instances is how many instances each entry holds.
func (pe *poolEnv) instances(ctx context.Context) (map[string]int, error) {
	out := map[string]int{}
	for name, e := range pe.entries {
		l, err := e.List(ctx)
		if err != nil {
			return nil, fmt.Errorf("list %s: %w", name, err)
		}
		out[name] = len(l)
	}
	return out, nil
}

// deletePool deletes the pool and then its children (no garbage
// collector runs here), and waits until their finalizers, which run in
// the manager, have deleted every VM.
func (pe *poolEnv) deletePool(t *testing.T, pool *v1alpha1.EgressProxyPool) {
	t.Helper()
	ctx := context.Background()
	if err := pe.c.Delete(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if err := pe.c.DeleteAllOf(ctx, &v1alpha1.EgressProxy{}, client.InNamespace(pe.ns)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 2*time.Minute, "the children and their VMs deleted", func() string {
		var l v1alpha1.EgressProxyList
		if err := pe.c.List(ctx, &l, client.InNamespace(pe.ns)); err != nil {
			return err.Error()
		}
		if len(l.Items) != 0 {
			return fmt.Sprintf("%d children left", len(l.Items))
		}
		n, err := pe.instances(ctx)
		if err != nil {
			return err.Error()
		}
		if total := slices.Collect(maps.Values(n)); slices.Max(append(total, 0)) != 0 {
			return fmt.Sprintf("instances left: %v", n)
		}
		return ""
	})
}

// TestPoolOnMemoryEntries: a pool of 6 is spread 2/2/2, every child turns
// Healthy through the health runnable's CONNECT probes, and the pool's
// EndpointSlices list exactly the children's addresses, each of which
// tunnels a CONNECT of this test's; scaled to 4, the spread stays within
// one, the slices shrink to the 4 left and the VMs of the children
// removed are gone from their entries.
func TestPoolOnMemoryEntries(t *testing.T) {
	pe := startPoolEnv(t)
	ctx := context.Background()
	c := pe.c
	// The pool's name is its Service's: the CRD refuses one that is no
	// DNS-1035 label.
	bad := &v1alpha1.EgressProxyPool{ObjectMeta: metav1.ObjectMeta{Namespace: pe.ns, Name: "9-lives"}, Spec: v1alpha1.EgressProxyPoolSpec{Replicas: 1}}
	if err := c.Create(ctx, bad); !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), "DNS-1035 label") {
		t.Errorf("create a pool named 9-lives: %v, want Invalid naming the rule", err)
	}
	pool := pe.createPool(t, "egress", 6, 0)
	if pool.Spec.MaxSurge != 1 {
		t.Errorf("spec.maxSurge %d as stored, want the CRD's default 1", pool.Spec.MaxSurge)
	}
	key := client.ObjectKeyFromObject(pool)

	t1 := time.Now()
	var kids []v1alpha1.EgressProxy
	waitFor(t, 2*time.Minute, "a pool of 6, 2/2/2, every child Healthy and listed", func() string {
		var msg string
		kids, msg = poolState(ctx, c, key, 6, map[string]int{"mem-a": 2, "mem-b": 2, "mem-c": 2})
		return msg
	})
	t.Logf("6 children Healthy and listed %v after the pool's create", time.Since(t1).Round(time.Millisecond))
	var want []string
	for _, k := range kids {
		r := health.Probe(ctx, k.Status.Address, pe.target, &health.ProbeOptions{Username: "pool-user", Password: "pool-password", Timeout: 5 * time.Second})
		if !r.OK {
			t.Errorf("CONNECT through %s (%s) to %s: %v", k.Name, k.Status.Address, pe.target, r.Err)
		}
		want = append(want, listedForm(t, k.Status.Address))
	}
	slices.Sort(want)

	// The discovery endpoint, as the operator's user reads the slices
	// (every namespace), lists the same 6.
	srv := httptest.NewServer(controller.DiscoveryHandler(pe.op, logr.Discard()))
	defer srv.Close()
	resp, err := http.Get(srv.URL + controller.DiscoveryPath)
	if err != nil {
		t.Fatal(err)
	}
	var d controller.Discovery
	err = json.NewDecoder(resp.Body).Decode(&d)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s, %v", controller.DiscoveryPath, resp.Status, err)
	}
	if len(d.Pools) != 1 || d.Pools[0].Name != "egress" || d.Pools[0].Service != "egress" || !slices.Equal(d.Pools[0].Endpoints, want) {
		t.Errorf("GET %s = %+v, want pool egress at %v", controller.DiscoveryPath, d.Pools, want)
	}
	var svc corev1.Service
	if err := c.Get(ctx, key, &svc); err != nil {
		t.Fatalf("the pool's Service: %v", err)
	}
	if len(svc.Spec.Selector) != 0 || svc.Spec.ClusterIP == "" || len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Port != 3128 {
		t.Errorf("Service %+v: want selector-less, a ClusterIP, port 3128", svc.Spec)
	}
	var stored v1alpha1.EgressProxyPool
	if err := c.Get(ctx, key, &stored); err != nil {
		t.Fatal(err)
	}
	t.Logf("pool status: %+v", stored.Status)
	table, rows := resourceTable(t, pe.restCfg, "/apis/egressproxy.dev/v1alpha1/namespaces/"+pe.ns+"/egressproxypools")
	t.Logf("kubectl get egressproxypools:\n%s", table)
	if r := rows["egress"]; r["Desired"] != "6" || r["Created"] != "6" || r["Healthy"] != "6" || r["Age"] == "<none>" {
		t.Errorf("the pool's printer columns: %v, want Desired, Created and Healthy 6 and an Age", r)
	}

	// Scale to 4.
	stored.Spec.Replicas = 4
	if err := c.Update(ctx, &stored); err != nil {
		t.Fatal(err)
	}
	t2 := time.Now()
	waitFor(t, time.Minute, "the pool scaled to 4, spread within one, the slices shrunk", func() string {
		_, msg := poolState(ctx, c, key, 4, nil)
		if msg != "" {
			return msg
		}
		n, err := pe.instances(ctx)
		if err != nil {
			return err.Error()
		}
		if n["mem-a"]+n["mem-b"]+n["mem-c"] != 4 {
			return fmt.Sprintf("instances %v, want 4 in all", n)
		}
		return ""
	})
	t.Logf("scaled to 4 in %v", time.Since(t2).Round(time.Millisecond))
	pe.deletePool(t, &stored)
}

// poolState says what is missing for the pool key to hold want children
// not being deleted (spread as spread says, or within one of each other
// when spread is nil), every one Healthy with an address, its status
// saying so, and its EndpointSlices listing exactly their addresses (""
// when nothing is). It returns those children.
func poolState(ctx context.Context, c client.Client, key client.ObjectKey, want int, spread map[string]int) ([]v1alpha1.EgressProxy, string) {
	var l v1alpha1.EgressProxyList
	if err := c.List(ctx, &l, client.InNamespace(key.Namespace), client.MatchingLabels{controller.LabelPool: key.Name}); err != nil {
		return nil, err.Error()
	}
	var kids []v1alpha1.EgressProxy
	got := map[string]int{}
	var addrs []string
	for _, k := range l.Items {
		if !k.DeletionTimestamp.IsZero() {
			continue // not the pool's any more; must not be listed
		}
		if k.Status.Health != v1alpha1.HealthHealthy || k.Status.Address == "" {
			return nil, fmt.Sprintf("child %s: health %q, address %q", k.Name, k.Status.Health, k.Status.Address)
		}
		kids = append(kids, k)
		got[k.Spec.Provider]++
		ap, err := netip.ParseAddrPort(k.Status.Address)
		if err != nil {
			return nil, fmt.Sprintf("child %s: address %q: %v", k.Name, k.Status.Address, err)
		}
		_, a := controller.EndpointAddress(ap)
		addrs = append(addrs, net.JoinHostPort(a, strconv.Itoa(int(ap.Port()))))
	}
	if len(kids) != want {
		return nil, fmt.Sprintf("%d children, want %d", len(kids), want)
	}
	if spread != nil && !maps.Equal(got, spread) {
		return nil, fmt.Sprintf("spread %v, want %v", got, spread)
	}
	if n := slices.Collect(maps.Values(got)); len(got) > 0 && slices.Max(n)-slices.Min(n) > 1 {
		return nil, fmt.Sprintf("spread %v: more than one apart", got)
	}
	var slicesList discoveryv1.EndpointSliceList
	if err := c.List(ctx, &slicesList, client.InNamespace(key.Namespace), client.MatchingLabels{discoveryv1.LabelServiceName: key.Name}); err != nil {
		return nil, err.Error()
	}
	var listed []string
	for _, s := range slicesList.Items {
		if s.Labels[discoveryv1.LabelManagedBy] != controller.ManagedBy {
			return nil, fmt.Sprintf("slice %s managed by %q", s.Name, s.Labels[discoveryv1.LabelManagedBy])
		}
		for _, e := range s.Endpoints {
			for _, a := range e.Addresses {
				listed = append(listed, net.JoinHostPort(a, strconv.Itoa(int(*s.Ports[0].Port))))
			}
		}
	}
	slices.Sort(addrs)
	slices.Sort(listed)
	if !slices.Equal(addrs, listed) {
		return nil, fmt.Sprintf("the slices list %v, the children are at %v", listed, addrs)
	}
	var p v1alpha1.EgressProxyPool
	if err := c.Get(ctx, key, &p); err != nil {
		return nil, err.Error()
	}
	if p.Status.HealthyReplicas != int32(want) || p.Status.CreatedReplicas != int32(want) || p.Status.ServiceName != key.Name {
		return nil, fmt.Sprintf("pool status %+v", p.Status)
	}
	return kids, ""
}

// acceptingTarget is a CONNECT target on loopback that accepts
// connections (and closes them) until the test ends.
func acceptingTarget(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				if !errors.Is(err, net.ErrClosed) {
					t.Errorf("accept: %v", err)
				}
				return
			}
			c.Close()
		}
	}()
	t.Cleanup(func() { ln.Close(); <-done })
	return ln.Addr().String()
}

// sliceSample is what the pool's EndpointSlices listed at one moment.
type sliceSample struct {
	at     time.Time
	listed []string // host:port, as EndpointAddress writes them
	ready  []string // those listed as ready
}

// watchSlices reads the pool key's EndpointSlices every 100 ms, as a
// client re-reading its endpoints would, until the returned function is
// called; that returns what it saw.
func watchSlices(c client.Client, key client.ObjectKey) func() []sliceSample {
	return sampleEvery(100*time.Millisecond, func() (sliceSample, bool) {
		var l discoveryv1.EndpointSliceList
		if err := c.List(context.Background(), &l, client.InNamespace(key.Namespace), client.MatchingLabels{discoveryv1.LabelServiceName: key.Name}); err != nil {
			return sliceSample{}, false
		}
		smp := sliceSample{at: time.Now()}
		for _, s := range l.Items {
			for _, e := range s.Endpoints {
				for _, a := range e.Addresses {
					hp := net.JoinHostPort(a, strconv.Itoa(int(*s.Ports[0].Port)))
					smp.listed = append(smp.listed, hp)
					if e.Conditions.Ready != nil && *e.Conditions.Ready {
						smp.ready = append(smp.ready, hp)
					}
				}
			}
		}
		return smp, true
	})
}

// sampleEvery calls sample every period on a goroutine of its own until
// the returned function is called, which ends it and returns the samples
// sample gave (those it said ok to).
func sampleEvery[T any](period time.Duration, sample func() (T, bool)) func() []T {
	done := make(chan struct{})
	out := make(chan []T, 1)
	go func() {
		var samples []T
		tick := time.NewTicker(period)
		defer tick.Stop()
		for {
			select {
			case <-done:
				out <- samples
				return
			case <-tick.C:
			}
			if smp, ok := sample(); ok {
				samples = append(samples, smp)
			}
		}
	}()
	return func() []T { close(done); return <-out }
}

// listedForm is how the slices list a child at addr.
func listedForm(t *testing.T, addr string) string {
	t.Helper()
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	_, a := controller.EndpointAddress(ap)
	return net.JoinHostPort(a, strconv.Itoa(int(ap.Port())))
}

// TestPoolSelfHealsOnMemoryEntries: a pool of 6 (grace 5 s) on three
// memory entries; mem-c is made unreachable (its Check, Get, Create,
// Delete and List fail) and its proxies silent. The slices stop listing a
// silent proxy within the tracker's fall threshold; 6 children are
// Healthy again on mem-a and mem-b (3/3) within grace + 10 s; the lost
// children are deleted only after their replacements are Healthy, and
// their VMs stay until mem-c answers again, when their finalizers delete
// them. Then the pool surges back to 2/2/2, never listing fewer than 6
// on the way.
func TestPoolSelfHealsOnMemoryEntries(t *testing.T) {
	pe := startPoolEnv(t)
	ctx := context.Background()
	const grace = 5 * time.Second
	pool := pe.createPool(t, "heal", 6, grace)
	key := client.ObjectKeyFromObject(pool)
	var kids []v1alpha1.EgressProxy
	waitFor(t, 2*time.Minute, "a pool of 6, 2/2/2, every child Healthy and listed", func() string {
		var msg string
		kids, msg = poolState(ctx, pe.c, key, 6, map[string]int{"mem-a": 2, "mem-b": 2, "mem-c": 2})
		return msg
	})
	stopWatch := watchSlices(pe.c, key)

	// mem-c's proxies go silent (a stopped VM closes its port), then
	// mem-c stops answering.
	mc, ctl := pe.entries["mem-c"], pe.controls["mem-c"]
	silent := map[string]bool{}
	for _, k := range kids {
		if k.Spec.Provider != "mem-c" {
			continue
		}
		ref := egressproxy.Ref{Name: k.Status.Instance, UID: string(k.UID)}
		if err := ctl.SetState(ref, egressproxy.StateStopped); err != nil {
			t.Fatal(err)
		}
		if inst, err := mc.Get(ctx, ref); err != nil || inst.State != egressproxy.StateStopped {
			t.Fatalf("stopping %s: %+v, %v", k.Name, inst, err)
		}
		silent[listedForm(t, k.Status.Address)] = true
	}
	for _, op := range []memprovider.Op{memprovider.OpCheck, memprovider.OpGet, memprovider.OpCreate, memprovider.OpDelete, memprovider.OpList} {
		ctl.InjectFault(op, memprovider.Fault{Code: egressproxy.Transient})
	}
	tFault := time.Now()
	waitFor(t, time.Minute+grace, "6 Healthy children on mem-a and mem-b", func() string {
		_, msg := poolState(ctx, pe.c, key, 6, map[string]int{"mem-a": 3, "mem-b": 3})
		return msg
	})
	healed := time.Since(tFault)
	t.Logf("6 Healthy and listed on mem-a and mem-b %v after mem-c went silent (grace %v)", healed.Round(time.Millisecond), grace)
	if healed > grace+10*time.Second {
		t.Errorf("healed after %v, want within grace + 10 s (%v)", healed.Round(time.Millisecond), grace+10*time.Second)
	}
	var l v1alpha1.EgressProxyList
	if err := pe.c.List(ctx, &l, client.InNamespace(pe.ns)); err != nil {
		t.Fatal(err)
	}
	deleting := 0
	for _, k := range l.Items {
		if !k.DeletionTimestamp.IsZero() {
			deleting++
			if k.Spec.Provider != "mem-c" {
				t.Errorf("child %s on %s is being deleted", k.Name, k.Spec.Provider)
			}
		}
	}
	if deleting != 2 {
		t.Errorf("%d children being deleted, want mem-c's 2 (their finalizers wait for mem-c)", deleting)
	}

	// mem-c answers again: its old VMs are deleted by their children's
	// finalizers, and the pool surges back to 2/2/2.
	ctl.ClearFaults()
	tBack := time.Now()
	waitFor(t, 2*time.Minute, "2/2/2 again, the old VMs gone", func() string {
		_, msg := poolState(ctx, pe.c, key, 6, map[string]int{"mem-a": 2, "mem-b": 2, "mem-c": 2})
		if msg != "" {
			return msg
		}
		var l v1alpha1.EgressProxyList
		if err := pe.c.List(ctx, &l, client.InNamespace(pe.ns)); err != nil {
			return err.Error()
		}
		if len(l.Items) != 6 {
			return fmt.Sprintf("%d children, want 6 (none being deleted)", len(l.Items))
		}
		n, err := pe.instances(ctx)
		if err != nil {
			return err.Error()
		}
		if !maps.Equal(n, map[string]int{"mem-a": 2, "mem-b": 2, "mem-c": 2}) {
			return fmt.Sprintf("instances %v", n)
		}
		return ""
	})
	t.Logf("2/2/2 again, the old VMs deleted, %v after mem-c answered again", time.Since(tBack).Round(time.Millisecond))
	samples := stopWatch()

	fall := 3 // health.TrackerOptions.Fall's default
	allowed := time.Duration(fall+1)*pe.interval + 2*time.Second
	lastSilent := time.Time{}
	minAfterBack := -1
	for _, smp := range samples {
		for _, a := range smp.listed {
			if silent[a] && smp.at.After(lastSilent) {
				lastSilent = smp.at
			}
		}
		if smp.at.After(tBack) && (minAfterBack < 0 || len(smp.ready) < minAfterBack) {
			minAfterBack = len(smp.ready)
		}
	}
	if d := lastSilent.Sub(tFault); d > allowed {
		t.Errorf("a silent proxy was listed %v after it went silent, want within %v (fall %d × %v, a round and a reconcile)", d.Round(time.Millisecond), allowed, fall, pe.interval)
	} else {
		t.Logf("the silent proxies were last listed %v after they went silent (allowed %v); %d samples", max(d, 0).Round(time.Millisecond), allowed, len(samples))
	}
	if minAfterBack < 6 {
		t.Errorf("after mem-c was back the slices listed as few as %d ready, want at least 6 throughout", minAfterBack)
	}
	pe.deletePool(t, pool)
}

// dialable is the host:port a client dials for an endpoint as the slices
// list it: a name under localhost that is an IP address ("127.0.0.1" of
// "127.0.0.1.localhost") is that address (RFC 6761).
func dialable(hp string) string {
	host, port, _ := net.SplitHostPort(hp)
	if ip, ok := strings.CutSuffix(host, ".localhost"); ok {
		if _, err := netip.ParseAddr(ip); err == nil {
			host = ip
		}
	}
	return net.JoinHostPort(host, port)
}

// connectClient sends CONNECTs, about every 40 ms, each through the next
// of the endpoints the pool key's EndpointSlices list as ready, which it
// re-reads every second (as kube-proxy would), until the returned
// function is called; that returns how many were sent and which failed.
func connectClient(c client.Client, key client.ObjectKey, target string) func() (int, []string) {
	done := make(chan struct{})
	type result struct {
		sent   int
		failed []string
	}
	out := make(chan result, 1)
	go func() {
		var res result
		var eps []string
		var read time.Time
		tick := time.NewTicker(40 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-done:
				out <- res
				return
			case <-tick.C:
			}
			if time.Since(read) >= time.Second {
				var l discoveryv1.EndpointSliceList
				if err := c.List(context.Background(), &l, client.InNamespace(key.Namespace), client.MatchingLabels{discoveryv1.LabelServiceName: key.Name}); err == nil {
					eps = eps[:0]
					for _, s := range l.Items {
						for _, e := range s.Endpoints {
							if e.Conditions.Ready != nil && *e.Conditions.Ready {
								eps = append(eps, dialable(net.JoinHostPort(e.Addresses[0], strconv.Itoa(int(*s.Ports[0].Port)))))
							}
						}
					}
					read = time.Now()
				}
			}
			if len(eps) == 0 {
				continue
			}
			ep := eps[i%len(eps)]
			res.sent++
			if r := health.Probe(context.Background(), ep, target, &health.ProbeOptions{Username: "pool-user", Password: "pool-password", Timeout: 2 * time.Second}); !r.OK {
				res.failed = append(res.failed, fmt.Sprintf("%s: %v", ep, r.Err))
			}
		}
	}()
	return func() (int, []string) { close(done); r := <-out; return r.sent, r.failed }
}

// TestPoolRollsOutOnMemoryEntries: a template change (the machine type,
// which keeps the client's contract) replaces a pool of 6 one surge at a
// time (maxSurge 1, maxUnavailable 0, drain 3 s) while a client sends
// CONNECTs at 25/s through the endpoints it re-reads from the
// EndpointSlices every second: no CONNECT fails, and a watcher reading
// the slices every 100 ms never sees fewer than 6 ready.
func TestPoolRollsOutOnMemoryEntries(t *testing.T) {
	pe := startPoolEnv(t)
	rollOut(t, pe, "roll", func(key client.ObjectKey) func() (int, []string) {
		return connectClient(pe.c, key, pe.target)
	})
}

// rollOut creates a pool of 6 named name (drain 3 s), waits until it is
// 2/2/2 and Healthy, starts the client startClient returns for it and a
// watcher of its slices, changes the template's machine type and waits
// until every child is of the new template; it fails t if a CONNECT of
// the client failed, the client sent fewer than 20/s, or the watcher saw
// fewer than 6 ready. Then it deletes the pool.
func rollOut(t *testing.T, pe *poolEnv, name string, startClient func(client.ObjectKey) func() (int, []string)) {
	t.Helper()
	pe.drain = 3 * time.Second // longer than the client's re-read
	ctx := context.Background()
	pool := pe.createPool(t, name, 6, 0)
	key := client.ObjectKeyFromObject(pool)
	waitFor(t, 2*time.Minute, "a pool of 6, 2/2/2, every child Healthy and listed", func() string {
		_, msg := poolState(ctx, pe.c, key, 6, map[string]int{"mem-a": 2, "mem-b": 2, "mem-c": 2})
		return msg
	})
	stopWatch := watchSlices(pe.c, key)
	stopClient := startClient(key)
	time.Sleep(2 * time.Second) // the client's rate before the change

	var cur v1alpha1.EgressProxyPool
	if err := pe.c.Get(ctx, key, &cur); err != nil {
		t.Fatal(err)
	}
	cur.Spec.Template.MachineType = "large"
	if err := pe.c.Update(ctx, &cur); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	waitFor(t, 3*time.Minute, "every child of the new template, 2/2/2, Healthy, none draining", func() string {
		kids, msg := poolState(ctx, pe.c, key, 6, map[string]int{"mem-a": 2, "mem-b": 2, "mem-c": 2})
		if msg != "" {
			return msg
		}
		for _, k := range kids {
			if k.Spec.MachineType != "large" {
				return fmt.Sprintf("child %s has the old template", k.Name)
			}
			if _, ok := k.Annotations[controller.AnnotationDrainingSince]; ok {
				return fmt.Sprintf("child %s is draining", k.Name)
			}
		}
		n, err := pe.instances(ctx)
		if err != nil {
			return err.Error()
		}
		if n["mem-a"]+n["mem-b"]+n["mem-c"] != 6 {
			return fmt.Sprintf("instances %v, want 6 in all", n)
		}
		return ""
	})
	took := time.Since(t0)
	time.Sleep(2 * time.Second) // the client's rate after the rollout
	sent, failed := stopClient()
	samples := stopWatch()
	minReady := -1
	for _, smp := range samples {
		if smp.at.After(t0) && (minReady < 0 || len(smp.ready) < minReady) {
			minReady = len(smp.ready)
		}
	}
	elapsed := took + 4*time.Second
	rate := float64(sent) / elapsed.Seconds()
	t.Logf("rolled out in %v: %d CONNECTs (%.1f/s), %d failed; the slices (%d samples) listed at least %d ready",
		took.Round(time.Millisecond), sent, rate, len(failed), len(samples), minReady)
	if len(failed) > 0 {
		t.Errorf("%d CONNECTs failed during the rollout, e.g. %s", len(failed), failed[0])
	}
	if rate < 20 {
		t.Errorf("the client sent %.1f CONNECTs/s, want at least 20", rate)
	}
	if minReady < 6 {
		t.Errorf("the slices listed as few as %d ready, want at least replicas - maxUnavailable = 6", minReady)
	}
	pe.deletePool(t, pool)
}
