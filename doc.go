// Package egressproxy runs egress proxies (small VMs serving an HTTP CONNECT
// proxy such as Squid) on hypervisors the embedding program owns.
//
// A program opens a provider entry — one hypervisor host and storage pool
// with kvm2.Open, or an in-memory entry with memprovider.New — and holds
// the *Client it returns. The Client validates input once, wraps every
// error once with the operation and the instance, emits one span and one
// log line per operation, and refuses calls after Close.
//
//	c, err := kvm2.Open(ctx, cfg, &kvm2.Options{Logger: log}) // or memprovider.New(nil)
//	defer c.Close()
//	inst, err := c.Create(ctx, egressproxy.Spec{Name: "proxy-1", UID: uid})
//	inst, err = c.Get(ctx, inst.Ref) // read back from the backend every time
//	err = c.Delete(ctx, inst.Ref)    // idempotent
//
// # Error classes
//
// Every error has one class, read with errors.Is or Code: ErrTransient
// (retry later; a retry is safe), ErrPermanent (a person or a new input must
// act), ErrNotFound, and the caller's context.Canceled or
// context.DeadlineExceeded. A fault of the entry itself (credentials
// unreadable or refused, host key unknown or changed, access forbidden) has
// the same class on every operation. ErrSpecConflict (Permanent) says that
// Create found the instance's UID created from another spec;
// Instance.SpecDigest tells which spec (Spec.Digest) an instance was created
// from. Error texts are valid UTF-8 of at most 1 KiB; each layer says only
// what the others do not ("egressproxy get proxy-1: kvm2 hv1: …").
//
// # Create converges
//
// After any interruption of a Create (context ended, Close, link lost,
// process killed), calling Create again with the same spec completes the same
// instance or returns a clear error; concurrent Creates of one spec, even from
// two processes, return that one instance or a Transient error a retry
// resolves.
//
// # Close
//
// Close refuses new calls, closes the entry (which ends calls in flight) and
// waits for them. Every goroutine and connection the library started is gone
// when Close returns. Close is idempotent.
//
// # What the library does not own
//
// Reconcile loops, retry and backoff policy, leader election,
// garbage-collection policy and metrics back-ends belong to the embedding
// program; the library gives it facts (List, Get, Check) and error classes to
// drive them. A backend is written against package driver.
package egressproxy
