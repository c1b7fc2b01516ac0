// Package egressproxy runs egress proxies (small VMs serving an HTTP CONNECT
// proxy such as Squid) on hypervisors the embedding program owns.
//
// # Shape
//
// A provider.Provider manages proxy instances on one backend entry:
// package kvm2 drives a libvirt host over SSH, package memprovider keeps
// instances in memory (the embedded default for examples and tests). The
// portable *Client wraps any Provider: it validates input once, wraps every
// error once with the operation and the instance, emits one span and one log
// line per operation, and refuses calls after Close. The span names and
// attributes of every package are listed in docs/observability.md.
//
// # Lifecycle
//
//	p, err := kvm2.Open(ctx, cfg, nil) // or memprovider.New(nil)
//	c := egressproxy.New(p, &egressproxy.Options{Logger: log})
//	defer c.Close()
//	inst, err := c.Create(ctx, provider.Spec{Name: "proxy-1", UID: uid})
//	inst, err = c.Get(ctx, inst.Ref)   // read back from the backend every time
//	err = c.Delete(ctx, inst.Ref)      // idempotent
//
// # Error codes
//
// Every error carries one class, read with errors.Is or provider.Code:
// provider.ErrTransient (retry later; a retry is safe), provider.ErrPermanent
// (a human or a new input must act), provider.ErrNotFound, and the caller's
// context.Canceled / context.DeadlineExceeded. An explicit class set by the
// library wins over anything inferred from a backend code inside it.
// provider.ErrSpecConflict (classed Permanent) says that Create found the
// instance's UID created from another spec; Instance.SpecDigest tells which
// spec (Spec.Digest) an instance was created from.
//
// Error texts are bounded: valid UTF-8 of at most provider.MaxErrorText bytes,
// caller input quoted with provider.Quote, each layer adding only what the one
// above does not say ("egressproxy get proxy-1: kvm2 hv1: …"); see the
// provider package doc, "Error text".
//
// # Create converges
//
// After any interruption of a Create (context ended, Close, link lost,
// process killed), calling Create again with the same spec completes the same
// instance or returns a clear error; concurrent Creates of one spec, even from
// two processes, return that one instance or a Transient error a retry
// resolves.
//
// # Close rules
//
// Close refuses new calls, closes the provider (which ends calls in flight)
// and waits for them. Every goroutine and connection the library started is
// gone when Close returns. Close is idempotent.
//
// # What the library does not own
//
// Reconcile loops, retry/backoff policy, leader election, garbage-collection
// policy and metrics back-ends belong to the embedding program; the library
// gives it facts (List, Get, Check) and error classes to drive them.
package egressproxy
