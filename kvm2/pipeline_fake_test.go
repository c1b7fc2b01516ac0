package kvm2

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/testing/libvirtfake"
	"go.uber.org/goleak"
)

// gate is a hook that holds the calls of op (before they take effect) and
// counts how many are held at once. full is closed when want are held
// together; the held calls go on when open is closed (by release, or at
// once when the gate is full and auto is set). A gate that never fills
// opens after gateWait, so that a test of a sequential caller fails
// instead of hanging.
type gate struct {
	op   string
	want int
	auto bool

	mu        sync.Mutex
	held, max int
	full      chan struct{}
	open      chan struct{}
	fullOnce  sync.Once
	openOnce  sync.Once
}

const gateWait = 5 * time.Second

func newGate(op string, want int, auto bool) *gate {
	return &gate{op: op, want: want, auto: auto, full: make(chan struct{}), open: make(chan struct{})}
}

func (g *gate) release() { g.openOnce.Do(func() { close(g.open) }) }

func (g *gate) maxHeld() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.max
}

// install makes the gate hold the calls of its op on h.
func (g *gate) install(h *libvirtfake.Host) { h.SetHook(g.op, g.hook) }

func (g *gate) hook(libvirtfake.Call) error {
	g.mu.Lock()
	g.held++
	g.max = max(g.max, g.held)
	if g.held >= g.want {
		g.fullOnce.Do(func() { close(g.full) })
		if g.auto {
			g.release()
		}
	}
	g.mu.Unlock()
	t := time.NewTimer(gateWait)
	select {
	case <-g.open:
	case <-t.C:
		g.release() // never filled: let every call go
	}
	t.Stop()
	g.mu.Lock()
	g.held--
	g.mu.Unlock()
	return nil
}

// defineStopped defines n stopped domains of ours (names s000…).
func (e *fakeEnv) defineStopped(n int) {
	for i := range n {
		e.defineXML(e.t, foreignXML(e.t, e.dom(fmt.Sprintf("s%03d", i)), e.cfg.Entry, e.cfg.Owner, false))
	}
}

// TestFakeListPipelined: List reads the domains' XML listInFlight at a
// time (never more), after one call that lists every domain with its
// state: 1 + n RPCs, about 1 + n/listInFlight round trips.
func TestFakeListPipelined(t *testing.T) {
	e := newFakeEnv(t)
	const n = 3*listInFlight + 5
	e.defineStopped(n)
	g := newGate("DomainGetXMLDesc", listInFlight, true)
	g.install(e.host)
	e.host.ResetCalls()
	start := time.Now()
	got, err := e.p.List(context.Background())
	if err != nil || len(got) != n {
		t.Fatalf("List = %d instances, %v; want %d", len(got), err, n)
	}
	if d := time.Since(start); d >= gateWait {
		t.Errorf("List took %v: its reads did not reach %d in flight", d, listInFlight)
	}
	if m := g.maxHeld(); m != listInFlight {
		t.Errorf("at most %d XML reads in flight, want %d", m, listInFlight)
	}
	if c, s := e.host.Calls(""), e.host.Calls("ConnectGetAllDomainStats"); c != n+1 || s != 1 {
		t.Errorf("%d calls (%d listings), want %d: one listing with states, one XML read per domain", c, s, n+1)
	}
	for i, inst := range got {
		if want := fmt.Sprintf("s%03d", i); inst.Name != want || inst.State != egressproxy.StateStopped {
			t.Errorf("List[%d] = %s %s, want %s Stopped", i, inst.Name, inst.State, want)
		}
	}
}

// TestFakeListAddressesBounded: the address lookups of the active
// instances run at once too, all sources of all instances sharing List's
// bound.
func TestFakeListAddressesBounded(t *testing.T) {
	e := newFakeEnv(t)
	const n = listInFlight/3 + 2 // three address calls each: more than listInFlight
	for i := range n {
		e.mustCreate(fmt.Sprintf("r%02d", i))
	}
	g := newGate("DomainInterfaceAddresses", listInFlight, true)
	g.install(e.host)
	start := time.Now()
	got, err := e.p.List(context.Background())
	if err != nil || len(got) != n {
		t.Fatalf("List = %d instances, %v; want %d", len(got), err, n)
	}
	if d := time.Since(start); d >= gateWait {
		t.Errorf("List took %v: its address calls did not reach %d in flight", d, listInFlight)
	}
	if m := g.maxHeld(); m != listInFlight {
		t.Errorf("at most %d address calls in flight, want %d", m, listInFlight)
	}
}

