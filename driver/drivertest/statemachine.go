package drivertest

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
)

// RunStateMachine compares the providers newHarness makes against a map
// model (name → UID, creation time) over random sequences of Create, Get,
// Delete and List on a small space of names and UIDs, so that collisions
// (same name, other UID; wrong UID; repeated deletes) are frequent. After
// every step the invariant "List equals the model" is checked.
//
// One harness serves the whole run; every rapid check gets a fresh provider
// (through an egressproxy.Client), a watchdog (Options.SubtestBudget) and
// its own names, and deletes what it created when it ends. The number of
// checks and steps are rapid's flags (-rapid.checks, default 100;
// -rapid.steps, default 30): lower them for slow backends.
func RunStateMachine(t *testing.T, newHarness HarnessMaker, opts *Options) {
	t.Helper()
	o := opts.withDefaults()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	h, err := newHarness(ctx, t)
	if err != nil {
		t.Fatalf("drivertest: making the harness: %v", err)
	}
	defer h.Close()
	prefix := o.NamePrefix + "-sm" + randomSuffix(4)
	var checks atomic.Int64
	rapid.Check(t, func(rt *rapid.T) {
		n := checks.Add(1)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		wd := startWatchdog(fmt.Sprintf("%s (state-machine check %d)", t.Name(), n), o.SubtestBudget, o.Grace, cancel)
		defer wd.finish(rt)
		p, err := h.MakeProvider(ctx)
		if err != nil {
			rt.Fatalf("drivertest: making the provider: %v", err)
		}
		m := &machine{
			ctx:      ctx,
			p:        p,
			c:        driver.NewClient(p, nil),
			model:    map[string]modelEntry{},
			template: o.Spec,
		}
		defer m.c.Close()
		defer m.cleanup(rt, o.Grace+time.Minute)
		base := fmt.Sprintf("%s-%d", prefix, n)
		for _, s := range []string{"a", "b", "c"} {
			m.names = append(m.names, base+"-"+s)
		}
		for _, s := range []string{"u1", "u2", "u3"} {
			m.uids = append(m.uids, base+"-"+s)
		}
		m.baseline = m.listNames(rt)
		rt.Repeat(map[string]func(*rapid.T){
			"Create": m.create,
			"Get":    m.get,
			"Delete": m.delete,
			"List":   m.list,
			"":       m.check,
		})
	})
}

type modelEntry struct {
	uid     string
	created time.Time
}

type machine struct {
	ctx      context.Context
	p        driver.Provider
	c        *egressproxy.Client
	names    []string
	uids     []string
	model    map[string]modelEntry
	baseline map[string]string // instances present before the check: name → UID
	touched  map[egressproxy.Ref]bool
	template egressproxy.Spec
}

func (m *machine) draw(t *rapid.T) egressproxy.Ref {
	r := egressproxy.Ref{
		Name: rapid.SampledFrom(m.names).Draw(t, "name"),
		UID:  rapid.SampledFrom(m.uids).Draw(t, "uid"),
	}
	if m.touched == nil {
		m.touched = map[egressproxy.Ref]bool{}
	}
	m.touched[r] = true
	return r
}

func (m *machine) create(t *rapid.T) {
	r := m.draw(t)
	spec := m.template
	spec.Name, spec.UID = r.Name, r.UID
	inst, err := m.c.Create(m.ctx, spec)
	cur, exists := m.model[r.Name]
	switch {
	case exists && cur.uid != r.UID:
		if egressproxy.Code(err) != egressproxy.Permanent {
			t.Fatalf("Create(%s, %s) while the name belongs to UID %s: got %v (err %v), want Permanent", r.Name, r.UID, cur.uid, egressproxy.Code(err), err)
		}
	case err != nil:
		t.Fatalf("Create(%s, %s): %v", r.Name, r.UID, err)
	default:
		for _, p := range instanceProblems(inst, r, true) {
			t.Fatalf("Create(%s, %s): %s", r.Name, r.UID, p)
		}
		if exists && !sameSecond(inst.CreatedAt, cur.created) {
			t.Fatalf("Create(%s, %s) again returned CreatedAt %v, first creation was %v: a new instance, not the existing one", r.Name, r.UID, inst.CreatedAt, cur.created)
		}
		if !exists {
			m.model[r.Name] = modelEntry{uid: r.UID, created: inst.CreatedAt}
		}
	}
}

