// Package controller is the egress-proxy operator's logic: the EgressProxy
// reconciler, the health runnable that probes the proxies with a
// health.Tracker, and the orphan collector. Everything it does to a VM goes
// through egressproxy.Client, one per provider entry.
package controller

import (
	"context"
	"fmt"
	"time"

	"github.com/go-logr/logr"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"
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
)

// Finalizer is the finalizer the operator puts on every EgressProxy: the
// object stays until its VM is deleted.
const Finalizer = "egressproxy.dev/vm"

// Defaults of Options.
const (
	DefaultBackoffBase    = time.Second
	DefaultBackoffMax     = 5 * time.Minute
	DefaultPollInterval   = 15 * time.Second
	DefaultPermanentRetry = 10 * time.Minute
	// DefaultMaxConcurrentReconciles: one object's long call (a cold
	// image fetch, or the wait for another writer's claim on that image,
	// up to the image cache's claim timeout when a killed replica left
	// one) must not hold up every other object's reconcile.
	DefaultMaxConcurrentReconciles = 4
)

// Options configure a Reconciler.
type Options struct {
	// BackoffBase and BackoffMax bound the per-object exponential backoff
	// after Transient errors (zero: DefaultBackoffBase, DefaultBackoffMax).
	BackoffBase, BackoffMax time.Duration
	// PollInterval is how often a VM that exists but has no address (or
	// is not Running) is read back again (zero: DefaultPollInterval).
	PollInterval time.Duration
	// PermanentRetry is how long after a Permanent error the object is
	// tried again even if nothing changed (zero: DefaultPermanentRetry):
	// a Permanent error needs a human, who may fix the operator's entry
	// configuration instead of the object. It is no hot loop.
	PermanentRetry time.Duration
	// MaxConcurrentReconciles is how many objects are reconciled at once
	// (zero: DefaultMaxConcurrentReconciles). controller-runtime never
	// reconciles one object twice at the same time.
	MaxConcurrentReconciles int
}

// Reconciler reconciles EgressProxy objects into VMs.
type Reconciler struct {
	// Client reads and writes EgressProxy objects (the manager's client).
	Client client.Client
	// APIReader reads Secrets straight from the apiserver (the operator
	// does not cache every Secret of the cluster).
	APIReader client.Reader
	// Entries are the provider entries by entry name.
	Entries map[string]*egressproxy.Client
	// Health is where the reconciler registers proxies to probe and reads
	// their health and their entries' health from.
	Health *HealthRunnable

	opts     Options
	backoff  workqueue.TypedRateLimiter[reconcile.Request]
	events   chan event.TypedGenericEvent[*v1alpha1.EgressProxy]
	notifier *notifier[*v1alpha1.EgressProxy] // the health runnable's requests into events
}

// +kubebuilder:rbac:groups=egressproxy.dev,resources=egressproxies,verbs=get;list;watch;update;patch
// +kubebuilder:rbac:groups=egressproxy.dev,resources=egressproxies/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=egressproxy.dev,resources=egressproxies/finalizers,verbs=update
// +kubebuilder:rbac:groups="",resources=secrets,verbs=get
// +kubebuilder:rbac:groups="",resources=events,verbs=create;patch
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch
// +kubebuilder:rbac:groups=coordination.k8s.io,resources=leases,verbs=get;list;watch;create;update;patch;delete

