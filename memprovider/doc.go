// Package memprovider is an in-memory provider entry: the embedded default
// of the examples, and a backend for an embedder's own tests. New returns
// the portable *egressproxy.Client over it.
//
// It keeps instances in a map and copies every value in and out, validates
// input exactly as a real backend must, honours contexts, records every
// instance's Spec.Digest and reports a Create of an existing UID with another
// spec as egressproxy.ErrSpecConflict. Its Control, reached with Client.As,
// makes it misbehave on purpose: InjectFault (an error of a class, a delay,
// N times), SetState (Stopped, Failed), CorruptImage.
//
// With Options.ServeProxies every Running instance serves a real HTTP
// CONNECT proxy on 127.0.0.1, or on Options.ProxyAddress (Instance.IP and
// Instance.Port are that listener), so health probes and anything else an embedder does with a
// proxy work for real without a hypervisor. The listener is closed when the
// instance is deleted, stops running, or the entry is closed.
//
// # The guest description
//
// A served proxy enforces the description that package guest rendered
// into the instance's Spec.UserData, as the guest's Squid would: only
// CONNECT, only from the allowed client ranges (403 otherwise), only with
// a user's credentials (407 otherwise), only to the allowed destinations
// (403 otherwise), and TLS only when the description has a certificate. It
// reads the description back from the user-data itself, so an embedder's
// tests exercise the user-data its guests get. Create refuses (Permanent)
// a description it cannot read or one whose port is not the Spec's.
// Without a description (no user-data, or user-data of another kind) a
// served proxy tunnels CONNECT from anyone to loopback targets only.
//
// Nothing persists: everything is lost on Close. One New is one entry.
//
// # Images
//
// It manages images (Client.ListImages, VerifyImage, EvictImage) over a
// simple notion: the image keys are Options.Images (every valid key when
// empty); the base of a key is stored by the first Create that uses it (a
// few bytes and their sha256), is used by the instances created from it,
// verifies unless Control.CorruptImage changed it, and can be evicted only
// while no instance uses it.
package memprovider