func (m *machine) get(t *rapid.T) {
	r := m.draw(t)
	inst, err := m.c.Get(m.ctx, r)
	cur, exists := m.model[r.Name]
	if !exists || cur.uid != r.UID {
		if egressproxy.Code(err) != egressproxy.NotFound {
			t.Fatalf("Get(%s, %s) of an instance the model lacks: got %v (err %v, instance %+v), want NotFound", r.Name, r.UID, egressproxy.Code(err), err, inst)
		}
		return
	}
	if err != nil {
		t.Fatalf("Get(%s, %s): %v", r.Name, r.UID, err)
	}
	for _, p := range instanceProblems(inst, r, true) {
		t.Fatalf("Get(%s, %s): %s", r.Name, r.UID, p)
	}
	if !sameSecond(inst.CreatedAt, cur.created) {
		t.Fatalf("Get(%s): CreatedAt %v, created at %v", r.Name, inst.CreatedAt, cur.created)
	}
}

func (m *machine) delete(t *rapid.T) {
	r := m.draw(t)
	if err := m.c.Delete(m.ctx, r); err != nil {
		t.Fatalf("Delete(%s, %s) = %v, want nil (Delete is idempotent and ignores other UIDs)", r.Name, r.UID, err)
	}
	if cur, ok := m.model[r.Name]; ok && cur.uid == r.UID {
		delete(m.model, r.Name)
	}
}

func (m *machine) list(t *rapid.T) {
	l, err := m.c.List(m.ctx)
	if err != nil {
		t.Fatalf("List: %v", err)
	}
	for _, inst := range l {
		cur, ok := m.model[inst.Name]
		if !ok {
			continue // compared by check
		}
		for _, p := range instanceProblems(inst, egressproxy.Ref{Name: inst.Name, UID: cur.uid}, false) {
			t.Fatalf("List entry %s: %s", inst.Name, p)
		}
		if !sameSecond(inst.CreatedAt, cur.created) {
			t.Fatalf("List entry %s: CreatedAt %v, created at %v", inst.Name, inst.CreatedAt, cur.created)
		}
	}
}

func (m *machine) listNames(t *rapid.T) map[string]string {
	l, err := m.c.List(m.ctx)
	if err != nil {
		t.Fatalf("List: %v", err)
	}
	out := make(map[string]string, len(l))
	for _, inst := range l {
		if prev, dup := out[inst.Name]; dup {
			t.Fatalf("List has %q twice (UIDs %q and %q)", inst.Name, prev, inst.UID)
		}
		out[inst.Name] = inst.UID
	}
	return out
}

// check is the invariant: List = baseline + model, exactly.
func (m *machine) check(t *rapid.T) {
	got := m.listNames(t)
	want := make(map[string]string, len(m.baseline)+len(m.model))
	for n, u := range m.baseline {
		want[n] = u
	}
	for n, e := range m.model {
		want[n] = e.uid
	}
	if d := diffMaps(want, got); d != "" {
		t.Fatalf("List differs from the model (name: want UID / got UID):\n%s", d)
	}
}

func diffMaps(want, got map[string]string) string {
	var lines []string
	for n, u := range want {
		if g, ok := got[n]; !ok {
			lines = append(lines, fmt.Sprintf("  %s: %s / missing", n, u))
		} else if g != u {
			lines = append(lines, fmt.Sprintf("  %s: %s / %s", n, u, g))
		}
	}
	for n, g := range got {
		if _, ok := want[n]; !ok {
			lines = append(lines, fmt.Sprintf("  %s: not expected / %s", n, g))
		}
	}
	sort.Strings(lines)
	return strings.Join(lines, "\n")
}

// cleanup deletes every name/UID pair the check used, with a context of its
// own.
func (m *machine) cleanup(t *rapid.T, budget time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), budget)
	defer cancel()
	for r := range m.touched {
		if err := m.p.Delete(ctx, r); err != nil {
			t.Errorf("drivertest cleanup: deleting %s (UID %s): %v", r.Name, r.UID, err)
		}
	}
}
