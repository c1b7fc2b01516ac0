package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/testing/benchutil"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// opStats collects runs of one operation.
type opStats struct {
	wallMS []float64
	rpcs   []float64
	calls  map[string]int // distinct RPC summaries seen, with their counts
}

func (s *opStats) add(op benchutil.Op) {
	s.wallMS = append(s.wallMS, float64(op.Wall.Microseconds())/1000)
	s.rpcs = append(s.rpcs, float64(op.RPCs))
	if s.calls == nil {
		s.calls = map[string]int{}
	}
	s.calls[op.Calls]++
}

// typical is the most frequent RPC summary.
func (s *opStats) typical() string {
	best, n := "", 0
	for k, v := range s.calls {
		if v > n || (v == n && k < best) {
			best, n = k, v
		}
	}
	return best
}

type controlResult struct {
	create, getRunning, del opStats
}

func newKVM(ctx context.Context, env teststack.Env, tag string) (*benchutil.KVM, error) {
	sfx := fmt.Sprintf("%04x", rand.IntN(1<<16))
	dir := filepath.Join(env.Dir, "bench")
	oct := 200 + rand.IntN(50)
	return benchutil.NewKVM(ctx, env, dir, "bn"+tag+sfx, "vbbn"+tag+sfx, "10.213."+strconv.Itoa(oct))
}

// runControl measures cache-hit Create, Get and Delete of running
// instances (each Create starts a TCG guest; with no guest OS on the blank
// base, Get does the full address lookup and finds none).
func runControl(ctx context.Context, env teststack.Env, o options) (*controlResult, error) {
	k, err := newKVM(ctx, env, "c")
	if err != nil {
		return nil, err
	}
	defer k.Close()
	warm := k.Spec("warm", 0)
	if _, err := k.Counted.Create(ctx, warm); err != nil {
		return nil, fmt.Errorf("warm-up Create (cold base fetch): %w", err)
	}
	if err := k.Counted.Delete(ctx, warm.Ref()); err != nil {
		return nil, err
	}
	res := &controlResult{}
	var specs []egressproxy.Spec
	for i := range o.runs {
		s := k.Spec("c", i)
		specs = append(specs, s)
		op, err := k.Measure(func(p *egressproxy.Client) error { _, err := p.Create(ctx, s); return err })
		if err != nil {
			return nil, fmt.Errorf("create %s: %w", s.Name, err)
		}
		res.create.add(op)
	}
	for _, s := range specs {
		var inst egressproxy.Instance
		op, err := k.Measure(func(p *egressproxy.Client) error { var err error; inst, err = p.Get(ctx, s.Ref()); return err })
		if err != nil {
			return nil, fmt.Errorf("get %s: %w", s.Name, err)
		}
		if inst.State != egressproxy.StateProvisioning {
			return nil, fmt.Errorf("get %s: state %v, want Provisioning (running, no address)", s.Name, inst.State)
		}
		res.getRunning.add(op)
	}
	for _, s := range specs {
		op, err := k.Measure(func(p *egressproxy.Client) error { return p.Delete(ctx, s.Ref()) })
		if err != nil {
			return nil, fmt.Errorf("delete %s: %w", s.Name, err)
		}
		res.del.add(op)
	}
	logf("control: create %v ms, get %v ms, delete %v ms", res.create.wallMS, res.getRunning.wallMS, res.del.wallMS)
	return res, nil
}

// scaleRow is the cost of operations with n instances defined.
type scaleRow struct {
	n                 int
	create, get, list opStats
	del               opStats
}

type scaleResult struct {
	rows []scaleRow
	// concurrent Gets at the largest count: pooled kvm2 vs direct go-libvirt
	gets                      int
	domains                   int
	pooledS, directS, decodeS []float64
	pooledVsDirect            []float64 // direct time / pooled time per pair (throughput ratio)
	pooledVsDecode            []float64 // same against direct + kvm2's XML decoding
	getsLoad                  string    // load average (1/5/15 min) just before the concurrent Gets
	fillCreateMS              []float64
	stopAfterCreate           bool
}

