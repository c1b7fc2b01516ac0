package controller

import (
	"maps"
	"slices"
	"time"

	"github.com/go-logr/logr"
	ctrl "sigs.k8s.io/controller-runtime"

	"github.com/egressproxy/egressproxy"
)

// Config is everything Setup needs besides the manager.
type Config struct {
	Entries map[string]*egressproxy.Client
	// EntryLabels are the entries file's labels by entry, which a pool's
	// entry selector matches (LoadEntriesWithLabels).
	EntryLabels map[string]map[string]string
	Reconciler  Options
	// Pool configures the EgressProxyPool reconciler; its Resync is the
	// health interval when zero.
	Pool   PoolOptions
	Health HealthOptions
	GC     GCOptions
	Logger logr.Logger
}

// Setup adds the reconciler, the pool reconciler, the health runnable
// (which also keeps the entries' EgressProxyHost objects) and the orphan
// collector to mgr. The manager should run with leader election: all of
// them run on the leader only.
func Setup(mgr ctrl.Manager, cfg Config) (*Reconciler, *OrphanCollector, error) {
	log := cfg.Logger
	if log.GetSink() == nil {
		log = logr.Discard()
	}
	ho := cfg.Health
	if ho.Logger.GetSink() == nil {
		ho.Logger = log
	}
	if ho.Events == nil {
		ho.Events = mgr.GetEventRecorder(EventSource)
	}
	hr, err := NewHealthRunnable(cfg.Entries, ho)
	if err != nil {
		return nil, nil, err
	}
	hr.hosts = newHostWriter(mgr.GetClient(), mgr.GetAPIReader(), slices.Collect(maps.Keys(cfg.Entries)), ho.Logger)
	r := &Reconciler{Client: mgr.GetClient(), APIReader: mgr.GetAPIReader(), Entries: cfg.Entries, Health: hr}
	ro := cfg.Reconciler
	ro.MaxConcurrentReconciles = reconcileWorkers(ro.MaxConcurrentReconciles, len(cfg.Entries))
	if err := r.SetupWithManager(mgr, ro); err != nil {
		return nil, nil, err
	}
	po := cfg.Pool
	if po.Resync <= 0 {
		po.Resync = hr.opts.Interval
	}
	if po.MaxConcurrentReconciles <= 0 {
		po.MaxConcurrentReconciles = cfg.Reconciler.MaxConcurrentReconciles
	}
	pr := &PoolReconciler{Client: mgr.GetClient(), APIReader: mgr.GetAPIReader(), Entries: cfg.Entries, EntryLabels: cfg.EntryLabels, Health: hr}
	if err := pr.SetupWithManager(mgr, po); err != nil {
		return nil, nil, err
	}
	if err := mgr.Add(hr); err != nil {
		return nil, nil, err
	}
	gco := cfg.GC
	if gco.Logger.GetSink() == nil {
		gco.Logger = log
	}
	gc := NewOrphanCollector(cfg.Entries, mgr.GetAPIReader(), gco)
	if err := mgr.Add(gc); err != nil {
		return nil, nil, err
	}
	return r, gc, nil
}

// DefaultReconcilesPerEntry is how many objects Setup reconciles at once
// per configured entry when Config.Reconciler.MaxConcurrentReconciles is
// zero. A reconcile mostly waits for its entry's round trips (Get, Create:
// tens of milliseconds each to a remote hypervisor), so a fixed number of
// workers makes the time to converge grow with the objects per worker;
// per entry, it stays about the same as entries and objects grow together.
const DefaultReconcilesPerEntry = 4

// reconcileWorkers is how many objects are reconciled at once: the
// configured number, else DefaultReconcilesPerEntry per entry (at least
// DefaultMaxConcurrentReconciles).
func reconcileWorkers(configured, entries int) int {
	if configured > 0 {
		return configured
	}
	return max(DefaultMaxConcurrentReconciles, DefaultReconcilesPerEntry*entries)
}

// EventSource is the reporting controller of the operator's events.
const EventSource = "egressproxy-operator"

// LeaderElectionID is the Lease name the operator's replicas compete for.
const LeaderElectionID = "egressproxy-operator.egressproxy.dev"

// ManagerOptions returns the operator's manager options: leader election
// on, released on cancel (a stopped replica hands over at once instead of
// after the lease duration).
func ManagerOptions(leaderNamespace string) ctrl.Options {
	return ctrl.Options{
		LeaderElection:                true,
		LeaderElectionID:              LeaderElectionID,
		LeaderElectionNamespace:       leaderNamespace,
		LeaderElectionReleaseOnCancel: true,
		GracefulShutdownTimeout:       durationPtr(30 * time.Second),
	}
}

func durationPtr(d time.Duration) *time.Duration { return &d }
