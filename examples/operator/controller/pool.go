package controller

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	crcontroller "sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
	"github.com/egressproxy/egressproxy/examples/operator/internal/placement"
)

// Labels of a pool's children and of its Service and EndpointSlices.
const (
	// LabelPool names the pool (on its children, Service and slices).
	LabelPool = "egressproxy.dev/pool"
	// LabelEntry names the entry a child is pinned to.
	LabelEntry = "egressproxy.dev/entry"
	// LabelPoolIndex is a child's index in its pool: its name is the
	// pool's name, "-" and the index.
	LabelPoolIndex = "egressproxy.dev/pool-index"
)

// The pool's Service port's name; every EndpointSlice's port has it.
const PoolPortName = "proxy"

// Reasons of the pool's conditions.
const (
	ReasonAvailable        = "Available"
	ReasonNotEnoughHealthy = "NotEnoughHealthy"
	ReasonPlaced           = "Placed"
	ReasonShortfall        = "Shortfall"
	ReasonInvalidEntries   = "InvalidEntries"
)

// DefaultPoolResync is how often a pool is reconciled without a change of
// its own or of a child when PoolOptions.Resync is zero: the entries'
// Checks change what placement may do without any object changing.
const DefaultPoolResync = DefaultHealthInterval

// PoolOptions configure a PoolReconciler.
type PoolOptions struct {
	// Resync is how often every pool is reconciled again (zero:
	// DefaultPoolResync). Setup passes the health interval: each entry's
	// Check comes as often.
	Resync time.Duration
	// MaxConcurrentReconciles (zero: DefaultMaxConcurrentReconciles).
	MaxConcurrentReconciles int
}

// PoolReconciler reconciles EgressProxyPool objects into EgressProxy
// children (each pinned to an entry that placement.Place chooses from
// the health runnable's facts), a selector-less Service and the
// EndpointSlices that list the Healthy children.
type PoolReconciler struct {
	// Client reads pools and children (cached) and writes them, the
	// Service and the slices.
	Client client.Client
	// APIReader reads the Services and EndpointSlices straight from the
	// apiserver: the operator keeps no cache of the cluster's Services.
	APIReader client.Reader
	// Entries are the configured entries (their names are what a pool
	// can select).
	Entries map[string]*egressproxy.Client
	// EntryLabels are the entries file's labels by entry.
	EntryLabels map[string]map[string]string
	// Health gives each entry's last Check.
	Health *HealthRunnable

	opts PoolOptions
}

// +kubebuilder:rbac:groups=egressproxy.dev,resources=egressproxypools,verbs=get;list;watch
// +kubebuilder:rbac:groups=egressproxy.dev,resources=egressproxypools/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=egressproxy.dev,resources=egressproxypools/finalizers,verbs=update
// +kubebuilder:rbac:groups=egressproxy.dev,resources=egressproxies,verbs=create;delete
// +kubebuilder:rbac:groups="",resources=services,verbs=get;create;update
// +kubebuilder:rbac:groups=discovery.k8s.io,resources=endpointslices,verbs=get;list;create;update;delete

// SetupWithManager registers the pool reconciler with mgr: it watches the
// pools and the EgressProxy objects they control (a child's status
// change, such as its health, reconciles its pool).
func (r *PoolReconciler) SetupWithManager(mgr ctrl.Manager, opts PoolOptions) error {
	if opts.Resync <= 0 {
		opts.Resync = DefaultPoolResync
	}
	if opts.MaxConcurrentReconciles <= 0 {
		opts.MaxConcurrentReconciles = DefaultMaxConcurrentReconciles
	}
	r.opts = opts
	return ctrl.NewControllerManagedBy(mgr).
		For(&v1alpha1.EgressProxyPool{}).
		Owns(&v1alpha1.EgressProxy{}).
		Named("egressproxypool").
		WithOptions(crcontroller.Options{MaxConcurrentReconciles: opts.MaxConcurrentReconciles}).
		Complete(r)
}

