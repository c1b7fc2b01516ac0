package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/testing/benchutil"
	"github.com/egressproxy/egressproxy/internal/testing/lab/delayproxy"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// lsRow is the libvirtscale phase's figures at one round-trip time.
type lsRow struct {
	rtt       time.Duration
	list, get opStats
	listR     []float64 // round trips on the critical path (through the proxy only)
	getR      []float64
	gc        gcRun
	create    []throughput // one per -ls-callers count
	del       []throughput
}

// gcRun is one orphan collection: List, then a Delete of each orphan one
// after another (as egressproxyctl gc and the operator's OrphanCollector
// do).
type gcRun struct {
	total, list time.Duration
	deletes     []float64 // ms each
	rpcs        int
	orphans     int
}

// throughput is n operations made by callers at once.
type throughput struct {
	n, callers int
	wall       time.Duration
	each       []float64 // ms per operation
	rpcs       int
}

func (t throughput) perSecond() float64 { return float64(t.n) / t.wall.Seconds() }

type lsResult struct {
	n, foreign, orphans int
	creates             int
	fill, foreignFill   time.Duration
	rows                []*lsRow
	started, finished   time.Time
	machine             []string
	command             string
	runs                int
	loads               [2]string // load average at the start and the end
}

// runLibvirtScale measures kvm2 at scale on the stack: -ls-instances
// stopped instances of one owner (clones of one that Create made: defined,
// never started, with their volumes) beside -ls-foreign domains that are
// not its own, at each RTT of -ls-rtts (0: loopback; otherwise through
// the delay proxy in front of sshd): List, Get, an orphan collection of
// -ls-orphans of them, and -ls-creates Creates and Deletes made by
// -ls-callers callers at once. It writes -ls-out.
func runLibvirtScale(ctx context.Context, env teststack.Env, o options) (*lsResult, error) {
	var rtts []time.Duration
	for _, f := range strings.Split(o.lsRTTs, ",") {
		ms, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || ms < 0 {
			return nil, fmt.Errorf("-ls-rtts %q: bad RTT %q", o.lsRTTs, f)
		}
		rtts = append(rtts, time.Duration(ms)*time.Millisecond)
	}
	if o.lsOrphans > o.lsInstances {
		return nil, fmt.Errorf("-ls-orphans %d > -ls-instances %d", o.lsOrphans, o.lsInstances)
	}
	k, err := newKVM(ctx, env, "ls")
	if err != nil {
		return nil, err
	}
	defer k.Close()
	res := &lsResult{n: o.lsInstances, foreign: o.lsForeign, orphans: o.lsOrphans, creates: o.lsCreates, runs: o.runs}
	tmpl := k.Spec("t", 0)
	if _, err := k.Plain.Create(ctx, tmpl); err != nil {
		return nil, fmt.Errorf("template Create (cold base fetch): %w", err)
	}
	if err := k.Stop(ctx, tmpl.Name); err != nil {
		return nil, err
	}
	t, err := k.Template(ctx, tmpl)
	if err != nil {
		return nil, err
	}
	if err := k.Plain.Delete(ctx, tmpl.Ref()); err != nil {
		return nil, err
	}
	specs := make([]egressproxy.Spec, o.lsInstances)
	for i := range specs {
		specs[i] = k.Spec("i", i)
	}
	t0 := time.Now()
	if err := k.Clone(ctx, t, specs, 16); err != nil {
		return nil, err
	}
	res.fill = time.Since(t0)
	t0 = time.Now()
	if err := k.CloneForeign(ctx, t, o.lsForeign, 16); err != nil {
		return nil, err
	}
	res.foreignFill = time.Since(t0)
	logf("libvirtscale: %d instances defined in %v, %d foreign domains in %v", len(specs), res.fill, o.lsForeign, res.foreignFill)
	want := map[string]string{}
	for _, s := range specs {
		want[s.Name] = s.UID
	}
	for _, rtt := range rtts {
		row, err := lsAt(ctx, env, k, t, rtt, specs, want, o)
		if err != nil {
			return nil, fmt.Errorf("at %v RTT: %w", rtt, err)
		}
		res.rows = append(res.rows, row)
	}
	return res, nil
}