// TestFakeListCancelled: a List whose context ends while its calls are in
// flight returns Canceled at once, leaves none of its own goroutines
// behind, and its abandoned reads stop at the next boundary (no further
// call is made once the held ones return).
func TestFakeListCancelled(t *testing.T) {
	for _, tc := range []struct {
		name, op string
		setup    func(e *fakeEnv)
	}{
		{"during the XML reads", "DomainGetXMLDesc", func(e *fakeEnv) { e.defineStopped(3 * listInFlight) }},
		{"during the address lookups", "DomainInterfaceAddresses", func(e *fakeEnv) {
			for i := range listInFlight {
				e.mustCreate(fmt.Sprintf("r%02d", i))
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
			e := newFakeEnv(t)
			tc.setup(e)
			g := newGate(tc.op, listInFlight, false)
			g.install(e.host)
			e.host.ResetCalls()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			go func() {
				select {
				case <-g.full:
				case <-time.After(gateWait):
				}
				cancel()
			}()
			_, err := e.p.List(ctx)
			wantCode(t, "cancelled List", err, errs.Canceled)
			// Only the abandoned calls (the fake's fn goroutines) remain.
			if err := goleak.Find(goleak.IgnoreCurrent(), goleak.IgnoreAnyFunction("github.com/egressproxy/egressproxy/internal/testing/libvirtfake.(*Host).Do.func1")); err != nil {
				t.Errorf("List left goroutines behind: %v", err)
			}
			held := e.host.Calls(tc.op)
			g.release()
			e.host.Wait()
			if n := e.host.Calls(tc.op); n != held {
				t.Errorf("%d %s calls after the held ones returned, want %d: the abandoned List went on", n, tc.op, held)
			}
		})
	}
}

// TestFakeGetOverlapped: Get reads the domain's XML and state at once, and
// asks the three address sources at once (3 round trips, not 6).
func TestFakeGetOverlapped(t *testing.T) {
	e := newFakeEnv(t)
	e.mustCreate("a")
	xml := newGate("DomainGetXMLDesc", 1, false)
	state := newGate("DomainGetState", 1, false)
	addrs := newGate("DomainInterfaceAddresses", 3, true)
	for _, g := range []*gate{xml, state, addrs} {
		g.install(e.host)
	}
	go func() {
		// Both reads held at once, or neither goes on (until gateWait).
		for _, c := range []<-chan struct{}{xml.full, state.full} {
			select {
			case <-c:
			case <-time.After(gateWait):
			}
		}
		xml.release()
		state.release()
	}()
	start := time.Now()
	inst, err := e.p.Get(context.Background(), fakeSpec("a").Ref())
	if err != nil || inst.State != egressproxy.StateProvisioning {
		t.Fatalf("Get = %+v, %v", inst, err)
	}
	if d := time.Since(start); d >= gateWait {
		t.Errorf("Get took %v: its reads or its address sources did not overlap", d)
	}
	if m := addrs.maxHeld(); m != 3 {
		t.Errorf("%d address sources in flight at once, want 3", m)
	}
	select {
	case <-xml.full:
	default:
		t.Error("the XML was not read")
	}
	select {
	case <-state.full:
	default:
		t.Error("the state was not read")
	}
}

// TestFakeDeletePipelined: Delete of a running instance looks the pool up
// together with the domain, then (after destroy and undefine) looks its
// two volumes up together with the check that no domain of its name was
// defined meanwhile, and deletes both volumes at once: 6 round trips, not
// 11. Each pair is held until both of its calls have arrived.
func TestFakeDeletePipelined(t *testing.T) {
	e := newFakeEnv(t)
	e.mustCreate("a")
	pool := newGate("StoragePoolLookupByName", 1, false)
	dom := newGate("DomainLookupByName", 1, false)
	vols := newGate("StorageVolLookupByName", 2, false)
	dels := newGate("StorageVolDelete", 2, true)
	checked := make(chan struct{})
	var lookups atomic.Int32
	check := func(libvirtfake.Call) error {
		if lookups.Add(1) == 2 {
			close(checked) // the second lookup: the check before the volumes go
		}
		return nil
	}
	for _, g := range []*gate{pool, vols, dels} {
		g.install(e.host)
	}
	e.host.SetHook("DomainLookupByName", libvirtfake.Chain(check, dom.hook))
	go func() {
		for _, c := range []<-chan struct{}{pool.full, dom.full} {
			select {
			case <-c:
			case <-time.After(gateWait):
			}
		}
		pool.release()
		dom.release()
	}()
	go func() {
		for _, c := range []<-chan struct{}{vols.full, checked} {
			select {
			case <-c:
			case <-time.After(gateWait):
			}
		}
		vols.release()
	}()
	e.host.ResetCalls()
	start := time.Now()
	if err := e.p.Delete(context.Background(), fakeSpec("a").Ref()); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d >= gateWait {
		t.Errorf("Delete took %v: its independent calls did not overlap", d)
	}
	if m := dels.maxHeld(); m != 2 {
		t.Errorf("%d volume deletions in flight at once, want 2", m)
	}
	if n, p := e.host.Calls("DomainLookupByName"), e.host.Calls("StoragePoolLookupByName"); n != 2 || p != 1 {
		t.Errorf("%d domain lookups and %d pool lookups, want 2 and 1", n, p)
	}
	if vs := e.host.VolumeNames(e.cfg.Pool); len(vs) != 1 {
		t.Errorf("volumes left: %v, want only the base", vs)
	}
	if _, ok := e.host.Domain(e.dom("a")); ok {
		t.Error("the domain is still defined")
	}
}

// TestFakeCreateGivesThePoolToTheCache: the pool handle Create looks up
// with the domain goes to the image cache, whose first listing then needs
// no lookup of its own.
func TestFakeCreateGivesThePoolToTheCache(t *testing.T) {
	e := newFakeEnv(t)
	e.mustCreate("a")
	ps := e.images.usedPools()
	if len(ps) != 1 || ps[0].Name != e.cfg.Pool {
		t.Fatalf("pools given to the cache: %+v, want the handle of %q", ps, e.cfg.Pool)
	}
}

// TestFakeEntriesCreateConcurrently: nothing in kvm2 serialises the
// providers of different entries (hosts): Creates on four providers, each
// on its own fakes, have their overlays created, their domains defined
// and started at once (each call held until all four providers made it).
func TestFakeEntriesCreateConcurrently(t *testing.T) {
	const hosts = 4
	var gates []*gate
	for _, op := range []string{"StorageVolCreateXML", "DomainDefineXMLFlags", "DomainCreate"} {
		want := hosts
		if op == "StorageVolCreateXML" {
			want = 2 * hosts // overlay and seed of each
		}
		gates = append(gates, newGate(op, want, true))
	}
	envs := make([]*fakeEnv, hosts)
	for i := range envs {
		envs[i] = newFakeEnv(t, func(c *Config) { c.Entry = fmt.Sprintf("hv%d", i+1) })
		for _, g := range gates {
			g.install(envs[i].host)
		}
	}
	start := time.Now()
	var wg sync.WaitGroup
	problems := make([]error, hosts)
	for i, e := range envs {
		wg.Go(func() {
			_, problems[i] = e.p.Create(context.Background(), fakeSpec("a"))
		})
	}
	wg.Wait()
	for i, err := range problems {
		if err != nil {
			t.Errorf("entry %d: %v", i+1, err)
		}
	}
	if d := time.Since(start); d >= gateWait {
		t.Errorf("the Creates took %v: some of their calls did not overlap across entries", d)
	}
	for _, g := range gates {
		if m := g.maxHeld(); m != g.want {
			t.Errorf("at most %d %s calls in flight across the entries, want %d", m, g.op, g.want)
		}
	}
}