// Reconcile drives one pool towards its spec.
func (r *PoolReconciler) Reconcile(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	log := logf.FromContext(ctx)
	var pool v1alpha1.EgressProxyPool
	if err := r.Client.Get(ctx, req.NamespacedName, &pool); err != nil {
		return reconcile.Result{}, client.IgnoreNotFound(err)
	}
	if !pool.DeletionTimestamp.IsZero() {
		// The children, Service and slices carry the pool as their
		// controller: the garbage collector deletes them (and each
		// child's finalizer its VM).
		return reconcile.Result{}, nil
	}
	orig := pool.DeepCopy()
	res, err := r.reconcile(ctx, log, &pool)
	if ctx.Err() != nil {
		return reconcile.Result{}, nil
	}
	if !equalPoolStatus(orig.Status, pool.Status) {
		if perr := r.Client.Status().Patch(ctx, &pool, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); perr != nil {
			if apierrors.IsConflict(perr) || apierrors.IsNotFound(perr) {
				log.V(1).Info("pool status not written", "err", perr)
				return reconcile.Result{RequeueAfter: time.Second}, nil
			}
			return reconcile.Result{}, errors.Join(err, perr)
		}
	}
	return res, err
}

// child is one of the pool's EgressProxy objects as the pool sees it.
type child struct {
	obj     *v1alpha1.EgressProxy
	entry   string
	index   int
	healthy bool
}

// reconcile does the work on pool (whose status it edits in place).
func (r *PoolReconciler) reconcile(ctx context.Context, log logr.Logger, pool *v1alpha1.EgressProxyPool) (reconcile.Result, error) {
	pool.Status.ObservedGeneration = pool.Generation
	pool.Status.DesiredReplicas = pool.Spec.Replicas
	requeue := reconcile.Result{RequeueAfter: r.opts.Resync}

	var all v1alpha1.EgressProxyList
	if err := r.Client.List(ctx, &all, client.InNamespace(pool.Namespace)); err != nil {
		return reconcile.Result{}, err
	}
	taken := map[string]bool{} // every name in the namespace: a new child's must be free
	var alive []child
	for i := range all.Items {
		ep := &all.Items[i]
		taken[ep.Name] = true
		if !metav1.IsControlledBy(ep, pool) || !ep.DeletionTimestamp.IsZero() {
			continue
		}
		idx, _ := strconv.Atoi(ep.Labels[LabelPoolIndex])
		alive = append(alive, child{obj: ep, entry: ep.Spec.Provider, index: idx, healthy: ep.Status.Health == v1alpha1.HealthHealthy})
	}

	eligible, err := r.eligible(pool)
	if err != nil {
		setPoolCondition(pool, v1alpha1.ConditionPoolPlaced, metav1.ConditionFalse, ReasonInvalidEntries, err.Error())
		r.summarize(pool, alive, nil)
		return requeue, r.publish(ctx, log, pool, alive)
	}
	entries := r.placementEntries(eligible, alive)

	switch n := len(alive); {
	case n < int(pool.Spec.Replicas):
		plan, err := placement.Place(entries, placement.Request{Want: int(pool.Spec.Replicas) - n, MaxPerEntry: int(pool.Spec.MaxPerEntry)})
		if err != nil {
			return reconcile.Result{}, err
		}
		created, err := r.create(ctx, log, pool, plan.Add, taken)
		alive = append(alive, created...)
		if err != nil {
			r.summarize(pool, alive, entries)
			return reconcile.Result{RequeueAfter: time.Second}, errors.Join(err, r.publish(ctx, log, pool, alive))
		}
		r.placedCondition(pool, plan)
	case n > int(pool.Spec.Replicas):
		take, err := placement.Remove(entries, n-int(pool.Spec.Replicas))
		if err != nil {
			return reconcile.Result{}, err
		}
		alive, err = r.remove(ctx, log, alive, take)
		if err != nil {
			r.summarize(pool, alive, entries)
			return reconcile.Result{RequeueAfter: time.Second}, errors.Join(err, r.publish(ctx, log, pool, alive))
		}
		setPoolCondition(pool, v1alpha1.ConditionPoolPlaced, metav1.ConditionTrue, ReasonPlaced, "every child has an entry")
	default:
		setPoolCondition(pool, v1alpha1.ConditionPoolPlaced, metav1.ConditionTrue, ReasonPlaced, "every child has an entry")
	}
	r.summarize(pool, alive, entries)
	return requeue, r.publish(ctx, log, pool, alive)
}

