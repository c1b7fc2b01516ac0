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
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	crcontroller "sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
	"github.com/egressproxy/egressproxy/examples/operator/internal/placement"
	"github.com/egressproxy/egressproxy/health"
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
	// AnnotationDrainingSince is on a child the pool has taken out of its
	// endpoints (listed as terminating) and deletes once the pool's
	// drain period has passed since this time (RFC 3339).
	AnnotationDrainingSince = "egressproxy.dev/draining-since"
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

// DefaultBootTimeout is how long a child's VM may boot (no address yet,
// on a reachable entry) before its unhealthy grace starts, when
// PoolOptions.BootTimeout is zero.
const DefaultBootTimeout = 10 * time.Minute

// PoolOptions configure a PoolReconciler.
type PoolOptions struct {
	// Resync is how often every pool is reconciled again (zero:
	// DefaultPoolResync). Setup passes the health interval: each entry's
	// Check comes as often.
	Resync time.Duration
	// MaxConcurrentReconciles (zero: DefaultMaxConcurrentReconciles).
	MaxConcurrentReconciles int
	// BootTimeout is how long a child's VM may boot before its grace
	// starts (zero: DefaultBootTimeout): a child whose VM is still
	// Pending or Provisioning on a reachable entry has not failed, and
	// one that just got its address has its grace from then.
	BootTimeout time.Duration
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
	// Health gives each entry's last Check and each child's health.
	Health *HealthRunnable
	// Now is the clock the grace is measured on (nil: time.Now; the
	// health tracker's clock must agree).
	Now func() time.Time

	opts   PoolOptions
	events chan event.TypedGenericEvent[*v1alpha1.EgressProxyPool]
	// notifier carries the health runnable's requests into events
	// without losing one in a burst.
	notifier *notifier[*v1alpha1.EgressProxyPool]
}

// +kubebuilder:rbac:groups=egressproxy.dev,resources=egressproxypools,verbs=get;list;watch
// +kubebuilder:rbac:groups=egressproxy.dev,resources=egressproxypools/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=egressproxy.dev,resources=egressproxypools/finalizers,verbs=update
// +kubebuilder:rbac:groups=egressproxy.dev,resources=egressproxies,verbs=create;delete
// +kubebuilder:rbac:groups="",resources=services,verbs=get;create;update
// +kubebuilder:rbac:groups=discovery.k8s.io,resources=endpointslices,verbs=get;list;create;update;delete

// SetupWithManager registers the pool reconciler with mgr: it watches the
// pools and the EgressProxy objects they control (a child's status
// change, such as its health, reconciles its pool). It watches no
// Secrets: that needs list and watch on every Secret of the cluster,
// which the operator is not given; each reconcile, at least every
// Resync, reads the Secrets a pool's template names (poolRevision).
func (r *PoolReconciler) SetupWithManager(mgr ctrl.Manager, opts PoolOptions) error {
	if opts.Resync <= 0 {
		opts.Resync = DefaultPoolResync
	}
	if opts.MaxConcurrentReconciles <= 0 {
		opts.MaxConcurrentReconciles = DefaultMaxConcurrentReconciles
	}
	r.opts = opts
	r.events = make(chan event.TypedGenericEvent[*v1alpha1.EgressProxyPool], 64)
	r.notifier = newNotifier(r.events, poolKey)
	if err := mgr.Add(r.notifier); err != nil {
		return err
	}
	if r.Health != nil {
		r.Health.notifyPool = r.notifyChild
	}
	return ctrl.NewControllerManagedBy(mgr).
		For(&v1alpha1.EgressProxyPool{}).
		Owns(&v1alpha1.EgressProxy{}).
		WatchesRawSource(source.Channel(r.events, &handler.TypedEnqueueRequestForObject[*v1alpha1.EgressProxyPool]{})).
		Named("egressproxypool").
		WithOptions(crcontroller.Options{MaxConcurrentReconciles: opts.MaxConcurrentReconciles}).
		Complete(r)
}