// SetupWithManager registers the reconciler (and its health runnable's
// events) with mgr.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager, opts Options) error {
	if opts.BackoffBase <= 0 {
		opts.BackoffBase = DefaultBackoffBase
	}
	if opts.BackoffMax <= 0 {
		opts.BackoffMax = DefaultBackoffMax
	}
	if opts.PollInterval <= 0 {
		opts.PollInterval = DefaultPollInterval
	}
	if opts.PermanentRetry <= 0 {
		opts.PermanentRetry = DefaultPermanentRetry
	}
	if opts.MaxConcurrentReconciles <= 0 {
		opts.MaxConcurrentReconciles = DefaultMaxConcurrentReconciles
	}
	r.opts = opts
	r.backoff = workqueue.NewTypedItemExponentialFailureRateLimiter[reconcile.Request](opts.BackoffBase, opts.BackoffMax)
	r.events = make(chan event.TypedGenericEvent[*v1alpha1.EgressProxy], 64)
	r.notifier = newNotifier(r.events, proxyKey)
	if err := mgr.Add(r.notifier); err != nil {
		return err
	}
	if r.Health != nil {
		r.Health.notify = r.notify
	}
	return ctrl.NewControllerManagedBy(mgr).
		For(&v1alpha1.EgressProxy{}).
		WatchesRawSource(source.Channel(r.events, &handler.TypedEnqueueRequestForObject[*v1alpha1.EgressProxy]{})).
		Named("egressproxy").
		WithOptions(crcontroller.Options{MaxConcurrentReconciles: opts.MaxConcurrentReconciles}).
		Complete(r)
}

// notify asks for a reconcile of key (the health runnable calls it when a
// proxy's or an entry's health changed). It never blocks, and no request
// is lost (notifier).
func (r *Reconciler) notify(key types.NamespacedName) { r.notifier.add(key) }

// InstanceName is the instance name of the EgressProxy namespace/name.
func InstanceName(key types.NamespacedName) string {
	return egressproxy.NameFromKubernetes(key.Namespace, key.Name)
}

// Reconcile drives one EgressProxy towards its spec. The outcome of every
// library call is decided by its error class (see Outcome).
func (r *Reconciler) Reconcile(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	log := logf.FromContext(ctx)
	var ep v1alpha1.EgressProxy
	if err := r.Client.Get(ctx, req.NamespacedName, &ep); err != nil {
		if apierrors.IsNotFound(err) {
			r.backoff.Forget(req)
			return reconcile.Result{}, nil
		}
		return reconcile.Result{}, err
	}
	if ep.DeletionTimestamp.IsZero() && !controllerutil.ContainsFinalizer(&ep, Finalizer) {
		// The finalizer goes on before any VM exists, so no VM can
		// outlive its object unnoticed (the orphan collector is the
		// safety net for the rest).
		controllerutil.AddFinalizer(&ep, Finalizer)
		if err := r.Client.Update(ctx, &ep); err != nil {
			if apierrors.IsConflict(err) || apierrors.IsNotFound(err) {
				log.V(1).Info("finalizer not added", "err", err)
				return reconcile.Result{RequeueAfter: r.opts.BackoffBase}, nil
			}
			return reconcile.Result{}, err
		}
	}
	orig := ep.DeepCopy()
	res, err := r.reconcile(ctx, log, &ep)
	if !ep.DeletionTimestamp.IsZero() && !controllerutil.ContainsFinalizer(&ep, Finalizer) {
		return res, err // released: the object is gone or going
	}
	if ctx.Err() != nil {
		// The manager stops: the status write would fail too; the next
		// leader's reconcile writes it.
		return reconcile.Result{}, nil
	}
	if uerr := r.writeStatus(ctx, orig, &ep); uerr != nil {
		if apierrors.IsConflict(uerr) || apierrors.IsNotFound(uerr) {
			// A newer version exists (it brings its own reconcile) or
			// the object went away.
			log.V(1).Info("status not written", "err", uerr)
			return reconcile.Result{RequeueAfter: r.opts.BackoffBase}, nil
		}
		return reconcile.Result{}, uerr
	}
	return res, err
}

func (r *Reconciler) writeStatus(ctx context.Context, orig, ep *v1alpha1.EgressProxy) error {
	if statusEqual(orig.Status, ep.Status) {
		return nil
	}
	return r.Client.Status().Patch(ctx, ep, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{}))
}

