package drivertest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/internal/naming"
)

// Harness gives a subtest providers on one clean backend entry. The suite
// makes a fresh Harness for every subtest and closes it when the subtest
// ends. Close must release everything the harness holds; the providers it
// made are closed by the suite before.
type Harness interface {
	// MakeProvider returns a new Provider for the harness's entry. It may
	// be called more than once per harness (the suite uses a second
	// provider to clean up after closing the first); every provider it
	// returns sees the same backend.
	MakeProvider(ctx context.Context) (driver.Provider, error)
	// Close releases the harness.
	Close()
}

// OtherEntryHarness is implemented by harnesses that can also make a
// provider for a second entry on the same backend (for kvm2: another Entry
// on the same host and pool). The suite then checks that neither entry sees,
// reads or deletes the other's instances. Harnesses without it skip that
// subtest, saying so.
type OtherEntryHarness interface {
	Harness
	// MakeOtherEntryProvider returns a provider for the second entry.
	MakeOtherEntryProvider(ctx context.Context) (driver.Provider, error)
}

// StorageHarness is implemented by harnesses that can take the storage of
// the harness's entry away and bring it back (for kvm2: destroy and undefine
// the entry's pool, keeping its files, then define and start it again). The
// suite then checks Delete without storage: never NotFound, never nil for an
// instance that exists, complete once the storage is back. Harnesses without
// it skip that subtest, saying so.
type StorageHarness interface {
	Harness
	// RemoveStorage takes the entry's storage away; what it held stays
	// for RestoreStorage.
	RemoveStorage(ctx context.Context) error
	// RestoreStorage brings the storage back as RemoveStorage found it.
	RestoreStorage(ctx context.Context) error
}

// HarnessMaker makes a Harness for one subtest. It may call t.Skip (for
// example when a real stack is absent) and t.Cleanup.
type HarnessMaker func(ctx context.Context, t *testing.T) (Harness, error)

// Options tune the suite to a provider. A nil *Options is valid.
type Options struct {
	// Spec is the template of every instance the suite creates; Name and
	// UID are overwritten. Zero value: all defaults (DefaultPort, the
	// provider's default image and machine type).
	Spec egressproxy.Spec
	// NamePrefix starts every instance name the suite uses; it must be a
	// valid name on its own and at most 40 bytes. Zero: "pt".
	NamePrefix string
	// NeverRunning says the provider's instances never reach StateRunning
	// in this environment (for example VMs without a guest network); the
	// suite then checks only that the state is Provisioning or Running.
	// Zero: instances must reach Running within RunningTimeout.
	NeverRunning bool
	// RunningTimeout is how long an instance may take to reach Running.
	// Zero: 2 minutes.
	RunningTimeout time.Duration
	// PollInterval is the pause between reads while waiting for Running.
	// Zero: 50ms.
	PollInterval time.Duration
	// SubtestBudget is the watchdog budget of each subtest (and of each
	// state-machine check): when it runs out the subtest's context is
	// cancelled and the subtest fails, naming the budget. Zero:
	// RunningTimeout + 1 minute.
	SubtestBudget time.Duration
	// Grace is how long a subtest may stay blocked after its budget ran out
	// and its context was cancelled. When it runs out too, the provider is
	// ignoring its context: the watchdog panics with every goroutine's
	// stack, ending the test binary (as go test -timeout would, but naming
	// the subtest). Zero: 15 seconds.
	Grace time.Duration
	// Concurrency is the number of concurrent Creates of one spec in the
	// concurrency subtest. Zero: 4.
	Concurrency int
	// OtherImageKey is an image key the provider accepts that differs from
	// Spec.ImageKey: the spec-conflict subtest then also checks that
	// Create of an existing UID with this image is ErrSpecConflict. Zero:
	// a changed ImageKey is not checked (the subtest says so).
	OtherImageKey string
	// OtherMachineType is the same for Spec.MachineType.
	OtherMachineType string
	// ImageKeys are the image keys the provider is configured with. When
	// set, the image subtests (providers implementing
	// driver.ImageManager) check that ListImages lists exactly these and
	// that a valid key outside them is Permanent. Zero: only the shape of
	// the list is checked (a provider may accept every key, as memprovider
	// does by default), and an unconfigured key is not checked (the
	// subtests say so).
	ImageKeys []string
}

func (o *Options) withDefaults() Options {
	var r Options
	if o != nil {
		r = *o
	}
	if r.NamePrefix == "" {
		r.NamePrefix = "pt"
	}
	if r.RunningTimeout <= 0 {
		r.RunningTimeout = 2 * time.Minute
	}
	if r.PollInterval <= 0 {
		r.PollInterval = 50 * time.Millisecond
	}
	if r.SubtestBudget <= 0 {
		r.SubtestBudget = r.RunningTimeout + time.Minute
	}
	if r.Grace <= 0 {
		r.Grace = 15 * time.Second
	}
	if r.Concurrency <= 0 {
		r.Concurrency = 4
	}
	return r
}