// runScale grows one entry to each count of -scale (instances are created
// by kvm2, which starts them, and then powered off so 100 TCG guests do not
// run at once) and measures at each count: Create of one more (then Delete
// of it), Get of an existing (powered-off) instance, List of all.
func runScale(ctx context.Context, env teststack.Env, o options) (*scaleResult, error) {
	var counts []int
	for _, f := range strings.Split(o.scale, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return nil, fmt.Errorf("-scale %q: bad count %q", o.scale, f)
		}
		counts = append(counts, n)
	}
	slices.Sort(counts)
	k, err := newKVM(ctx, env, "s")
	if err != nil {
		return nil, err
	}
	defer k.Close()
	res := &scaleResult{stopAfterCreate: true}
	have := 0
	var specs []egressproxy.Spec
	for _, n := range counts {
		for have < n {
			s := k.Spec("i", have)
			t0 := time.Now()
			if _, err := k.Plain.Create(ctx, s); err != nil {
				return nil, fmt.Errorf("fill Create %s: %w", s.Name, err)
			}
			res.fillCreateMS = append(res.fillCreateMS, float64(time.Since(t0).Microseconds())/1000)
			if err := k.Stop(ctx, s.Name); err != nil {
				return nil, fmt.Errorf("stop %s: %w", s.Name, err)
			}
			specs = append(specs, s)
			have++
		}
		logf("scale: %d instances (load %s)", have, loadavg())
		row := scaleRow{n: n}
		for i := range o.runs {
			s := k.Spec(fmt.Sprintf("x%d-", n), i)
			op, err := k.Measure(func(p *egressproxy.Client) error { _, err := p.Create(ctx, s); return err })
			if err != nil {
				return nil, fmt.Errorf("create %s: %w", s.Name, err)
			}
			row.create.add(op)
			if err := k.Stop(ctx, s.Name); err != nil {
				return nil, err
			}
			op, err = k.Measure(func(p *egressproxy.Client) error { return p.Delete(ctx, s.Ref()) })
			if err != nil {
				return nil, fmt.Errorf("delete %s: %w", s.Name, err)
			}
			row.del.add(op)
		}
		for range o.runs {
			s := specs[rand.IntN(len(specs))]
			op, err := k.Measure(func(p *egressproxy.Client) error { _, err := p.Get(ctx, s.Ref()); return err })
			if err != nil {
				return nil, fmt.Errorf("get %s: %w", s.Name, err)
			}
			row.get.add(op)
		}
		for range o.runs {
			var got []egressproxy.Instance
			op, err := k.Measure(func(p *egressproxy.Client) error { var err error; got, err = p.List(ctx); return err })
			if err != nil {
				return nil, fmt.Errorf("list: %w", err)
			}
			if len(got) != n {
				return nil, fmt.Errorf("list returned %d instances, want %d", len(got), n)
			}
			row.list.add(op)
		}
		res.rows = append(res.rows, row)
	}
	// Concurrent Gets over all instances: kvm2 on its pooled connection vs
	// the same RPCs with go-libvirt directly on one connection, paired.
	refs := make([]egressproxy.Ref, len(specs))
	doms := make([]string, len(specs))
	for i, s := range specs {
		refs[i], doms[i] = s.Ref(), k.DomainName(s.Name)
	}
	res.gets, res.domains = o.gets, len(specs)
	res.getsLoad = loadavg()
	for i := range o.runs {
		pooled := func() error {
			d, err := benchutil.ConcurrentGets(ctx, k.Plain, refs, o.gets)
			res.pooledS = append(res.pooledS, d.Seconds())
			return err
		}
		direct := func() error {
			d, err := benchutil.DirectGets(ctx, env, doms, o.gets, false)
			res.directS = append(res.directS, d.Seconds())
			return err
		}
		decode := func() error {
			d, err := benchutil.DirectGets(ctx, env, doms, o.gets, true)
			res.decodeS = append(res.decodeS, d.Seconds())
			return err
		}
		steps := []func() error{pooled, direct, decode}
		for j := range steps {
			if err := steps[(i+j)%len(steps)](); err != nil {
				return nil, fmt.Errorf("concurrent Gets: %w", err)
			}
		}
	}
	res.pooledVsDirect = benchutil.Ratios(res.directS, res.pooledS)
	res.pooledVsDecode = benchutil.Ratios(res.decodeS, res.pooledS)
	logf("scale: %d concurrent Gets pooled %v s, direct %v s, direct+decode %v s", o.gets, res.pooledS, res.directS, res.decodeS)
	return res, nil
}
