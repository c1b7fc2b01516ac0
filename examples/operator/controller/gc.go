package controller

import (
	"context"
	"time"

	"github.com/go-logr/logr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
)

// DefaultGCInterval is how often the orphan collector runs when
// GCOptions.Interval is zero.
const DefaultGCInterval = 10 * time.Minute

// GCOptions configure an OrphanCollector.
type GCOptions struct {
	Interval time.Duration // zero: DefaultGCInterval
	Logger   logr.Logger
}

// OrphanCollector is a manager Runnable (leader only) that deletes the VMs
// of this operator (kvm2's owner isolation: List returns only the entry's
// owner's instances) whose UID belongs to no EgressProxy, or to one that
// has moved to another entry. It is the safety net for a VM created by a
// reconcile that was cut off before its object's finalizer could matter
// (object deleted while the operator was down with the finalizer removed by
// hand, a crash between Create and a status write on a move, ...).
type OrphanCollector struct {
	entries map[string]*egressproxy.Client
	reader  client.Reader
	opts    GCOptions
	log     logr.Logger
}

// NewOrphanCollector returns the collector over entries. reader must read
// from the apiserver, not a cache (the manager's APIReader): see Collect.
func NewOrphanCollector(entries map[string]*egressproxy.Client, reader client.Reader, opts GCOptions) *OrphanCollector {
	if opts.Interval <= 0 {
		opts.Interval = DefaultGCInterval
	}
	log := opts.Logger
	if log.GetSink() == nil {
		log = logr.Discard()
	}
	return &OrphanCollector{entries: entries, reader: reader, opts: opts, log: log.WithName("gc")}
}

// NeedLeaderElection makes the collector run on the leader only.
func (g *OrphanCollector) NeedLeaderElection() bool { return true }

// Start collects every Interval until ctx ends.
func (g *OrphanCollector) Start(ctx context.Context) error {
	tick := time.NewTicker(g.opts.Interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		if _, err := g.Collect(ctx); err != nil && ctx.Err() == nil {
			g.log.V(1).Info("collection incomplete; next round retries", "err", err)
		}
	}
}

// Collect runs one collection and returns the instances it deleted (as
// entry/name).
//
// The order matters: each entry's instances are listed before the objects
// are, from the apiserver. A listed VM was created by a reconcile of an
// object that existed before the VM did, so that object is in the later
// list unless it is gone, and no VM being created right now can be taken
// for an orphan.
func (g *OrphanCollector) Collect(ctx context.Context) ([]string, error) {
	insts := map[string][]egressproxy.Instance{}
	var firstErr error
	for entry, c := range g.entries {
		l, err := c.List(ctx)
		if err != nil {
			if firstErr == nil {
				firstErr = err
			}
			continue // this entry's turn comes next round
		}
		insts[entry] = l
	}
	var eps v1alpha1.EgressProxyList
	if err := g.reader.List(ctx, &eps); err != nil {
		return nil, err
	}
	owner := map[string]*v1alpha1.EgressProxy{}
	for i := range eps.Items {
		owner[string(eps.Items[i].UID)] = &eps.Items[i]
	}
	var deleted []string
	for entry, l := range insts {
		for _, inst := range l {
			ep, ok := owner[inst.UID]
			if ok && (ep.Spec.Provider == entry || ep.Status.Provider == entry) {
				continue
			}
			log := g.log.WithValues("entry", entry, "instance", inst.Name)
			if err := g.entries[entry].Delete(ctx, inst.Ref); err != nil {
				log.V(1).Info("orphan not deleted", "err", err)
				if firstErr == nil {
					firstErr = err
				}
				continue
			}
			log.Info("deleted orphan", "uid", inst.UID)
			deleted = append(deleted, entry+"/"+inst.Name)
		}
	}
	return deleted, firstErr
}