// eligible are the names of the configured entries pool may use, sorted.
func (r *PoolReconciler) eligible(pool *v1alpha1.EgressProxyPool) ([]string, error) {
	sel := pool.Spec.Entries
	var match labels.Selector
	if sel.Selector != nil {
		var err error
		if match, err = metav1.LabelSelectorAsSelector(sel.Selector); err != nil {
			return nil, fmt.Errorf("spec.entries.selector: %w", err)
		}
	}
	var out []string
	for _, name := range slices.Sorted(maps.Keys(r.Entries)) {
		switch {
		case len(sel.Names) == 0 && match == nil,
			slices.Contains(sel.Names, name),
			match != nil && match.Matches(labels.Set(r.EntryLabels[name])):
			out = append(out, name)
		}
	}
	return out, nil
}

// placementEntries are the facts placement decides by: each eligible
// entry's last Check and the pool's children on it, and, as unreachable
// entries (so Remove takes their children first and Place puts none
// there), the entries that hold a child but are no longer eligible.
func (r *PoolReconciler) placementEntries(eligible []string, alive []child) []placement.Entry {
	count := map[string]int{}
	for _, c := range alive {
		count[c.entry]++
	}
	var out []placement.Entry
	for _, name := range eligible {
		e := placement.Entry{Name: name, Current: count[name]}
		if r.Health != nil {
			if h, ok := r.Health.EntryHealth(name); ok {
				e.Reachable, e.Capacity = h.Reachable, h.Capacity
			}
		}
		out = append(out, e)
		delete(count, name)
	}
	for _, name := range slices.Sorted(maps.Keys(count)) {
		out = append(out, placement.Entry{Name: name, Current: count[name]})
	}
	return out
}

// create makes the children add asks for, each named after the pool and
// the lowest index whose name is free in the namespace. A name that
// exists already (a retry after a lost answer, or a child the cache has
// not shown yet) fails the Create instead of making a second child.
func (r *PoolReconciler) create(ctx context.Context, log logr.Logger, pool *v1alpha1.EgressProxyPool, add map[string]int, taken map[string]bool) ([]child, error) {
	var out []child
	next := 0
	for _, entry := range slices.Sorted(maps.Keys(add)) {
		for range add[entry] {
			for taken[childName(pool.Name, next)] {
				next++
			}
			name := childName(pool.Name, next)
			taken[name] = true
			ep := &v1alpha1.EgressProxy{
				ObjectMeta: metav1.ObjectMeta{Namespace: pool.Namespace, Name: name, Labels: map[string]string{
					LabelPool: pool.Name, LabelEntry: entry, LabelPoolIndex: strconv.Itoa(next),
				}},
				Spec: v1alpha1.EgressProxySpec{Provider: entry, ProxyTemplate: *pool.Spec.Template.DeepCopy()},
			}
			if err := controllerutil.SetControllerReference(pool, ep, r.Client.Scheme()); err != nil {
				return out, err
			}
			if err := r.Client.Create(ctx, ep); err != nil {
				if apierrors.IsAlreadyExists(err) {
					log.V(1).Info("child exists already; the pool is read again", "child", name)
					return out, nil
				}
				return out, fmt.Errorf("create child %s on entry %s: %w", name, entry, err)
			}
			log.Info("child created", "child", name, "entry", entry)
			out = append(out, child{obj: ep, entry: entry, index: next})
		}
	}
	return out, nil
}

