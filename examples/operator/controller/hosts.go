package controller

import (
	"context"
	"fmt"
	"slices"

	"github.com/go-logr/logr"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
)

// The label on every EgressProxyHost the operator writes. Only objects
// with it are deleted when their entry is no longer configured: one made
// by hand stays.
const (
	ManagedByLabel = "app.kubernetes.io/managed-by"
	ManagedBy      = "egressproxy-operator"
)

// +kubebuilder:rbac:groups=egressproxy.dev,resources=egressproxyhosts,verbs=get;list;create;delete
// +kubebuilder:rbac:groups=egressproxy.dev,resources=egressproxyhosts/status,verbs=get;update

// hostWriter keeps one EgressProxyHost per configured entry: it writes each
// Check's result into the entry's object (creating it first) and deletes
// the operator's objects of entries that are no longer configured. It
// reads straight from the apiserver, so the operator keeps no cache of
// these objects.
type hostWriter struct {
	c       client.Client // writes
	r       client.Reader // reads
	entries []string      // configured
	log     logr.Logger
	pruned  bool // the objects of removed entries are gone
}

// newHostWriter returns a hostWriter for the configured entries that writes
// through c and reads through r (the manager's APIReader).
func newHostWriter(c client.Client, r client.Reader, entries []string, log logr.Logger) *hostWriter {
	if log.GetSink() == nil {
		log = logr.Discard()
	}
	return &hostWriter{c: c, r: r, entries: slices.Sorted(slices.Values(entries)), log: log.WithName("hosts")}
}

// prune deletes the operator's EgressProxyHost objects whose entry is not
// configured. Once it succeeded it does nothing: the entries change only
// with a restart.
func (w *hostWriter) prune(ctx context.Context) error {
	if w.pruned {
		return nil
	}
	var l v1alpha1.EgressProxyHostList
	if err := w.r.List(ctx, &l, client.MatchingLabels{ManagedByLabel: ManagedBy}); err != nil {
		return fmt.Errorf("list hosts: %w", err)
	}
	for i := range l.Items {
		h := &l.Items[i]
		if slices.Contains(w.entries, h.Name) {
			continue
		}
		if err := w.c.Delete(ctx, h, client.Preconditions{UID: &h.UID}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete host %s: %w", h.Name, err)
		}
		w.log.Info("deleted the host of an entry no longer configured", "entry", h.Name)
	}
	w.pruned = true
	return nil
}

// write records h, the result of entry's last Check, in entry's object.
func (w *hostWriter) write(ctx context.Context, entry string, h egressproxy.Health) error {
	var obj v1alpha1.EgressProxyHost
	err := w.r.Get(ctx, client.ObjectKey{Name: entry}, &obj)
	if apierrors.IsNotFound(err) {
		obj = v1alpha1.EgressProxyHost{ObjectMeta: metav1.ObjectMeta{Name: entry, Labels: map[string]string{ManagedByLabel: ManagedBy}}}
		err = w.c.Create(ctx, &obj)
	}
	if err != nil {
		return err
	}
	setHostStatus(&obj, h)
	return w.c.Status().Update(ctx, &obj)
}

// setHostStatus sets obj's status from h: the Ready condition (its
// transition time kept while its status stays), the details, the
// capacity and the check's time.
func setHostStatus(obj *v1alpha1.EgressProxyHost, h egressproxy.Health) {
	c := metav1.Condition{Type: v1alpha1.ConditionHostReady, Status: metav1.ConditionTrue, Reason: ReasonReachable,
		Message: "the entry answered its last Check", ObservedGeneration: obj.Generation}
	if !h.Reachable {
		c.Status, c.Reason, c.Message = metav1.ConditionFalse, string(h.Reason), h.Message
		if c.Reason == "" {
			c.Reason = string(egressproxy.ReasonUnknown)
		}
	}
	if len(c.Message) > 1024 {
		c.Message = c.Message[:1024]
	}
	meta.SetStatusCondition(&obj.Status.Conditions, c)
	obj.Status.Details = h.Details
	obj.Status.Capacity = nil
	if cp := h.Capacity; cp != nil {
		obj.Status.Capacity = &v1alpha1.HostCapacity{
			PoolAvailable:   *resource.NewQuantity(cp.PoolAvailableBytes, resource.BinarySI),
			MemoryAvailable: *resource.NewQuantity(cp.MemoryAvailableBytes, resource.BinarySI),
			CPUs:            int32(min(cp.CPUs, 1<<31-1)),
			Instances:       int32(min(cp.Instances, 1<<31-1)),
		}
	}
	obj.Status.LastCheckTime = nil
	if !h.CheckedAt.IsZero() {
		t := metav1.NewTime(h.CheckedAt)
		obj.Status.LastCheckTime = &t
	}
}
