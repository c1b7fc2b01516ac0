package controller

import (
	"context"
	"sync"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"

	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
)

// notifier carries the health runnable's reconcile requests to the
// controller's channel source without losing one: add never blocks (it
// puts the key in a set, so a key asked for twice before it is sent is
// sent once), and Start moves the set into the channel, waiting for the
// controller to take each. A health round that changes N proxies at once
// asks for N reconciles; a bounded channel written without waiting drops
// all but its capacity, and those objects' status then waits for their
// next poll (a minute once Running: docs/scale.md, N=500).
type notifier[T client.Object] struct {
	out    chan<- event.TypedGenericEvent[T]
	object func(types.NamespacedName) T // the event's object for a key
	wake   chan struct{}                // buffered, 1

	mu      sync.Mutex
	pending map[types.NamespacedName]bool
	order   []types.NamespacedName
}

func newNotifier[T client.Object](out chan<- event.TypedGenericEvent[T], object func(types.NamespacedName) T) *notifier[T] {
	return &notifier[T]{out: out, object: object, wake: make(chan struct{}, 1), pending: map[types.NamespacedName]bool{}}
}

// proxyKey and poolKey are the objects of the reconcilers' events.
func proxyKey(k types.NamespacedName) *v1alpha1.EgressProxy {
	return &v1alpha1.EgressProxy{ObjectMeta: metav1.ObjectMeta{Namespace: k.Namespace, Name: k.Name}}
}

func poolKey(k types.NamespacedName) *v1alpha1.EgressProxyPool {
	return &v1alpha1.EgressProxyPool{ObjectMeta: metav1.ObjectMeta{Namespace: k.Namespace, Name: k.Name}}
}

// add asks for a reconcile of key. It never blocks.
func (n *notifier[T]) add(key types.NamespacedName) {
	n.mu.Lock()
	if !n.pending[key] {
		n.pending[key] = true
		n.order = append(n.order, key)
	}
	n.mu.Unlock()
	select {
	case n.wake <- struct{}{}:
	default:
	}
}

// next takes the oldest pending key.
func (n *notifier[T]) next() (types.NamespacedName, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if len(n.order) == 0 {
		return types.NamespacedName{}, false
	}
	key := n.order[0]
	n.order = n.order[1:]
	delete(n.pending, key)
	if len(n.order) == 0 {
		n.order = nil // let the backing array go after a burst
	}
	return key, true
}

// NeedLeaderElection: it feeds a reconciler, which runs on the leader.
func (n *notifier[T]) NeedLeaderElection() bool { return true }

// Start sends the pending keys, in the order they were asked for, until
// ctx ends.
func (n *notifier[T]) Start(ctx context.Context) error {
	for {
		for {
			key, ok := n.next()
			if !ok {
				break
			}
			ev := event.TypedGenericEvent[T]{Object: n.object(key)}
			select {
			case n.out <- ev:
			case <-ctx.Done():
				return nil
			}
		}
		select {
		case <-n.wake:
		case <-ctx.Done():
			return nil
		}
	}
}