// notifyChild asks for a reconcile of the pool that controls the
// EgressProxy key, if one does (the health runnable calls it when the
// child's health changed). It never blocks: a full channel means
// reconciles are pending anyway, and the resync catches up.
func (r *PoolReconciler) notifyChild(key types.NamespacedName) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	var ep v1alpha1.EgressProxy
	if err := r.Client.Get(ctx, key, &ep); err != nil {
		return
	}
	ref := metav1.GetControllerOf(&ep)
	if ref == nil || ref.Kind != "EgressProxyPool" || ref.APIVersion != v1alpha1.GroupVersion.String() {
		return
	}
	r.notifier.add(types.NamespacedName{Namespace: key.Namespace, Name: ref.Name})
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
	address string // where it serves, "" when unknown
	// lost: not Healthy for longer than the pool's grace; the pool
	// replaces it and deletes it once a replacement is Healthy.
	lost bool
	// outdated: its proxy is not the pool's template any more; the pool
	// replaces it, one surge at a time.
	outdated bool
	// draining: taken out of the endpoints since drainSince; deleted
	// once the drain period has passed.
	draining   bool
	drainSince time.Time
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
	rev, err := r.poolRevision(ctx, pool)
	if err != nil {
		return reconcile.Result{}, err
	}
	eligible, eligibleErr := r.eligible(pool)
	grace := v1alpha1.DefaultUnhealthyGrace
	if g := pool.Spec.UnhealthyGrace; g != nil && g.Duration > 0 {
		grace = g.Duration
	}
	now := time.Now()
	if r.Now != nil {
		now = r.Now()
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
		c := child{obj: ep, entry: ep.Spec.Provider, index: idx}
		var since time.Time
		c.healthy, c.address, since = r.childHealth(ep)
		if !c.healthy {
			since = r.graceStart(ep, since)
		}
		c.lost = !c.healthy && !since.IsZero() && now.Sub(since) > grace
		c.outdated = outdated(pool, ep, rev, eligible, eligibleErr == nil, now)
		if ts, ok := ep.Annotations[AnnotationDrainingSince]; ok {
			c.draining = true
			c.drainSince, _ = time.Parse(time.RFC3339, ts) // unreadable: drained
		}
		alive = append(alive, c)
	}

	if eligibleErr != nil {
		setPoolCondition(pool, v1alpha1.ConditionPoolPlaced, metav1.ConditionFalse, ReasonInvalidEntries, eligibleErr.Error())
		r.summarize(pool, alive, nil)
		return requeue, r.publish(ctx, log, pool, alive)
	}
	alive, err = r.place(ctx, log, pool, alive, eligible, taken, now, rev)
	entries := r.placementEntries(eligible, alive)
	r.summarize(pool, alive, entries)
	if err != nil {
		return reconcile.Result{RequeueAfter: time.Second}, errors.Join(err, r.publish(ctx, log, pool, alive))
	}
	return requeue, r.publish(ctx, log, pool, alive)
}

// outdated reports whether the pool replaces ep, one surge at a time: its
// proxy is not the pool's template any more, or not its revision (the
// template and the contents of the Secrets it names: poolRevision; a
// child without one was made before pools had revisions), or it is older
// than maxAge, or its entry is not among the eligible ones (when they are
// known: spec.entries changed, or the entry left the entries file or
// changed its labels).
func outdated(pool *v1alpha1.EgressProxyPool, ep *v1alpha1.EgressProxy, rev string, eligible []string, eligibleKnown bool, now time.Time) bool {
	switch {
	case !equality.Semantic.DeepEqual(ep.Spec.ProxyTemplate, pool.Spec.Template), ep.Labels[LabelPoolRevision] != rev:
		return true
	case pool.Spec.MaxAge != nil && pool.Spec.MaxAge.Duration > 0 && !ep.CreationTimestamp.IsZero() &&
		now.Sub(ep.CreationTimestamp.Time) > pool.Spec.MaxAge.Duration:
		return true
	}
	return eligibleKnown && !slices.Contains(eligible, ep.Spec.Provider)
}