// childName is the name of a pool's child with index i.
func childName(pool string, i int) string { return pool + "-" + strconv.Itoa(i) }

// remove deletes, from each entry, as many children as take says: those
// that are not Healthy first, then the newest (highest index). It returns
// the children left.
func (r *PoolReconciler) remove(ctx context.Context, log logr.Logger, alive []child, take map[string]int) ([]child, error) {
	order := slices.Clone(alive)
	slices.SortFunc(order, func(a, b child) int {
		if a.healthy != b.healthy {
			if a.healthy {
				return 1
			}
			return -1
		}
		return cmp.Compare(b.index, a.index)
	})
	gone := map[*v1alpha1.EgressProxy]bool{}
	for _, c := range order {
		if take[c.entry] == 0 {
			continue
		}
		if err := r.Client.Delete(ctx, c.obj, client.Preconditions{UID: &c.obj.UID}); err != nil && !apierrors.IsNotFound(err) {
			return slices.DeleteFunc(alive, func(c child) bool { return gone[c.obj] }), fmt.Errorf("delete child %s: %w", c.obj.Name, err)
		}
		log.Info("child deleted", "child", c.obj.Name, "entry", c.entry)
		take[c.entry]--
		gone[c.obj] = true
	}
	return slices.DeleteFunc(alive, func(c child) bool { return gone[c.obj] }), nil
}

// placedCondition reports whether the plan placed every child.
func (r *PoolReconciler) placedCondition(pool *v1alpha1.EgressProxyPool, plan placement.Plan) {
	if plan.Shortfall == 0 {
		setPoolCondition(pool, v1alpha1.ConditionPoolPlaced, metav1.ConditionTrue, ReasonPlaced, "every child has an entry")
		return
	}
	var why []string
	for _, s := range plan.Skipped {
		why = append(why, s.Entry+": "+string(s.Reason))
	}
	msg := fmt.Sprintf("%d children fit on no entry", plan.Shortfall)
	if len(why) > 0 {
		msg += " (" + strings.Join(why, ", ") + ")"
	} else {
		msg += " (no eligible entry)"
	}
	setPoolCondition(pool, v1alpha1.ConditionPoolPlaced, metav1.ConditionFalse, ReasonShortfall, msg)
}

// summarize writes the counts, the distribution and the Available
// condition.
func (r *PoolReconciler) summarize(pool *v1alpha1.EgressProxyPool, alive []child, entries []placement.Entry) {
	dist := map[string]*v1alpha1.PoolEntryStatus{}
	for _, e := range entries {
		dist[e.Name] = &v1alpha1.PoolEntryStatus{Name: e.Name, Reachable: e.Reachable}
	}
	healthy := 0
	for _, c := range alive {
		d := dist[c.entry]
		if d == nil {
			d = &v1alpha1.PoolEntryStatus{Name: c.entry}
			dist[c.entry] = d
		}
		d.Replicas++
		if c.healthy {
			d.Healthy++
			healthy++
		}
	}
	pool.Status.CreatedReplicas = int32(len(alive))
	pool.Status.HealthyReplicas = int32(healthy)
	pool.Status.Entries = nil
	for _, name := range slices.Sorted(maps.Keys(dist)) {
		pool.Status.Entries = append(pool.Status.Entries, *dist[name])
	}
	need := max(pool.Spec.Replicas-pool.Spec.MaxUnavailable, 0)
	if int32(healthy) >= need {
		setPoolCondition(pool, v1alpha1.ConditionPoolAvailable, metav1.ConditionTrue, ReasonAvailable,
			fmt.Sprintf("%d of %d children Healthy (at least %d needed)", healthy, pool.Spec.Replicas, need))
	} else {
		setPoolCondition(pool, v1alpha1.ConditionPoolAvailable, metav1.ConditionFalse, ReasonNotEnoughHealthy,
			fmt.Sprintf("%d of %d children Healthy (at least %d needed)", healthy, pool.Spec.Replicas, need))
	}
}

