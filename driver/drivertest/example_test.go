package drivertest_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/driver/drivertest"
	"github.com/egressproxy/egressproxy/memprovider"
)

// harness is what a provider's test supplies to the suite: a way to reach a
// clean backend entry. Here the backend is memprovider; kvm2's harness opens
// a kvm2.Provider on a fresh entry of a test host instead.
type harness struct{ opts memprovider.Options }

// MakeProvider returns a provider of the harness's entry. The suite may
// call it more than once per subtest (it cleans up with a second provider
// after closing the first).
func (h *harness) MakeProvider(context.Context) (driver.Provider, error) {
	o := h.opts
	return memprovider.New(&o), nil
}

// Close releases what the harness holds (the suite has closed the providers
// it made before).
func (h *harness) Close() {}

// newHarness is the drivertest.HarnessMaker: the suite calls it once per
// subtest. A harness of a real backend calls t.Skip when the backend is
// absent and registers its own clean-up with t.Cleanup; this one needs
// neither.
func newHarness(ctx context.Context, t *testing.T) (drivertest.Harness, error) {
	return &harness{opts: memprovider.Options{ServeProxies: true}}, nil
}

// suiteOptions tune the suite to the provider: how long an instance may take
// to reach Running, the budget of each subtest, the instance name prefix.
var suiteOptions = &drivertest.Options{
	NamePrefix:     "pt",
	RunningTimeout: 10 * time.Second,
	PollInterval:   10 * time.Millisecond,
	SubtestBudget:  30 * time.Second,
}

// A provider's conformance test: a harness, and two test functions that run
// the suite with it. In the provider's _test.go file they are
//
//	func TestConformance(t *testing.T) {
//		drivertest.RunConformanceTests(t, newHarness, suiteOptions)
//	}
//
//	func TestStateMachine(t *testing.T) {
//		drivertest.RunStateMachine(t, newHarness, suiteOptions)
//	}
//
// (an example is given no *testing.T, so here they are values, compiled but
// not run; memprovider's own tests run the suite with this harness). What
// runs below is what every subtest starts from: a harness and a provider it
// made, on an empty entry.
func Example() {
	conformance := func(t *testing.T) { drivertest.RunConformanceTests(t, newHarness, suiteOptions) }
	stateMachine := func(t *testing.T) { drivertest.RunStateMachine(t, newHarness, suiteOptions) }
	_, _ = conformance, stateMachine

	ctx := context.Background()
	h, err := newHarness(ctx, nil) // this harness does not use its *testing.T
	if err != nil {
		fmt.Println(err)
		return
	}
	defer h.Close()
	p, err := h.MakeProvider(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer p.Close()
	list, err := p.List(ctx)
	fmt.Println("instances:", len(list), err)
	health, _ := p.Check(ctx)
	fmt.Println("reachable:", health.Reachable)
	// Output:
	// instances: 0 <nil>
	// reachable: true
}