// lsAt measures one row: the entry's provider through a delay proxy of rtt
// (none at 0), counted.
func lsAt(ctx context.Context, env teststack.Env, k *benchutil.KVM, t *benchutil.Template, rtt time.Duration,
	specs []egressproxy.Spec, want map[string]string, o options) (*lsRow, error) {
	p := k.Counted
	if rtt > 0 {
		px, err := delayproxy.New(delayproxy.Config{Target: env.SSHAddr, RTT: rtt})
		if err != nil {
			return nil, err
		}
		defer px.Close()
		if p, err = k.OpenVia(ctx, px.Addr().String()); err != nil {
			return nil, err
		}
	}
	if _, err := p.Check(ctx); err != nil { // dials: not part of the figures
		return nil, err
	}
	row := &lsRow{rtt: rtt}
	gap := max(rtt/2, time.Millisecond)
	measure := func(s *opStats, rounds *[]float64, fn func() error) error {
		k.Counter.Take()
		t0 := time.Now()
		err := fn()
		d := time.Since(t0)
		r := k.Counter.Rounds(gap)
		calls := k.Counter.Take()
		s.add(benchutil.Op{Wall: d, RPCs: len(calls), Calls: benchutil.Summary(calls)})
		if rtt > 0 {
			*rounds = append(*rounds, float64(r))
		}
		return err
	}
	for i := range o.runs {
		if err := measure(&row.list, &row.listR, func() error { return checkList(ctx, p, want) }); err != nil {
			return nil, fmt.Errorf("list: %w", err)
		}
		s := specs[(i*7919)%len(specs)]
		err := measure(&row.get, &row.getR, func() error {
			inst, err := p.Get(ctx, s.Ref())
			if err == nil && inst.State != egressproxy.StateStopped {
				err = fmt.Errorf("get %s: state %s, want Stopped", s.Name, inst.State)
			}
			return err
		})
		if err != nil {
			return nil, err
		}
	}
	logf("libvirtscale %v: List %v ms (%v round trips), Get %v ms", rtt, row.list.wallMS, row.listR, row.get.wallMS)
	var err error
	if row.gc, err = collect(ctx, k, p, specs[:o.lsOrphans], want); err != nil {
		return nil, fmt.Errorf("gc: %w", err)
	}
	if err := k.Clone(ctx, t, specs[:o.lsOrphans], 16); err != nil { // the orphans back for the next row
		return nil, err
	}
	logf("libvirtscale %v: GC of %d orphans %v (List %v)", rtt, row.gc.orphans, row.gc.total, row.gc.list)
	for _, callers := range o.lsCallers {
		cs := make([]egressproxy.Spec, o.lsCreates)
		for i := range cs {
			cs[i] = k.Spec(fmt.Sprintf("c%d-%d-", rtt.Milliseconds(), callers), i)
		}
		c, err := concurrent(k, callers, len(cs), func(i int) error { _, err := p.Create(ctx, cs[i]); return err })
		if err != nil {
			return nil, fmt.Errorf("concurrent Creates: %w", err)
		}
		d, err := concurrent(k, callers, len(cs), func(i int) error { return p.Delete(ctx, cs[i].Ref()) })
		if err != nil {
			return nil, fmt.Errorf("concurrent Deletes: %w", err)
		}
		row.create, row.del = append(row.create, c), append(row.del, d)
		logf("libvirtscale %v: %d Creates by %d callers in %v, Deletes in %v", rtt, len(cs), callers, c.wall, d.wall)
	}
	return row, nil
}

// checkList lists and checks that exactly want's instances (name → UID)
// came back.
func checkList(ctx context.Context, p *egressproxy.Client, want map[string]string) error {
	got, err := p.List(ctx)
	if err != nil {
		return err
	}
	if len(got) != len(want) {
		return fmt.Errorf("listed %d instances, want %d", len(got), len(want))
	}
	for _, inst := range got {
		if uid, ok := want[inst.Name]; !ok || uid != inst.UID || inst.State != egressproxy.StateStopped {
			return fmt.Errorf("listed %s (UID %s, %s): not one of the owner's stopped instances", inst.Name, inst.UID, inst.State)
		}
	}
	return nil
}

// collect runs one orphan collection on p whose keep set is every UID of
// want but those of orphans, and checks it deleted exactly the orphans.
func collect(ctx context.Context, k *benchutil.KVM, p *egressproxy.Client, orphans []egressproxy.Spec, want map[string]string) (gcRun, error) {
	keep := map[string]bool{}
	for _, uid := range want {
		keep[uid] = true
	}
	for _, s := range orphans {
		delete(keep, s.UID)
	}
	k.Counter.Take()
	t0 := time.Now()
	insts, err := p.List(ctx)
	run := gcRun{list: time.Since(t0)}
	if err != nil {
		return run, err
	}
	for _, inst := range insts {
		if keep[inst.UID] {
			continue
		}
		t1 := time.Now()
		if err := p.Delete(ctx, inst.Ref); err != nil {
			return run, err
		}
		run.deletes = append(run.deletes, float64(time.Since(t1).Microseconds())/1000)
		run.orphans++
	}
	run.total = time.Since(t0)
	run.rpcs = len(k.Counter.Take())
	if run.orphans != len(orphans) {
		return run, fmt.Errorf("deleted %d orphans, want %d", run.orphans, len(orphans))
	}
	return run, nil
}