// RunConformanceTests runs the conformance suite against the providers
// newHarness makes. Every subtest gets a fresh harness, a fresh provider
// wrapped in an egressproxy.Client, and a watchdog (Options.SubtestBudget).
func RunConformanceTests(t *testing.T, newHarness HarnessMaker, opts *Options) {
	t.Helper()
	o := opts.withDefaults()
	if err := naming.ValidateName("NamePrefix", o.NamePrefix); err != nil || len(o.NamePrefix) > 40 {
		t.Fatalf("drivertest: Options.NamePrefix %q must be a valid name of at most 40 bytes (%v)", o.NamePrefix, err)
	}
	for _, tc := range conformanceTests {
		t.Run(tc.name, func(t *testing.T) {
			runSubtest(t, newHarness, &o, tc.fn)
		})
	}
}

// env is what a subtest works with.
type env struct {
	t      *testing.T
	o      *Options
	ctx    context.Context // cancelled by the watchdog
	h      Harness
	p      driver.Provider
	c      *egressproxy.Client
	prefix string

	mu      sync.Mutex
	created []egressproxy.Ref
	n       int
}

func runSubtest(t *testing.T, newHarness HarnessMaker, o *Options, fn func(*env)) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	wd := startWatchdog(t.Name(), o.SubtestBudget, o.Grace, cancel)
	defer wd.finish(t)

	h, err := newHarness(ctx, t)
	if err != nil {
		t.Fatalf("drivertest: making the harness: %v", err)
	}
	t.Cleanup(h.Close)
	p, err := h.MakeProvider(ctx)
	if err != nil {
		t.Fatalf("drivertest: making the provider: %v", err)
	}
	e := &env{t: t, o: o, ctx: ctx, h: h, p: p, c: driver.NewClient(p, nil), prefix: o.NamePrefix + "-" + randomSuffix(5)}
	t.Cleanup(func() { e.c.Close() })
	t.Cleanup(e.deleteCreated)
	fn(e)
}

func randomSuffix(n int) string {
	const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, n)
	for i := range b {
		b[i] = alphabet[rand.IntN(len(alphabet))]
	}
	// A name must end with a letter or digit: it does.
	return string(b)
}

// spec returns the template with a fresh name (prefix-suffix) and UID, and
// remembers it for cleanup.
func (e *env) spec(suffix string) egressproxy.Spec {
	e.mu.Lock()
	e.n++
	n := e.n
	e.mu.Unlock()
	s := e.o.Spec
	s.Name = e.prefix + "-" + suffix
	s.UID = fmt.Sprintf("%s-uid-%d-%s", e.prefix, n, randomSuffix(8))
	e.remember(s.Ref())
	return s
}

func (e *env) remember(r egressproxy.Ref) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.created = append(e.created, r)
}

// deleteCreated deletes every instance the subtest may have created, with a
// context of its own (the subtest's may be cancelled). If the subtest
// closed its provider, a new one from the harness does it.
func (e *env) deleteCreated() {
	e.mu.Lock()
	refs := append([]egressproxy.Ref(nil), e.created...)
	e.mu.Unlock()
	if len(refs) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), e.o.Grace+time.Minute)
	defer cancel()
	p := e.p
	for _, r := range refs {
		if naming.ValidateRef(r.Name, r.UID) != nil {
			continue
		}
		err := p.Delete(ctx, r)
		if errors.Is(err, egressproxy.ErrClosed) && p == e.p {
			np, merr := e.h.MakeProvider(ctx)
			if merr != nil {
				e.t.Errorf("drivertest cleanup: making a provider to delete %s: %v", r.Name, merr)
				return
			}
			defer np.Close()
			p = np
			err = p.Delete(ctx, r)
		}
		if err != nil {
			e.t.Errorf("drivertest cleanup: deleting %s (UID %s): %v", r.Name, r.UID, err)
		}
	}
}

// watchdog bounds one subtest; see Options.SubtestBudget and Grace.
type watchdog struct {
	budget   time.Duration
	exceeded atomic.Bool
	stop     chan struct{}
	done     chan struct{}
}

func startWatchdog(name string, budget, grace time.Duration, cancel func()) *watchdog {
	w := &watchdog{budget: budget, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		t1 := time.NewTimer(budget)
		defer t1.Stop()
		select {
		case <-w.stop:
			return
		case <-t1.C:
		}
		w.exceeded.Store(true)
		cancel()
		t2 := time.NewTimer(grace)
		defer t2.Stop()
		select {
		case <-w.stop:
			return
		case <-t2.C:
		}
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		panic(fmt.Sprintf("drivertest: %s is still blocked %v after its budget of %v ran out and its context was cancelled: "+
			"the provider does not honour its context.\n\n%s", name, grace, budget, buf))
	}()
	return w
}

// finish stops the watchdog and fails tb if the budget ran out.
func (w *watchdog) finish(tb interface{ Errorf(string, ...any) }) {
	close(w.stop)
	<-w.done
	if w.exceeded.Load() {
		tb.Errorf("drivertest: exceeded its budget of %v (Options.SubtestBudget); the watchdog cancelled its context", w.budget)
	}
}