// publish makes the pool's Service and its EndpointSlices list exactly
// the Healthy children's addresses.
func (r *PoolReconciler) publish(ctx context.Context, log logr.Logger, pool *v1alpha1.EgressProxyPool, alive []child) error {
	if err := r.service(ctx, pool); err != nil {
		return fmt.Errorf("service %s: %w", pool.Name, err)
	}
	pool.Status.ServiceName = pool.Name
	want := map[string]*discoveryv1.EndpointSlice{}
	for _, c := range alive {
		if !c.healthy {
			continue
		}
		ap, err := netip.ParseAddrPort(c.obj.Status.Address)
		if err != nil {
			log.V(1).Info("a healthy child's address is no IP address and port; not listed", "child", c.obj.Name, "address", c.obj.Status.Address)
			continue
		}
		s := r.slice(pool, ap, want)
		ready, serving, terminating := true, true, false
		s.Endpoints = append(s.Endpoints, discoveryv1.Endpoint{
			Addresses:  []string{ap.Addr().Unmap().String()},
			Conditions: discoveryv1.EndpointConditions{Ready: &ready, Serving: &serving, Terminating: &terminating},
			TargetRef: &corev1.ObjectReference{APIVersion: v1alpha1.GroupVersion.String(), Kind: "EgressProxy",
				Namespace: c.obj.Namespace, Name: c.obj.Name, UID: c.obj.UID},
		})
	}
	var have discoveryv1.EndpointSliceList
	if err := r.APIReader.List(ctx, &have, client.InNamespace(pool.Namespace), client.MatchingLabels{
		discoveryv1.LabelServiceName: pool.Name, discoveryv1.LabelManagedBy: ManagedBy,
	}); err != nil {
		return fmt.Errorf("list endpoint slices: %w", err)
	}
	for i := range have.Items {
		s := &have.Items[i]
		w, ok := want[s.Name]
		if !ok || !metav1.IsControlledBy(s, pool) {
			if err := r.Client.Delete(ctx, s, client.Preconditions{UID: &s.UID}); err != nil && !apierrors.IsNotFound(err) {
				return fmt.Errorf("delete endpoint slice %s: %w", s.Name, err)
			}
			continue
		}
		delete(want, s.Name)
		if sameSlice(s, w) {
			continue
		}
		s.Labels, s.Endpoints, s.Ports = w.Labels, w.Endpoints, w.Ports
		if err := r.Client.Update(ctx, s); err != nil {
			return fmt.Errorf("update endpoint slice %s: %w", s.Name, err)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(want)) {
		if err := r.Client.Create(ctx, want[name]); err != nil {
			return fmt.Errorf("create endpoint slice %s: %w", name, err)
		}
	}
	return nil
}

// slice is the EndpointSlice in want for ap's address family and port,
// added when it is not there yet. Slices are per port because children
// may listen on different ports (memory entries serve each proxy on a
// port of its own); a kvm2 pool with one template has one per family.
func (r *PoolReconciler) slice(pool *v1alpha1.EgressProxyPool, ap netip.AddrPort, want map[string]*discoveryv1.EndpointSlice) *discoveryv1.EndpointSlice {
	family, at := "v4", discoveryv1.AddressTypeIPv4
	if !ap.Addr().Unmap().Is4() {
		family, at = "v6", discoveryv1.AddressTypeIPv6
	}
	name := fmt.Sprintf("%s-%s-%d", pool.Name, family, ap.Port())
	if s, ok := want[name]; ok {
		return s
	}
	port, proto, pname := int32(ap.Port()), corev1.ProtocolTCP, PoolPortName
	s := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Namespace: pool.Namespace, Name: name, Labels: map[string]string{
			discoveryv1.LabelServiceName: pool.Name, discoveryv1.LabelManagedBy: ManagedBy, LabelPool: pool.Name,
		}},
		AddressType: at,
		Ports:       []discoveryv1.EndpointPort{{Name: &pname, Protocol: &proto, Port: &port}},
	}
	// SetControllerReference fails only for an owner without a kind in
	// the scheme, which the pool's is.
	_ = controllerutil.SetControllerReference(pool, s, r.Client.Scheme())
	want[name] = s
	return s
}