// concurrent runs fn for i in [0, n) on callers goroutines at once
// (benchutil.Each), timing each call.
func concurrent(k *benchutil.KVM, callers, n int, fn func(i int) error) (throughput, error) {
	t := throughput{n: n, callers: callers}
	var mu sync.Mutex
	k.Counter.Take()
	t0 := time.Now()
	err := benchutil.Each(context.Background(), n, callers, func(i int) error {
		t1 := time.Now()
		err := fn(i)
		mu.Lock()
		t.each = append(t.each, float64(time.Since(t1).Microseconds())/1000)
		mu.Unlock()
		return err
	})
	t.wall = time.Since(t0)
	t.rpcs = len(k.Counter.Take())
	return t, err
}

// writeLibvirtScale writes the phase's report to path.
func writeLibvirtScale(path string, r *lsResult) error {
	return os.WriteFile(path, []byte(renderLibvirtScale(r)), 0o644)
}

// renderLibvirtScale is the phase's report.
func renderLibvirtScale(r *lsResult) string {
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	p("# Real libvirt at scale")
	p("")
	p("Generated by `cmd/bench -phases libvirtscale` — do not edit by hand: rerun the command. Issue 36 (part 2) asks")
	p("how kvm2's List, Get and orphan collection behave on the real libvirtd, reached through the real sshd, when the")
	p("host holds %s instances of the entry's owner beside %d domains that are not its own, at 0 and 50 ms round-trip", thousands(r.n), r.foreign)
	p("time, and how many Creates and Deletes 20 callers get through at once (5 callers beside them, to tell what bounds")
	p("that). Target: List of 1,000 at 50 ms RTT ≤ 1 s.")
	p("")
	p("## Command")
	p("")
	p("```sh")
	p("%s", r.command)
	p("```")
	p("")
	p("Run %s – %s UTC; load average (1/5/15 min) %s at the start, %s at the end (the machine is shared). Machine:",
		r.started.Format("2006-01-02 15:04"), r.finished.Format("15:04"), r.loads[0], r.loads[1])
	p("")
	for _, m := range r.machine {
		p("- %s", m)
	}
	p("")
	p("## Setup")
	p("")
	p("The stack of `scripts/teststack` (libvirtd, sshd, a `dir` pool). One kvm2 entry (owner `bench`, domain type `qemu`)")
	p("creates one instance (cold base fetch: the 32 MiB blank qcow2 of benchutil.NewKVM), which is stopped and read back")
	p("as a template; it is then deleted. The %s instances are clones of it made with go-libvirt on a connection of the",
		thousands(r.n))
	p("bench's own (benchutil.KVM.Clone): for each, the overlay volume (qcow2 on the same base) and the seed volume")
	p("(raw, empty: never started), then the domain, libvirt's own definition of the template with the name and UID")
	p("replaced (and no UUID or MAC: libvirt makes new ones). They are defined, never started: what List, Get and Delete")
	p("read of them is what they read of an instance Create made and that was then stopped. Defining them took %.1f s.", r.fill.Seconds())
	p("The %d foreign domains (defined, no volumes): %d named like instances of the entry (`ep-<entry>--f…`, so List", r.foreign, r.foreign/2)
	p("reads their XML to tell) carrying owner `other`, and %d of other names without egressproxy metadata.", r.foreign-r.foreign/2)
	p("")
	p("At 0 ms the provider reaches sshd on loopback; at 50 ms through an in-process delay proxy")
	p("(internal/testing/lab/delayproxy) in front of sshd. Both reach libvirtd through the RPC counter")
	p("(benchutil.RPCCounter); round trips on the critical path are its `Rounds` (calls that passed more than RTT/2 after")
	p("the one before). Each figure is the median of %d runs (the runs in brackets) unless it says otherwise.", r.runs)
	p("")
	p("- **List** returns exactly the %s instances (checked: names, UIDs, all Stopped).", thousands(r.n))
	p("- **Get** of one stopped instance (a different one each run).")
	p("- **GC**: one orphan collection as `egressproxyctl gc` and the operator's OrphanCollector make it: List, then")
	p("  Delete, one after another, of each instance whose UID the keep set lacks: %d of the %s are orphans (their", r.orphans, thousands(r.n))
	p("  domains and both volumes deleted; the bench defines them again afterwards). One run per RTT. With no orphan a")
	p("  collection is one List.")
	p("- **Create / Delete throughput**: %d cache-hit Creates (each defines and starts a TCG guest) of new instances by", r.creates)
	p("  N callers at once on the one provider, then the Deletes of them the same way, beside the %s stopped", thousands(r.n))
	p("  instances. One run per RTT and N.")
	p("")
	p("## Figures")
	p("")
	p("| operation | RTT | wall (median) | runs | RPCs | round trips on the critical path | target |")
	p("| --- | --- | --- | --- | --- | --- | --- |")
	for _, row := range r.rows {
		ms := row.rtt.Milliseconds()
		tgt := ""
		if ms == 50 && r.n == 1000 {
			tgt = fmt.Sprintf("≤ 1 s: **%s**", metOr(med(row.list.wallMS) <= 1000))
		}
		p("| List of %s (beside %d foreign) | %d ms | %.0f ms | %s | %.0f | %s | %s |", thousands(r.n), r.foreign, ms, med(row.list.wallMS),
			list(row.list.wallMS, "%.0f"), med(row.list.rpcs), roundsOf(row.listR), tgt)
		p("| Get (stopped) | %d ms | %.1f ms | %s | %.0f | %s | |", ms, med(row.get.wallMS), list(row.get.wallMS, "%.1f"), med(row.get.rpcs), roundsOf(row.getR))
		g := row.gc
		p("| GC: List + %d sequential Deletes | %d ms | %.2f s (List %.0f ms, Delete %.0f ms each) | 1 | %d | | |", g.orphans, ms,
			g.total.Seconds(), float64(g.list.Microseconds())/1000, med(g.deletes), g.rpcs)
		for i := range row.create {
			for _, x := range []struct {
				name string
				t    throughput
			}{{"Create", row.create[i]}, {"Delete", row.del[i]}} {
				p("| %s throughput, %d callers | %d ms | **%.1f /s** (%d in %.2f s; each %.0f ms median) | 1 | %.1f per op | | |", x.name, x.t.callers, ms,
					x.t.perSecond(), x.t.n, x.t.wall.Seconds(), med(x.t.each), float64(x.t.rpcs)/float64(x.t.n))
			}
		}
	}
	p("")
	p("## Reading")
	p("")
	readLibvirtScale(p, r)
	p("")
	p("RPCs per operation (typical):")
	p("")
	for _, row := range r.rows {
		p("- %d ms: List `%s`; Get `%s`", row.rtt.Milliseconds(), row.list.typical(), row.get.typical())
	}
	return b.String()
}