// place creates and deletes children towards the pool's spec, and
// returns the children then alive. Each child is draining (taken out of
// the endpoints, deleted once the drain period has passed), lost (not
// Healthy for longer than the grace), outdated (see outdated: another
// template or revision, older than maxAge, or on an entry the pool no
// longer selects) or current.
//
//   - Successors: while fewer than replicas are current, placement.Place
//     puts new ones on the eligible entries (counting the current
//     children), as many as maxSurge allows above replicas, a lost child
//     on an unreachable entry taking no room (it uses nothing the pool
//     could use).
//   - Outdated children are taken out as their successors turn Healthy
//     (maxUnavailable more may go before): once the Healthy current
//     children and the outdated ones make more than replicas -
//     maxUnavailable.
//   - A lost child is deleted once a replacement is Healthy: once the
//     Healthy children kept and the lost ones make more than replicas.
//   - More current children than replicas: placement.Remove chooses the
//     entries, the ones not Healthy go first, and no Healthy child is
//     taken out that would leave fewer Healthy than replicas.
//   - Exactly replicas, all current and Healthy: when Place's choice for
//     one more child holds two fewer than the fullest reachable entry (an
//     entry came back), one child is surged there; the step above then
//     takes one from the fullest, and so on until the spread is even.
//
// A Healthy child is taken out by draining it; one that is not Healthy is
// deleted at once.
func (r *PoolReconciler) place(ctx context.Context, log logr.Logger, pool *v1alpha1.EgressProxyPool, alive []child, eligible []string, taken map[string]bool, now time.Time, rev string) ([]child, error) {
	rd := &poolRound{r: r, ctx: ctx, log: log, pool: pool, alive: alive, eligible: eligible, taken: taken, now: now, rev: rev}
	if err := rd.sort(); err != nil {
		return rd.alive, err
	}
	setPoolCondition(pool, v1alpha1.ConditionPoolPlaced, metav1.ConditionTrue, ReasonPlaced, "every child has an entry")
	for _, step := range []func() error{rd.scaleUp, rd.retireOutdated, rd.trimOrRebalance, rd.dropLost} {
		if err := step(); err != nil {
			return rd.alive, err
		}
	}
	return rd.alive, nil
}

// poolRound is one pass of place over a pool's children: what sort found,
// and the children alive as each step leaves them.
type poolRound struct {
	r        *PoolReconciler
	ctx      context.Context
	log      logr.Logger
	pool     *v1alpha1.EgressProxyPool
	alive    []child
	eligible []string
	taken    map[string]bool
	now      time.Time
	rev      string // the pool's revision, which new children carry

	current, outdated, lost []child
	draining                int // Healthy children still draining
	entries                 []placement.Entry
	reachable               map[string]bool
	replicas, surge         int
	healthyCurrent          int // Healthy children of the template
	healthyKeep             int // Healthy children, outdated ones included
}

// sort deletes the children whose drain is over and sorts the others
// into current, outdated and lost; it then counts what the steps use.
func (rd *poolRound) sort() error {
	drain := v1alpha1.DefaultDrainPeriod
	if d := rd.pool.Spec.DrainPeriod; d != nil && d.Duration >= 0 {
		drain = d.Duration
	}
	for _, c := range slices.Clone(rd.alive) {
		switch {
		case c.draining:
			if c.healthy && rd.now.Sub(c.drainSince) < drain {
				rd.draining++
				continue
			}
			if err := rd.r.deleteChild(rd.ctx, c.obj); err != nil {
				return err
			}
			rd.log.Info("drained child deleted", "child", c.obj.Name, "entry", c.entry)
			rd.forget(c)
		case c.lost:
			rd.lost = append(rd.lost, c)
		case c.outdated:
			rd.outdated = append(rd.outdated, c)
		default:
			rd.current = append(rd.current, c)
		}
	}
	rd.entries = rd.r.placementEntries(rd.eligible, rd.current)
	rd.reachable = map[string]bool{}
	for _, e := range rd.entries {
		rd.reachable[e.Name] = e.Reachable
	}
	using := len(rd.current) + len(rd.outdated) + rd.draining
	for _, c := range rd.lost {
		if rd.reachable[c.entry] {
			using++
		}
	}
	rd.replicas = int(rd.pool.Spec.Replicas)
	rd.surge = rd.replicas + int(max(rd.pool.Spec.MaxSurge, 1)) - using
	for _, c := range append(slices.Clone(rd.current), rd.outdated...) {
		if c.healthy {
			rd.healthyKeep++
			if !c.outdated {
				rd.healthyCurrent++
			}
		}
	}
	return nil
}

// forget drops c from alive.
func (rd *poolRound) forget(c child) {
	rd.alive = slices.DeleteFunc(rd.alive, func(x child) bool { return x.obj == c.obj })
}

// takeOut drains the Healthy ones of cs and deletes the others.
func (rd *poolRound) takeOut(cs []child) error {
	for _, c := range cs {
		if err := rd.r.takeOut(rd.ctx, rd.log, c, rd.now); err != nil {
			return err
		}
		if !c.healthy {
			rd.forget(c)
			continue
		}
		for i := range rd.alive {
			if rd.alive[i].obj == c.obj {
				rd.alive[i].draining, rd.alive[i].drainSince = true, rd.now
			}
		}
	}
	return nil
}

