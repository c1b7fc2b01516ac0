package egressproxy_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/memprovider"
)

// The lifecycle of one proxy through the portable client: Create (idempotent
// on the UID), Get (read back), List, Delete (idempotent).
func Example() {
	ctx := context.Background()
	client := memprovider.New(nil)
	defer client.Close()

	spec := egressproxy.Spec{Name: "proxy-1", UID: "7f9c2a1e-uid-of-my-object"}
	inst, err := client.Create(ctx, spec)
	if err != nil {
		fmt.Println("create:", err)
		return
	}
	fmt.Println("created:", inst.Name, inst.State)

	// Creating again with the same UID returns the same instance.
	again, _ := client.Create(ctx, spec)
	fmt.Println("same instance:", again.UID == inst.UID && again.CreatedAt.Equal(inst.CreatedAt))

	got, _ := client.Get(ctx, spec.Ref())
	fmt.Println("read back:", got.Name, got.State, got.Port)

	list, _ := client.List(ctx)
	fmt.Println("listed:", len(list))

	fmt.Println("delete:", client.Delete(ctx, spec.Ref()))
	fmt.Println("delete again:", client.Delete(ctx, spec.Ref()))

	_, err = client.Get(ctx, spec.Ref())
	fmt.Println("gone:", errors.Is(err, egressproxy.ErrNotFound))
	// Output:
	// created: proxy-1 Running
	// same instance: true
	// read back: proxy-1 Running 3128
	// listed: 1
	// delete: <nil>
	// delete again: <nil>
	// gone: true
}

// Map error classes to what a reconcile loop does next: Transient and
// DeadlineExceeded requeue with backoff, Permanent waits for a human (or a
// changed spec), NotFound means the instance must be (re)created.
func Example_errorClasses() {
	ctx := context.Background()
	client := memprovider.New(nil)

	var p *memprovider.Control

	client.As(&p)
	defer client.Close()

	decide := func(err error) string {
		switch egressproxy.Code(err) {
		case egressproxy.OK:
			return "done"
		case egressproxy.NotFound:
			return "recreate"
		case egressproxy.Permanent:
			return "report, do not retry"
		case egressproxy.Canceled:
			return "stop"
		default: // Transient, DeadlineExceeded, Unknown
			return "requeue with backoff"
		}
	}

	// A bad spec is Permanent and names the field.
	_, err := client.Create(ctx, egressproxy.Spec{Name: "Proxy_1", UID: "u1"})
	fmt.Println(decide(err), "|", err)

	// The backend is busy once: Transient.
	p.InjectFault(memprovider.OpCreate, memprovider.Fault{Code: egressproxy.Transient, Err: errors.New("hypervisor busy"), Times: 1})
	_, err = client.Create(ctx, egressproxy.Spec{Name: "proxy-1", UID: "u1"})
	fmt.Println(decide(err), "|", err)

	// The retry succeeds.
	_, err = client.Create(ctx, egressproxy.Spec{Name: "proxy-1", UID: "u1"})
	fmt.Println(decide(err))

	// The name is taken by another object: Permanent.
	_, err = client.Create(ctx, egressproxy.Spec{Name: "proxy-1", UID: "u2"})
	fmt.Println(decide(err), "|", errors.Is(err, egressproxy.ErrPermanent))

	// Missing: NotFound.
	_, err = client.Get(ctx, egressproxy.Ref{Name: "proxy-2", UID: "u3"})
	fmt.Println(decide(err))

	// Every error names the operation and the instance.
	var op *egressproxy.OpError
	if errors.As(err, &op) {
		fmt.Println(op.Op, op.Instance)
	}
	// Output:
	// report, do not retry | egressproxy create: invalid Name "Proxy_1": may contain only lowercase letters, digits and '-'
	// requeue with backoff | egressproxy create proxy-1: hypervisor busy
	// done
	// report, do not retry | true
	// recreate
	// get proxy-2
}