// readLibvirtScale writes the reading of the figures: List beyond
// loopback, and the throughput as the callers grow.
func readLibvirtScale(p func(string, ...any), r *lsResult) {
	var base *lsRow
	for _, row := range r.rows {
		if row.rtt == 0 {
			base = row
		}
	}
	for _, row := range r.rows {
		if row.rtt == 0 || base == nil {
			continue
		}
		beyond := med(row.list.wallMS) - med(base.list.wallMS)
		p("- List of %s at %d ms takes %.0f ms beyond loopback, %.1f RTT: the XML reads are pipelined (kvm2 keeps up to",
			thousands(r.n), row.rtt.Milliseconds(), beyond, beyond/float64(row.rtt.Milliseconds()))
		p("  256 in flight), so the round trip is paid a few times, not once per instance; the rest is libvirtd formatting")
		p("  %s definitions (the loopback figure).", thousands(r.n+r.foreign/2))
	}
	for _, row := range r.rows {
		if len(row.create) < 2 {
			continue
		}
		var cs, ds []string
		for i := range row.create {
			cs = append(cs, fmt.Sprintf("%.1f /s with %d", row.create[i].perSecond(), row.create[i].callers))
			ds = append(ds, fmt.Sprintf("%.1f /s with %d", row.del[i].perSecond(), row.del[i].callers))
		}
		p("- At %d ms, Creates: %s callers; Deletes: %s callers.", row.rtt.Milliseconds(), strings.Join(cs, ", "), strings.Join(ds, ", "))
	}
	last := r.rows[len(r.rows)-1]
	p("- Deletes: kvm2 makes every call of an entry on its one libvirt connection, and libvirtd works on at most")
	p("  `max_client_requests` (5 by default) calls of one connection at once, the others waiting their turn; a running")
	p("  instance's Delete is mostly `DomainDestroy` of its TCG guest (about 2 s, docs/benchmarks.md), so about 2.5 a")
	p("  second is the bound from 5 callers on (each Delete took %.1f s with %d callers at %d ms).",
		med(last.del[0].each)/1000, last.del[0].callers, last.rtt.Milliseconds())
	p("- Creates: one alone takes about 0.5 s (docs/benchmarks.md); here each took %.1f s with %d callers at %d ms, so",
		med(last.create[0].each)/1000, last.create[0].callers, last.rtt.Milliseconds())
	p("  the host's own work of defining and starting guests on its 2 shared cores bounds them before the connection does.")
}

func roundsOf(r []float64) string {
	if len(r) == 0 {
		return "—"
	}
	return fmt.Sprintf("%.0f (%s)", med(r), list(r, "%.0f"))
}

func metOr(ok bool) string {
	if ok {
		return "met"
	}
	return "missed"
}

// thousands formats n with a comma every three digits.
func thousands(n int) string {
	s := strconv.Itoa(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}