// create makes the children add asks for and adds them to alive.
func (rd *poolRound) create(add map[string]int) error {
	created, err := rd.r.create(rd.ctx, rd.log, rd.pool, add, rd.taken, rd.rev)
	rd.alive = append(rd.alive, created...)
	return err
}

// scaleUp places children up to replicas, within the surge.
func (rd *poolRound) scaleUp() error {
	if len(rd.current) >= rd.replicas {
		return nil
	}
	want := min(rd.replicas-len(rd.current), max(rd.surge, 0))
	// A lost child on a reachable entry still counts there, so that its
	// replacement goes to another entry first.
	within := rd.entries
	if lostThere := slices.DeleteFunc(slices.Clone(rd.lost), func(c child) bool { return !rd.reachable[c.entry] }); len(lostThere) > 0 {
		within = rd.r.placementEntries(rd.eligible, append(slices.Clone(rd.current), lostThere...))
	}
	plan, err := placement.Place(within, placement.Request{Want: want, MaxPerEntry: int(rd.pool.Spec.MaxPerEntry)})
	if err != nil {
		return err
	}
	if err := rd.create(plan.Add); err != nil {
		return err
	}
	rd.r.placedCondition(rd.pool, plan)
	return nil
}

// retireOutdated takes outdated children out as their successors turn
// Healthy: those not Healthy first, then the oldest.
func (rd *poolRound) retireOutdated() error {
	n := min(len(rd.outdated), rd.healthyCurrent+len(rd.outdated)+int(rd.pool.Spec.MaxUnavailable)-rd.replicas)
	if n <= 0 {
		return nil
	}
	slices.SortFunc(rd.outdated, func(a, b child) int {
		if a.healthy != b.healthy {
			if a.healthy {
				return 1
			}
			return -1
		}
		return cmp.Compare(a.index, b.index)
	})
	return rd.takeOut(rd.outdated[:n])
}

// trimOrRebalance takes out children above replicas, or, when the pool is
// whole and settled, surges one child where the spread is uneven.
func (rd *poolRound) trimOrRebalance() error {
	switch {
	case len(rd.current) > rd.replicas:
		take, err := placement.Remove(rd.entries, len(rd.current)-rd.replicas)
		if err != nil {
			return err
		}
		return rd.takeOut(removeOrder(rd.current, take, rd.healthyCurrent-min(rd.replicas, rd.healthyCurrent)))
	case len(rd.current) == rd.replicas && len(rd.outdated) == 0 && len(rd.lost) == 0 && rd.draining == 0 && rd.healthyCurrent == rd.replicas && rd.surge > 0:
		if add := rebalance(rd.entries, int(rd.pool.Spec.MaxPerEntry)); add != "" {
			return rd.create(map[string]int{add: 1})
		}
	}
	return nil
}

// dropLost deletes lost children once replacements are Healthy: those on
// unreachable entries first.
func (rd *poolRound) dropLost() error {
	n := min(len(rd.lost), rd.healthyKeep+len(rd.lost)-rd.replicas)
	if n <= 0 {
		return nil
	}
	slices.SortFunc(rd.lost, func(a, b child) int {
		if rd.reachable[a.entry] != rd.reachable[b.entry] {
			if rd.reachable[a.entry] {
				return 1
			}
			return -1
		}
		return cmp.Compare(a.index, b.index)
	})
	for _, c := range rd.lost[:n] {
		if err := rd.r.deleteChild(rd.ctx, c.obj); err != nil {
			return err
		}
		rd.log.Info("lost child deleted: its replacement is Healthy", "child", c.obj.Name, "entry", c.entry)
		rd.forget(c)
	}
	return nil
}

// removeOrder chooses, from each entry, as many of current as take says:
// those that are not Healthy first, then the newest (highest index), but
// no more than healthyCap Healthy ones.
func removeOrder(current []child, take map[string]int, healthyCap int) []child {
	order := slices.Clone(current)
	slices.SortFunc(order, func(a, b child) int {
		if a.healthy != b.healthy {
			if a.healthy {
				return 1
			}
			return -1
		}
		return cmp.Compare(b.index, a.index)
	})
	var out []child
	for _, c := range order {
		if take[c.entry] == 0 || (c.healthy && healthyCap == 0) {
			continue
		}
		take[c.entry]--
		if c.healthy {
			healthyCap--
		}
		out = append(out, c)
	}
	return out
}