func statusEqual(a, b v1alpha1.EgressProxyStatus) bool {
	if a.Phase != b.Phase || a.Address != b.Address || a.EgressAddress != b.EgressAddress || a.Health != b.Health || a.Provider != b.Provider ||
		a.Instance != b.Instance || a.SpecDigest != b.SpecDigest || a.ObservedGeneration != b.ObservedGeneration ||
		len(a.Conditions) != len(b.Conditions) {
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

// reconcile does the work on ep (whose status it edits in place).
func (r *Reconciler) reconcile(ctx context.Context, log logr.Logger, ep *v1alpha1.EgressProxy) (reconcile.Result, error) {
	req := reconcile.Request{NamespacedName: client.ObjectKeyFromObject(ep)}
	name := InstanceName(req.NamespacedName)
	ref := egressproxy.Ref{Name: name, UID: string(ep.UID)}
	log = log.WithValues("instance", name)

	if !ep.DeletionTimestamp.IsZero() {
		return r.finalize(ctx, log, req, ep, ref)
	}
	ep.Status.Instance = name
	ep.Status.ObservedGeneration = ep.Generation

	// A changed spec.provider moves the proxy: the VM on the old entry
	// goes first (a failure there is handled like any other).
	if old := ep.Status.Provider; old != "" && old != ep.Spec.Provider {
		if oc, ok := r.Entries[old]; ok {
			if err := oc.Delete(ctx, ref); err != nil && egressproxy.Code(err) != egressproxy.NotFound {
				return r.failed(log, req, ep, err)
			}
		}
		log.Info("moved off the old provider entry", "entry", old)
		r.forgetHealth(req.NamespacedName, name)
		ep.Status.Provider, ep.Status.SpecDigest, ep.Status.Address, ep.Status.EgressAddress = "", "", "", ""
	}

	pc, ok := r.Entries[ep.Spec.Provider]
	if !ok {
		ep.Status.Phase = v1alpha1.PhasePending
		r.setCondition(ep, v1alpha1.ConditionReady, metav1.ConditionFalse, ReasonUnknownProvider,
			fmt.Sprintf("the operator has no provider entry %q", ep.Spec.Provider))
		r.backoff.Forget(req)
		// An operator restarted with the entry configured reconciles
		// every object anyway; the slow retry covers the rest.
		return reconcile.Result{RequeueAfter: r.opts.PermanentRetry}, nil
	}
	r.providerCondition(ep, ep.Spec.Provider)

	spec, proxy, err := r.desiredSpec(ctx, ep, name)
	if err != nil {
		ep.Status.Phase = v1alpha1.PhasePending
		if egressproxy.Code(err) == egressproxy.Transient {
			return r.failed(log, req, ep, err)
		}
		r.setCondition(ep, v1alpha1.ConditionReady, metav1.ConditionFalse, reasonOf(err), err.Error())
		r.backoff.Forget(req)
		return reconcile.Result{RequeueAfter: r.opts.PermanentRetry}, nil
	}
	digest := spec.Digest()

	inst, err := pc.Get(ctx, ref)
	switch {
	case egressproxy.Code(err) == egressproxy.NotFound:
		ep.Status.Provider = ep.Spec.Provider // from now on a VM may exist there
		// A SpecConflict here (another spec's VM appeared between Get
		// and Create) is left to failed: Permanent, no hot loop; the
		// next reconcile's Get sees the drift and recreates.
		inst, err = pc.Create(ctx, spec)
		if err != nil {
			return r.failed(log, req, ep, err)
		}
		log.Info("created", "entry", ep.Spec.Provider)
	case err != nil:
		return r.failed(log, req, ep, err)
	case inst.State == egressproxy.StateStopped && (inst.SpecDigest == "" || inst.SpecDigest == digest):
		// Get cannot tell a VM someone stopped from one an interrupted
		// Create defined but never started; Create can: it completes the
		// latter (and returns the former as it is).
		if inst, err = pc.Create(ctx, spec); err != nil {
			return r.failed(log, req, ep, err)
		}
	case inst.SpecDigest != "" && inst.SpecDigest != digest:
		return r.drift(ctx, log, req, ep, pc, inst, proxy)
	}
	ep.Status.Provider = ep.Spec.Provider
	ep.Status.SpecDigest = digest
	r.backoff.Forget(req)
	return r.observed(req.NamespacedName, ep, inst, proxy), nil
}

// drift handles a VM that runs another spec than ep's (port, image,
// machine type or credentials changed). A VM's spec cannot be changed in
// place, so the choice is to recreate it (recreate), except for a pool's
// child, which its pool replaces before it removes it (superseded).
func (r *Reconciler) drift(ctx context.Context, log logr.Logger, req reconcile.Request, ep *v1alpha1.EgressProxy, pc *egressproxy.Client, inst egressproxy.Instance, proxy proxyConfig) (reconcile.Result, error) {
	if poolChild(ep) {
		return r.superseded(log, req, ep, inst, proxy)
	}
	return r.recreate(ctx, log, req, ep, pc, egressproxy.Ref{Name: InstanceName(req.NamespacedName), UID: string(ep.UID)})
}

// recreate deletes the VM that runs an outdated spec; the next reconcile
// creates it anew.
func (r *Reconciler) recreate(ctx context.Context, log logr.Logger, req reconcile.Request, ep *v1alpha1.EgressProxy, pc *egressproxy.Client, ref egressproxy.Ref) (reconcile.Result, error) {
	log.Info("spec drift: deleting the VM to recreate it", "entry", ep.Spec.Provider)
	r.forgetHealth(req.NamespacedName, ref.Name)
	ep.Status.Phase = v1alpha1.PhasePending
	ep.Status.Address, ep.Status.SpecDigest, ep.Status.EgressAddress = "", "", ""
	if err := pc.Delete(ctx, ref); err != nil {
		return r.failed(log, req, ep, err)
	}
	r.setCondition(ep, v1alpha1.ConditionReady, metav1.ConditionFalse, ReasonRecreating, "the spec changed; the VM was deleted and is created again")
	return reconcile.Result{RequeueAfter: time.Millisecond}, nil
}

// poolChild reports whether an EgressProxyPool controls ep.
func poolChild(ep *v1alpha1.EgressProxy) bool {
	ref := metav1.GetControllerOf(ep)
	return ref != nil && ref.Kind == "EgressProxyPool" && ref.APIVersion == v1alpha1.GroupVersion.String()
}

// superseded keeps the VM of a pool's child that runs another spec than
// the child's (a Secret it uses changed, the pool never editing a child's
// spec; or someone edited the child): the pool's revision covers the
// Secrets' contents and the template, so the pool puts a successor
// beside the child and removes it once the successor is Healthy, as
// after a template change. Meanwhile the VM serves on and is probed with
// the credentials and TLS it was registered with (those of its spec); a
// leader that never registered it has only the current ones, and a
// probe the VM refuses makes it Unhealthy, which the pool replaces all
// the same.
func (r *Reconciler) superseded(log logr.Logger, req reconcile.Request, ep *v1alpha1.EgressProxy, inst egressproxy.Instance, pc proxyConfig) (reconcile.Result, error) {
	if r.Health != nil {
		if m, ok := r.Health.member(inst.Name); ok && m.UID == ep.UID {
			pc.creds, pc.probeTLS = m.Credentials, m.TLS
		}
	}
	if ep.Status.SpecDigest != inst.SpecDigest {
		log.Info("spec drift of a pool's child: the VM is kept until its pool replaces it", "entry", ep.Spec.Provider)
	}
	ep.Status.Provider = ep.Spec.Provider
	ep.Status.SpecDigest = inst.SpecDigest
	r.backoff.Forget(req)
	res := r.observed(req.NamespacedName, ep, inst, pc)
	if c := meta.FindStatusCondition(ep.Status.Conditions, v1alpha1.ConditionReady); c != nil && c.Status == metav1.ConditionTrue {
		r.setCondition(ep, v1alpha1.ConditionReady, metav1.ConditionTrue, ReasonSuperseded,
			"the VM at "+ep.Status.Address+" runs an earlier spec than the object's (a Secret it uses changed, or the object was edited); its pool replaces it before removing it")
	}
	return res, nil
}

// finalize deletes the VM of an object being deleted, then drops the
// finalizer.
func (r *Reconciler) finalize(ctx context.Context, log logr.Logger, req reconcile.Request, ep *v1alpha1.EgressProxy, ref egressproxy.Ref) (reconcile.Result, error) {
	if !controllerutil.ContainsFinalizer(ep, Finalizer) {
		return reconcile.Result{}, nil
	}
	ep.Status.Phase = v1alpha1.PhaseDeleting
	for _, entry := range uniq(ep.Status.Provider, ep.Spec.Provider) {
		pc, ok := r.Entries[entry]
		if !ok {
			continue // no such entry: nothing of ours can be there
		}
		// Delete of a missing instance succeeds; NotFound is done too.
		if err := pc.Delete(ctx, ref); err != nil && egressproxy.Code(err) != egressproxy.NotFound {
			return r.failed(log, req, ep, err)
		}
	}
	r.forgetHealth(req.NamespacedName, ref.Name)
	controllerutil.RemoveFinalizer(ep, Finalizer)
	if err := r.Client.Update(ctx, ep); err != nil {
		if apierrors.IsNotFound(err) {
			return reconcile.Result{}, nil
		}
		if apierrors.IsConflict(err) {
			return reconcile.Result{RequeueAfter: r.opts.BackoffBase}, nil
		}
		return reconcile.Result{}, err
	}
	r.backoff.Forget(req)
	log.Info("deleted")
	return reconcile.Result{}, nil
}

func uniq(a, b string) []string {
	switch {
	case a == "":
		return []string{b}
	case a == b || b == "":
		return []string{a}
	}
	return []string{a, b}
}

// failed records err on ep and decides the requeue by err's class (see
// Outcome).
func (r *Reconciler) failed(log logr.Logger, req reconcile.Request, ep *v1alpha1.EgressProxy, err error) (reconcile.Result, error) {
	o := Outcome(err)
	r.setCondition(ep, v1alpha1.ConditionReady, metav1.ConditionFalse, o.Reason, err.Error())
	if ep.Status.Phase == "" {
		ep.Status.Phase = v1alpha1.PhasePending
	}
	switch {
	case o.Stop:
		// The manager is stopping (our context ended): no requeue; the
		// next leader reconciles every object.
		return reconcile.Result{}, nil
	case o.Backoff:
		d := r.backoff.When(req)
		log.V(1).Info("retrying with backoff", "err", err, "after", d)
		return reconcile.Result{RequeueAfter: d}, nil
	default:
		r.backoff.Forget(req)
		log.Info("needs a human: not retried until the object changes", "err", err, "retryAfter", r.opts.PermanentRetry)
		return reconcile.Result{RequeueAfter: r.opts.PermanentRetry}, nil
	}
}

// observed writes what inst says into ep's status and registers the proxy
// with the health runnable.
func (r *Reconciler) observed(key types.NamespacedName, ep *v1alpha1.EgressProxy, inst egressproxy.Instance, pc proxyConfig) reconcile.Result {
	prevAddr := ep.Status.Address
	ep.Status.Address = inst.Address()
	switch inst.State {
	case egressproxy.StateRunning:
		ep.Status.Phase = v1alpha1.PhaseRunning
	case egressproxy.StateProvisioning:
		ep.Status.Phase = v1alpha1.PhaseProvisioning
	case egressproxy.StateStopped:
		ep.Status.Phase = v1alpha1.PhaseStopped
	case egressproxy.StateFailed:
		ep.Status.Phase = v1alpha1.PhaseFailed
	}
	reason := string(inst.State)
	if reason == "" {
		reason = "Unknown"
	}
	if inst.State == egressproxy.StateRunning && ep.Status.Address != "" {
		r.setCondition(ep, v1alpha1.ConditionReady, metav1.ConditionTrue, reason, "the VM runs the current spec at "+ep.Status.Address)
	} else {
		r.setCondition(ep, v1alpha1.ConditionReady, metav1.ConditionFalse, reason, "the VM exists but has no proxy address yet")
	}
	if r.Health != nil {
		r.Health.Register(Member{Key: key, UID: ep.UID, ID: inst.Name, Addr: ep.Status.Address, Credentials: pc.creds, TLS: pc.probeTLS})
		h := r.Health.ProxyHealth(inst.Name, ep.Status.Address)
		if keepHealth(ep, prevAddr, h) {
			// This replica's tracker has not decided the proxy yet, and
			// the status holds a decision about the same address: a new
			// leader's, or one of this replica before its tracker
			// forgot the proxy. It stands until the tracker decides, so
			// that a failover does not flap every object's health (and
			// its EndpointSlices) through Unknown.
			if c := meta.FindStatusCondition(ep.Status.Conditions, v1alpha1.ConditionHealthy); c != nil {
				r.setCondition(ep, v1alpha1.ConditionHealthy, c.Status, c.Reason, c.Message)
			}
		} else {
			ep.Status.Health = h.Health
			ep.Status.EgressAddress = h.EgressAddress
			st := metav1.ConditionFalse
			if h.Health == v1alpha1.HealthHealthy {
				st = metav1.ConditionTrue
			}
			r.setCondition(ep, v1alpha1.ConditionHealthy, st, h.Reason, h.Message)
		}
	}
	if ep.Status.Phase == v1alpha1.PhaseRunning && ep.Status.Address != "" {
		return reconcile.Result{RequeueAfter: 4 * r.opts.PollInterval}
	}
	return reconcile.Result{RequeueAfter: r.opts.PollInterval}
}

// keepHealth reports whether ep's health in status stands although the
// tracker says h: the tracker has not decided (Pending), the proxy's
// address is the one the status had (prevAddr), and the status holds a
// decision (Healthy or Unhealthy, with its condition).
func keepHealth(ep *v1alpha1.EgressProxy, prevAddr string, h ProxyStatus) bool {
	if h.Reason != ReasonPending || prevAddr == "" || prevAddr != ep.Status.Address {
		return false
	}
	if ep.Status.Health != v1alpha1.HealthHealthy && ep.Status.Health != v1alpha1.HealthUnhealthy {
		return false
	}
	return meta.FindStatusCondition(ep.Status.Conditions, v1alpha1.ConditionHealthy) != nil
}

func (r *Reconciler) forgetHealth(key types.NamespacedName, name string) {
	if r.Health != nil {
		r.Health.Unregister(key, name)
	}
}

// providerCondition copies the entry's last Check into ep's conditions.
func (r *Reconciler) providerCondition(ep *v1alpha1.EgressProxy, entry string) {
	if r.Health == nil {
		return
	}
	h, ok := r.Health.EntryHealth(entry)
	if !ok {
		return
	}
	if h.Reachable {
		r.setCondition(ep, v1alpha1.ConditionProviderReachable, metav1.ConditionTrue, ReasonReachable, "entry "+entry+" answered")
		return
	}
	reason := string(h.Reason)
	if reason == "" {
		reason = string(egressproxy.ReasonUnknown)
	}
	r.setCondition(ep, v1alpha1.ConditionProviderReachable, metav1.ConditionFalse, reason, h.Message)
}

func (r *Reconciler) setCondition(ep *v1alpha1.EgressProxy, typ string, st metav1.ConditionStatus, reason, msg string) {
	if len(msg) > 1024 {
		msg = msg[:1024]
	}
	meta.SetStatusCondition(&ep.Status.Conditions, metav1.Condition{
		Type: typ, Status: st, Reason: reason, Message: msg, ObservedGeneration: ep.Generation,
	})
}

// desiredSpec is the egressproxy.Spec of ep, its user-data rendered from
// the object's proxy description and Secrets (proxyConfig).
func (r *Reconciler) desiredSpec(ctx context.Context, ep *v1alpha1.EgressProxy, name string) (egressproxy.Spec, proxyConfig, error) {
	pc, err := r.proxyConfig(ctx, ep)
	if err != nil {
		return egressproxy.Spec{}, pc, err
	}
	spec := egressproxy.Spec{
		Name:        name,
		UID:         string(ep.UID),
		Port:        int(ep.Spec.Port),
		ImageKey:    ep.Spec.Image,
		MachineType: ep.Spec.MachineType,
		UserData:    pc.userData,
	}
	if err := spec.Validate(); err != nil {
		return egressproxy.Spec{}, pc, err
	}
	return spec, pc, nil
}