// Spec drift is visible: Create of an existing UID with another spec is
// ErrSpecConflict (Permanent) and changes nothing; Instance.SpecDigest says
// which spec an instance was created from.
func Example_specConflict() {
	ctx := context.Background()
	client := memprovider.New(nil)
	defer client.Close()

	spec := egressproxy.Spec{Name: "proxy-1", UID: "u1"}
	inst, _ := client.Create(ctx, spec)
	fmt.Println(inst.SpecDigest == spec.Digest())

	spec.Port = 8080 // the embedder's object changed
	_, err := client.Create(ctx, spec)
	fmt.Println(errors.Is(err, egressproxy.ErrSpecConflict), egressproxy.Code(err))
	fmt.Println(err)

	// To apply the new spec: delete the instance and create it again.
	_ = client.Delete(ctx, inst.Ref)
	inst, err = client.Create(ctx, spec)
	fmt.Println(err, inst.Port, inst.SpecDigest == spec.Digest())
	// Output:
	// true
	// true Permanent
	// egressproxy create proxy-1: memprovider: instance exists with another spec (Port 3128, now 8080)
	// <nil> 8080 true
}

// Orphan garbage collection: List returns every instance the provider entry
// owns with its UID, so the embedder deletes those no object wants any more.
func ExampleClient_List_orphans() {
	ctx := context.Background()
	client := memprovider.New(nil)
	defer client.Close()
	for _, s := range []egressproxy.Spec{
		{Name: "proxy-a", UID: "uid-a"},
		{Name: "proxy-b", UID: "uid-b"}, // its object was deleted while we were down
	} {
		client.Create(ctx, s)
	}
	wanted := map[string]bool{"uid-a": true} // UIDs of objects that still exist

	list, err := client.List(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, inst := range list {
		if !wanted[inst.UID] {
			fmt.Println("deleting orphan", inst.Name, client.Delete(ctx, inst.Ref))
		}
	}
	list, _ = client.List(ctx)
	fmt.Println("left:", len(list), list[0].Name)
	// Output:
	// deleting orphan proxy-b <nil>
	// left: 1 proxy-a
}

// Check reports provider health without creating anything; an unhealthy
// backend is a Health with a Reason, not an error.
func ExampleClient_Check() {
	ctx := context.Background()
	client := memprovider.New(nil)

	var p *memprovider.Control

	client.As(&p)
	defer client.Close()

	h, _ := client.Check(ctx)
	fmt.Println(h.Reachable, h.Details["backend"])

	p.InjectFault(memprovider.OpCheck, memprovider.Fault{Code: egressproxy.Transient, Reason: egressproxy.ReasonUnauthorized, Err: errors.New("ssh: unable to authenticate"), Times: 1})
	h, err := client.Check(ctx)
	fmt.Println(h.Reachable, h.Reason, h.Message, err)
	// Output:
	// true memory
	// false Unauthorized ssh: unable to authenticate <nil>
}

// With ServeProxies each Running instance is a real HTTP CONNECT proxy on
// loopback, so probes and clients work without a hypervisor. Instances
// report Provisioning (no address) until ProvisionDelay has passed.
func Example_servedProxies() {
	ctx := context.Background()
	client := memprovider.New(&memprovider.Options{ServeProxies: true,
		ProvisionDelay: 50 * time.Millisecond})
	defer client.Close()

	spec := egressproxy.Spec{Name: "proxy-1", UID: "u1"}
	inst, _ := client.Create(ctx, spec)
	fmt.Println(inst.State, inst.Address() == "")
	inst, err := client.WaitRunning(ctx, spec.Ref(), &egressproxy.WaitOptions{Interval: 10 * time.Millisecond})
	if err != nil {
		fmt.Println(err)
		return
	}
	host, _, _ := net.SplitHostPort(inst.Address())
	fmt.Println(inst.State, host, inst.AddressSource)

	conn, err := net.Dial("tcp", inst.Address())
	if err == nil {
		fmt.Println("proxy accepts connections")
		conn.Close()
	}
	// Output:
	// Provisioning true
	// Running 127.0.0.1 listener
	// proxy accepts connections
}