// takeOut drains a Healthy child (it stays listed as terminating until
// the drain period has passed) and deletes one that is not Healthy.
func (r *PoolReconciler) takeOut(ctx context.Context, log logr.Logger, c child, now time.Time) error {
	if !c.healthy {
		if err := r.deleteChild(ctx, c.obj); err != nil {
			return err
		}
		log.Info("child deleted", "child", c.obj.Name, "entry", c.entry, "outdated", c.outdated)
		return nil
	}
	patch := client.MergeFrom(c.obj.DeepCopy())
	if c.obj.Annotations == nil {
		c.obj.Annotations = map[string]string{}
	}
	c.obj.Annotations[AnnotationDrainingSince] = now.UTC().Format(time.RFC3339)
	if err := r.Client.Patch(ctx, c.obj, patch); err != nil {
		return fmt.Errorf("drain child %s: %w", c.obj.Name, err)
	}
	log.Info("child draining", "child", c.obj.Name, "entry", c.entry, "outdated", c.outdated)
	return nil
}

// deleteChild deletes ep (gone already is done).
func (r *PoolReconciler) deleteChild(ctx context.Context, ep *v1alpha1.EgressProxy) error {
	if err := r.Client.Delete(ctx, ep, client.Preconditions{UID: &ep.UID}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete child %s: %w", ep.Name, err)
	}
	return nil
}

// rebalance is the entry that should get one more child to even the
// spread ("" when none should): Place's choice for one child, when it
// holds at least two fewer than the fullest reachable entry.
func rebalance(entries []placement.Entry, maxPerEntry int) string {
	plan, err := placement.Place(entries, placement.Request{Want: 1, MaxPerEntry: maxPerEntry})
	if err != nil || len(plan.Add) != 1 {
		return ""
	}
	var to string
	for name := range plan.Add {
		to = name
	}
	fullest, at := 0, 0
	for _, e := range entries {
		if e.Reachable {
			fullest = max(fullest, e.Current)
		}
		if e.Name == to {
			at = e.Current
		}
	}
	if at+2 > fullest {
		return ""
	}
	return to
}

// childHealth is whether ep is Healthy, its address, and since when it is
// not Healthy (zero when Healthy or unknown): the health tracker's
// decision when it has one that is not Unknown, else what ep's status
// says (written by this or an earlier leader's tracker), since its
// Healthy condition turned False, or since it was created.
func (r *PoolReconciler) childHealth(ep *v1alpha1.EgressProxy) (bool, string, time.Time) {
	if r.Health != nil && ep.Status.Instance != "" {
		if st, ok := r.Health.ProxyState(ep.Status.Instance); ok && st.State != health.StateUnknown {
			addr := cmp.Or(st.Address, ep.Status.Address)
			if st.State == health.StateHealthy {
				return true, addr, time.Time{}
			}
			return false, addr, st.Since
		}
	}
	if ep.Status.Health == v1alpha1.HealthHealthy {
		return true, ep.Status.Address, time.Time{}
	}
	since := ep.CreationTimestamp.Time
	if c := meta.FindStatusCondition(ep.Status.Conditions, v1alpha1.ConditionHealthy); c != nil && c.Status == metav1.ConditionFalse && c.LastTransitionTime.After(since) {
		since = c.LastTransitionTime.Time
	}
	return false, ep.Status.Address, since
}

