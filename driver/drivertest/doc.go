// Package drivertest is the conformance suite every driver.Provider runs.
// RunConformanceTests checks the whole driver contract one subtest at a time,
// each with a fresh Harness and a watchdog; RunStateMachine compares a
// provider against a simple map model over random Create, Get, Delete and
// List sequences (pgregory.net/rapid).
//
// A backend's test supplies a HarnessMaker that knows how to reach a clean
// backend entry:
//
//	func TestConformance(t *testing.T) {
//		drivertest.RunConformanceTests(t, newHarness, nil)
//	}
//
// The suite drives the provider through the portable egressproxy.Client (the
// layer users hold) and directly where the provider's own behaviour is in
// question (validation, context handling, Close). It checks the contract; it
// does not start a backend (the harness does) nor check a backend's own
// behaviour (the backend's tests do).
//
// Providers that implement driver.ImageManager also run the Images/
// subtests (list, verify, evict, refusal while in use); for the others they
// skip, saying so.
//
// Instances the suite creates are named Options.NamePrefix and a random
// suffix, and are deleted when the subtest ends, pass or fail.
package drivertest