func sameSlice(a, b *discoveryv1.EndpointSlice) bool {
	if !maps.Equal(a.Labels, b.Labels) || len(a.Ports) != len(b.Ports) || len(a.Endpoints) != len(b.Endpoints) {
		return false
	}
	for i := range a.Ports {
		if *a.Ports[i].Port != *b.Ports[i].Port {
			return false
		}
	}
	for i := range a.Endpoints {
		x, y := a.Endpoints[i], b.Endpoints[i]
		if !slices.Equal(x.Addresses, y.Addresses) || x.TargetRef == nil || x.TargetRef.UID != y.TargetRef.UID ||
			x.Conditions.Ready == nil || !*x.Conditions.Ready {
			return false
		}
	}
	return true
}

// service creates or updates the pool's selector-less Service: one TCP
// port named PoolPortName, the template's port (3128 when zero).
func (r *PoolReconciler) service(ctx context.Context, pool *v1alpha1.EgressProxyPool) error {
	port := cmp.Or(pool.Spec.Template.Port, 3128)
	want := []corev1.ServicePort{{Name: PoolPortName, Protocol: corev1.ProtocolTCP, Port: port, TargetPort: intstr.FromInt32(port)}}
	var svc corev1.Service
	err := r.APIReader.Get(ctx, client.ObjectKey{Namespace: pool.Namespace, Name: pool.Name}, &svc)
	if apierrors.IsNotFound(err) {
		svc = corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Namespace: pool.Namespace, Name: pool.Name, Labels: map[string]string{LabelPool: pool.Name, ManagedByLabel: ManagedBy}},
			Spec:       corev1.ServiceSpec{Ports: want},
		}
		if err := controllerutil.SetControllerReference(pool, &svc, r.Client.Scheme()); err != nil {
			return err
		}
		return r.Client.Create(ctx, &svc)
	}
	if err != nil {
		return err
	}
	if !metav1.IsControlledBy(&svc, pool) {
		return fmt.Errorf("a Service %s not controlled by the pool exists", pool.Name)
	}
	if len(svc.Spec.Selector) == 0 && len(svc.Spec.Ports) == 1 && svc.Spec.Ports[0].Name == PoolPortName &&
		svc.Spec.Ports[0].Port == port && svc.Spec.Ports[0].TargetPort == want[0].TargetPort {
		return nil
	}
	svc.Spec.Selector, svc.Spec.Ports = nil, want
	return r.Client.Update(ctx, &svc)
}

func setPoolCondition(pool *v1alpha1.EgressProxyPool, typ string, st metav1.ConditionStatus, reason, msg string) {
	if len(msg) > 1024 {
		msg = msg[:1024]
	}
	meta.SetStatusCondition(&pool.Status.Conditions, metav1.Condition{
		Type: typ, Status: st, Reason: reason, Message: msg, ObservedGeneration: pool.Generation,
	})
}

func equalPoolStatus(a, b v1alpha1.EgressProxyPoolStatus) bool {
	if a.DesiredReplicas != b.DesiredReplicas || a.CreatedReplicas != b.CreatedReplicas || a.HealthyReplicas != b.HealthyReplicas ||
		a.ServiceName != b.ServiceName || a.ObservedGeneration != b.ObservedGeneration ||
		!slices.Equal(a.Entries, b.Entries) || len(a.Conditions) != len(b.Conditions) {
		return false
	}
	for i := range a.Conditions {
		x, y := a.Conditions[i], b.Conditions[i]
		if x.Type != y.Type || x.Status != y.Status || x.Reason != y.Reason || x.Message != y.Message || x.ObservedGeneration != y.ObservedGeneration {
			return false
		}
	}
	return true
}