// graceStart is when a child that is not Healthy (since since) started
// to use up its grace: a VM still booting on a reachable entry (phase
// Pending or Provisioning: no address yet) only BootTimeout after the
// child's creation, and one whose VM got its address (Ready turned True)
// after since only from then, when its proxy's probes can first pass.
// Without this a VM that boots for longer than the grace (a real guest
// takes about a minute) was replaced while it booted.
func (r *PoolReconciler) graceStart(ep *v1alpha1.EgressProxy, since time.Time) time.Time {
	switch ep.Status.Phase {
	case "", v1alpha1.PhasePending, v1alpha1.PhaseProvisioning:
		if r.Health != nil && !ep.CreationTimestamp.IsZero() {
			if h, ok := r.Health.EntryHealth(ep.Spec.Provider); ok && h.Reachable {
				if b := ep.CreationTimestamp.Add(cmp.Or(r.opts.BootTimeout, DefaultBootTimeout)); b.After(since) {
					return b
				}
			}
		}
	}
	if c := meta.FindStatusCondition(ep.Status.Conditions, v1alpha1.ConditionReady); c != nil &&
		c.Status == metav1.ConditionTrue && c.LastTransitionTime.After(since) {
		return c.LastTransitionTime.Time
	}
	return since
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
func (r *PoolReconciler) create(ctx context.Context, log logr.Logger, pool *v1alpha1.EgressProxyPool, add map[string]int, taken map[string]bool, rev string) ([]child, error) {
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
					LabelPool: pool.Name, LabelEntry: entry, LabelPoolIndex: strconv.Itoa(next), LabelPoolRevision: rev,
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
	healthy, created := 0, 0
	for _, c := range alive {
		if c.draining {
			continue
		}
		created++
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
	pool.Status.CreatedReplicas = int32(created)
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
		ap, err := netip.ParseAddrPort(c.address)
		if err != nil {
			log.V(1).Info("a healthy child's address is no IP address and port; not listed", "child", c.obj.Name, "address", c.address)
			continue
		}
		at, addr := EndpointAddress(ap)
		s := r.slice(pool, at, ap.Port(), want)
		ready, serving, terminating := !c.draining, true, c.draining
		s.Endpoints = append(s.Endpoints, discoveryv1.Endpoint{
			Addresses:  []string{addr},
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
	// New slices first, then changed ones, then the ones no longer
	// wanted: a child that replaces another is listed before its
	// predecessor leaves.
	var update, drop []*discoveryv1.EndpointSlice
	for i := range have.Items {
		s := &have.Items[i]
		w, ok := want[s.Name]
		if !ok || !metav1.IsControlledBy(s, pool) {
			drop = append(drop, s)
			continue
		}
		delete(want, s.Name)
		if !sameSlice(s, w) {
			s.Labels, s.Endpoints, s.Ports = w.Labels, w.Endpoints, w.Ports
			update = append(update, s)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(want)) {
		if err := r.Client.Create(ctx, want[name]); err != nil {
			return fmt.Errorf("create endpoint slice %s: %w", name, err)
		}
	}
	for _, s := range update {
		if err := r.Client.Update(ctx, s); err != nil {
			return fmt.Errorf("update endpoint slice %s: %w", s.Name, err)
		}
	}
	for _, s := range drop {
		if err := r.Client.Delete(ctx, s, client.Preconditions{UID: &s.UID}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete endpoint slice %s: %w", s.Name, err)
		}
	}
	return nil
}

// EndpointAddress is how an EndpointSlice lists a proxy at ap: its IP
// under addressType IPv4 or IPv6, or, for a loopback address (a memory
// entry's proxies listen on 127.0.0.1), which Kubernetes refuses in an
// EndpointSlice, as the FQDN "<address>.localhost" (RFC 6761: names
// under localhost are loopback), "ip6.localhost" for ::1.
func EndpointAddress(ap netip.AddrPort) (discoveryv1.AddressType, string) {
	a := ap.Addr().Unmap()
	switch {
	case a.IsLoopback() && a.Is4():
		return discoveryv1.AddressTypeFQDN, a.String() + ".localhost"
	case a.IsLoopback():
		return discoveryv1.AddressTypeFQDN, "ip6.localhost"
	case a.Is4():
		return discoveryv1.AddressTypeIPv4, a.String()
	}
	return discoveryv1.AddressTypeIPv6, a.String()
}

// slice is the EndpointSlice in want for address type at and port,
// added when it is not there yet. Slices are per port because children
// may listen on different ports (memory entries serve each proxy on a
// port of its own); a kvm2 pool with one template has one per family.
func (r *PoolReconciler) slice(pool *v1alpha1.EgressProxyPool, at discoveryv1.AddressType, port uint16, want map[string]*discoveryv1.EndpointSlice) *discoveryv1.EndpointSlice {
	name := fmt.Sprintf("%s-%s-%d", pool.Name, strings.ToLower(string(at)), port)
	if s, ok := want[name]; ok {
		return s
	}
	p, proto, pname := int32(port), corev1.ProtocolTCP, PoolPortName
	s := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Namespace: pool.Namespace, Name: name, Labels: map[string]string{
			discoveryv1.LabelServiceName: pool.Name, discoveryv1.LabelManagedBy: ManagedBy, LabelPool: pool.Name,
		}},
		AddressType: at,
		Ports:       []discoveryv1.EndpointPort{{Name: &pname, Protocol: &proto, Port: &p}},
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
			x.Conditions.Ready == nil || *x.Conditions.Ready != *y.Conditions.Ready {
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
