package memprovider_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/driver/drivertest"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/memprovider"
)

// The suite must be able to fail: each broken variant below breaks one
// rule of the contract, runs the suite in a child process (a test cannot
// observe its own subtests failing without failing itself), and the parent
// asserts that the child fails and names the right subtest.

const brokenEnv = "MEMPROVIDER_BROKEN_VARIANT"

// broken wraps a memprovider and breaks one rule.
type broken struct {
	driver.Provider
	variant string
}

func (b *broken) Create(ctx context.Context, s egressproxy.Spec) (egressproxy.Instance, error) {
	if b.variant == "create-not-idempotent" {
		if _, err := b.Provider.Get(ctx, s.Ref()); err == nil {
			return egressproxy.Instance{}, errs.Errorf(errs.Permanent, "instance %s already exists", s.Name)
		}
	}
	if b.variant == "ignores-context" {
		ctx = context.Background()
	}
	inst, err := b.Provider.Create(ctx, s)
	switch {
	case b.variant == "spec-drift-silent" && errors.Is(err, errs.ErrSpecConflict):
		return b.Provider.Get(ctx, s.Ref()) // the old behaviour: the old instance, without a word
	case b.variant == "no-spec-digest":
		inst.SpecDigest = ""
	}
	return inst, err
}

func (b *broken) Get(ctx context.Context, r egressproxy.Ref) (egressproxy.Instance, error) {
	switch b.variant {
	case "get-ignores-uid":
		l, err := b.Provider.List(ctx)
		if err != nil {
			return egressproxy.Instance{}, err
		}
		for _, inst := range l {
			if inst.Name == r.Name {
				return inst, nil
			}
		}
	case "hangs":
		time.Sleep(time.Minute) // ignores ctx: the watchdog must end the run
	case "slow":
		select { // honours ctx, but takes longer than the budget
		case <-ctx.Done():
			return egressproxy.Instance{}, errs.FromContext(ctx.Err())
		case <-time.After(time.Minute):
		}
	}
	return b.Provider.Get(ctx, r)
}

func (b *broken) Delete(ctx context.Context, r egressproxy.Ref) error {
	switch b.variant {
	case "delete-missing-notfound":
		if _, err := b.Provider.Get(ctx, r); err != nil {
			return err
		}
	case "delete-ignores-uid":
		l, err := b.Provider.List(ctx)
		if err != nil {
			return err
		}
		for _, inst := range l {
			if inst.Name == r.Name {
				r.UID = inst.UID
			}
		}
	}
	return b.Provider.Delete(ctx, r)
}

func (b *broken) List(ctx context.Context) ([]egressproxy.Instance, error) {
	l, err := b.Provider.List(ctx)
	if b.variant == "list-duplicates" && len(l) > 0 {
		l = append(l, l[0])
	}
	return l, err
}

type brokenHarness struct{ variant string }

func (h brokenHarness) MakeProvider(context.Context) (driver.Provider, error) {
	return &broken{Provider: memprovider.NewDriver(nil), variant: h.variant}, nil
}
func (brokenHarness) Close() {}

// TestBrokenVariant is the child: it runs only when the parent sets the
// variant in the environment, and is expected to FAIL.
func TestBrokenVariant(t *testing.T) {
	variant := os.Getenv(brokenEnv)
	if variant == "" {
		t.Skip("child of TestSuiteCatchesBrokenVariants; runs only with " + brokenEnv + " set")
	}
	mk := func(context.Context, *testing.T) (drivertest.Harness, error) { return brokenHarness{variant}, nil }
	opts := &drivertest.Options{RunningTimeout: 5 * time.Second, SubtestBudget: time.Second, Grace: time.Second}
	if strings.HasPrefix(os.Getenv("MEMPROVIDER_BROKEN_RUN"), "statemachine") {
		drivertest.RunStateMachine(t, mk, opts)
		return
	}
	drivertest.RunConformanceTests(t, mk, opts)
}

func TestSuiteCatchesBrokenVariants(t *testing.T) {
	t.Parallel()
	if os.Getenv(brokenEnv) != "" {
		t.Skip("in the child")
	}
	tests := []struct {
		variant      string
		statemachine bool
		want         []string // in the child's output
	}{
		{"delete-missing-notfound", false, []string{"--- FAIL: TestBrokenVariant/Delete/MissingSucceeds", "want nil"}},
		{"create-not-idempotent", false, []string{"--- FAIL: TestBrokenVariant/Create/IdempotentOnUID"}},
		{"get-ignores-uid", false, []string{"--- FAIL: TestBrokenVariant/Get/WrongUIDIsNotFound", "want NotFound"}},
		{"delete-ignores-uid", false, []string{"--- FAIL: TestBrokenVariant/Delete/WrongUIDKeepsInstance"}},
		{"list-duplicates", false, []string{"--- FAIL: TestBrokenVariant/List/Exact", "a duplicate"}},
		{"spec-drift-silent", false, []string{"--- FAIL: TestBrokenVariant/Create/OtherSpecIsConflict", "want errors.Is ErrSpecConflict"}},
		{"no-spec-digest", false, []string{"--- FAIL: TestBrokenVariant/Create/SpecDigestReadBack", "Create returned SpecDigest"}},
		{"ignores-context", false, []string{"--- FAIL: TestBrokenVariant/Context/CanceledBeforeCall", "want Canceled"}},
		{"slow", false, []string{"--- FAIL: TestBrokenVariant/Create/ConcurrentSameSpec", "exceeded its budget of 1s"}},
		{"hangs", false, []string{"panic: drivertest: TestBrokenVariant/Create/ConcurrentSameSpec is still blocked", "does not honour its context"}},
		{"delete-ignores-uid", true, []string{"--- FAIL: TestBrokenVariant", "rapid"}},
		{"create-not-idempotent", true, []string{"--- FAIL: TestBrokenVariant", "Create("}},
	}
	// Every Get of these variants takes the whole subtest budget, so the
	// whole suite would cost a budget per subtest: the one subtest their
	// want names shows the watchdog at work.
	only := map[string]string{"slow": "/Create/ConcurrentSameSpec", "hangs": "/Create/ConcurrentSameSpec"}
	for _, tt := range tests {
		name := tt.variant
		if tt.statemachine {
			name += "/statemachine"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			pattern := "^TestBrokenVariant$" + only[tt.variant]
			cmd := exec.CommandContext(ctx, os.Args[0], "-test.run="+pattern, "-test.v", "-test.count=1",
				"-rapid.checks=20", "-rapid.nofailfile")
			run := "suite"
			if tt.statemachine {
				run = "statemachine"
			}
			cmd.Env = append(os.Environ(), brokenEnv+"="+tt.variant, "MEMPROVIDER_BROKEN_RUN="+run)
			out, err := cmd.CombinedOutput()
			var exit *exec.ExitError
			if !errors.As(err, &exit) {
				t.Fatalf("child with broken variant %q did not fail (err %v); the suite missed the bug.\n%s", tt.variant, err, out)
			}
			for _, w := range tt.want {
				if !strings.Contains(string(out), w) {
					t.Errorf("child output lacks %q:\n%s", w, tail(string(out), 60))
				}
			}
		})
	}
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
