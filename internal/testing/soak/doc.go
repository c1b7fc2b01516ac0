// Package soak is the chaos soak: a model operator drives
// provider entries on the lab's hosts through the public egressproxy.Client
// while faults are injected, and invariants are checked all the time.
//
// This package holds what does not need a lab: the seeded schedule of
// operations and faults (the same seed gives the same schedule), the event
// log (JSON lines), the invariant checkers and the report writer
// (docs/soak.md). The driver that runs a schedule on the lab is TestSoak
// (build tag integration, run by `make soak`).
package soak
