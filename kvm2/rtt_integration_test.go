//go:build integration

package kvm2_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/testing/benchutil"
	"github.com/egressproxy/egressproxy/internal/testing/lab/delayproxy"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
	"github.com/egressproxy/egressproxy/kvm2"
)

// rttOp is one operation measured on both providers.
type rttOp struct {
	name           string
	rpcs           []int
	rounds         []int // round trips on the critical path, through the proxy
	direct, remote []time.Duration
}

func (o *rttOp) String() string {
	return fmt.Sprintf("%s: %d RPCs, %d round trips on the critical path (most of any run); wall %v direct, %v through the delay proxy (medians)",
		o.name, slices.Max(o.rpcs), slices.Max(o.rounds), median(o.direct).Round(100*time.Microsecond), median(o.remote).Round(time.Millisecond))
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

func envInt(t *testing.T, k string, def int) int {
	v := os.Getenv(k)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		t.Fatalf("%s=%q: want a positive integer", k, v)
	}
	return n
}

// TestIntegrationControlPathRTT measures the control path's round trips:
// the same entry is opened twice, once on the stack's sshd and once through
// a delay proxy that adds EGRESSPROXY_RTT_MS (default 50) of round-trip
// time, both reaching libvirtd through an RPC counter. Cache-hit Create, Get
// of a running instance, Delete and List of EGRESSPROXY_RTT_LIST (default
// 20) stopped instances run on both, interleaved, EGRESSPROXY_RTT_RUNS
// (default 3, 1 with -short) times. The round trips on the critical path are counted by
// the RPC counter on the runs through the proxy (benchutil.RPCCounter.
// Rounds: calls that waited for an answer; concurrent ones count once), so
// they do not depend on how long libvirtd takes to start a guest. The
// bounds are those of the pipelined control path: a sequential List
// (1 + 2n round trips) or Get (6) fails them.
func TestIntegrationControlPathRTT(t *testing.T) {
	rtt := time.Duration(envInt(t, "EGRESSPROXY_RTT_MS", 50)) * time.Millisecond
	listN := envInt(t, "EGRESSPROXY_RTT_LIST", 20)
	// The bounds hold on every run; -short (the stress runs, which repeat
	// the whole package under load) checks them once.
	defRuns := 3
	if testing.Short() {
		defRuns = 1
	}
	runs := envInt(t, "EGRESSPROXY_RTT_RUNS", defRuns)
	env := teststack.Require(t)

	cfg := kvm2.LifecycleConfigT(t)
	rc, err := benchutil.NewRPCCounter(t.TempDir(), cfg.LibvirtSocket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rc.Close() })
	cfg.LibvirtSocket = rc.Path()

	px, err := delayproxy.New(delayproxy.Config{Target: cfg.Address, RTT: rtt})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = px.Close() })
	known, err := os.ReadFile(env.KnownHosts)
	if err != nil {
		t.Fatal(err)
	}
	host, port, err := net.SplitHostPort(cfg.Address)
	if err != nil {
		t.Fatal(err)
	}
	_, pport, _ := net.SplitHostPort(px.Addr().String())
	rcfg := cfg
	rcfg.Address = px.Addr().String()
	rcfg.KnownHostsFile = ""
	rcfg.KnownHosts = []byte(strings.ReplaceAll(string(known), "["+host+"]:"+port, "["+host+"]:"+pport))

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	open := func(c kvm2.Config) *egressproxy.Client {
		p, err := kvm2.Open(ctx, c, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = p.Close() })
		return p
	}
	direct, remote := open(cfg), open(rcfg)
	raw, _, closeRaw, err := benchutil.Link(env, "")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(closeRaw)
	stop := func(name string) {
		t.Helper()
		err := raw.Do(ctx, func(l *libvirt.Libvirt) error {
			d, err := l.DomainLookupByName("ep-" + cfg.Entry + "--" + name)
			if err != nil {
				return err
			}
			return l.DomainDestroy(d)
		})
		if err != nil {
			t.Fatalf("stop %s: %v", name, err)
		}
	}

	// Warm up: the cold fetch of the base, and both connections dialled.
	// The cold Create (the base fetched, two dedicated connections dialled
	// for the upload and its read-back) runs through the proxy and is
	// logged with its RPCs.
	warm := egressproxy.Spec{Name: "warm", UID: "uid-warm"}
	rc.Take()
	coldStart := time.Now()
	if _, err := remote.Create(ctx, warm); err != nil {
		t.Fatal(err)
	}
	coldWall := time.Since(coldStart)
	coldRounds := rc.Rounds(rtt / 2)
	coldTimeline := rc.Timeline(rtt / 2)
	coldCalls := rc.Take()
	t.Logf("cold Create through the proxy: %d RPCs, %d round trips, in %v (%.1f RTT): %s", len(coldCalls), coldRounds, coldWall.Round(time.Millisecond), float64(coldWall)/float64(rtt), benchutil.Summary(coldCalls))
	t.Logf("cold Create's calls (* starts a round trip): %s", coldTimeline)
	// A cold Create makes 21 round trips on a quiet machine (docs/benchmarks.md
	// has the history), 2 of them the shared connection's own connect
	// (AuthList, ConnectOpen: this is its first call). The bound is the
	// documented target, 25: under CPU load (make test's stress step) the
	// dedicated connection's dial, overlapped with the first calls, can
	// start a round trip later and a drain can poll once more.
	if coldRounds > 25 {
		t.Errorf("cold Create: %d round trips of RPCs, want ≤ 25", coldRounds)
	}
	if err := direct.Delete(ctx, warm.Ref()); err != nil {
		t.Fatal(err)
	}
	for _, p := range []*egressproxy.Client{direct, remote} {
		if _, err := p.Check(ctx); err != nil {
			t.Fatal(err)
		}
	}

	measure := func(o *rttOp, p *egressproxy.Client, fn func(p *egressproxy.Client) error) {
		t.Helper()
		rc.Take()
		start := time.Now()
		err := fn(p)
		d := time.Since(start)
		rounds := rc.Rounds(rtt / 2)
		timeline := rc.Timeline(rtt / 2)
		calls := rc.Take()
		if err != nil {
			t.Fatalf("%s: %v", o.name, err)
		}
		o.rpcs = append(o.rpcs, len(calls))
		if p == direct {
			o.direct = append(o.direct, d)
		} else {
			o.remote = append(o.remote, d)
			o.rounds = append(o.rounds, rounds)
			t.Logf("%s through the proxy: %d RPCs, %d round trips, in %v: %s", o.name, len(calls), rounds, d.Round(time.Millisecond), benchutil.Summary(calls))
			t.Logf("%s: calls (* starts a round trip): %s", o.name, timeline)
		}
	}
	create := &rttOp{name: "cache-hit Create"}
	get := &rttOp{name: "Get (running, no guest OS)"}
	del := &rttOp{name: "Delete (running)"}
	for i := range runs {
		// Interleaved: direct first in even runs, through the proxy in odd.
		ps := []*egressproxy.Client{direct, remote}
		if i%2 == 1 {
			ps[0], ps[1] = ps[1], ps[0]
		}
		for j, p := range ps {
			s := egressproxy.Spec{Name: fmt.Sprintf("c%d-%d", i, j), UID: fmt.Sprintf("uid-c%d-%d", i, j)}
			measure(create, p, func(p *egressproxy.Client) error { _, err := p.Create(ctx, s); return err })
			measure(get, p, func(p *egressproxy.Client) error {
				inst, err := p.Get(ctx, s.Ref())
				if err == nil && inst.State != egressproxy.StateProvisioning {
					err = fmt.Errorf("state %s, want Provisioning (running, no address)", inst.State)
				}
				return err
			})
			measure(del, p, func(p *egressproxy.Client) error { return p.Delete(ctx, s.Ref()) })
		}
	}

	for i := range listN {
		s := egressproxy.Spec{Name: fmt.Sprintf("l%03d", i), UID: fmt.Sprintf("uid-l%03d", i)}
		if _, err := direct.Create(ctx, s); err != nil {
			t.Fatal(err)
		}
		stop(s.Name)
	}
	list := &rttOp{name: fmt.Sprintf("List of %d (stopped)", listN)}
	for i := range runs {
		ps := []*egressproxy.Client{direct, remote}
		if i%2 == 1 {
			ps[0], ps[1] = ps[1], ps[0]
		}
		for _, p := range ps {
			measure(list, p, func(p *egressproxy.Client) error {
				got, err := p.List(ctx)
				if err == nil && len(got) != listN {
					err = fmt.Errorf("listed %d instances, want %d", len(got), listN)
				}
				return err
			})
		}
	}

	for _, b := range []struct {
		op  *rttOp
		max int // round trips on the critical path
	}{
		{create, 9}, // a cache hit: the image cache keeps the pool's handle
		{get, 3},
		{del, 7},                    // Delete overlaps its lookups and deletions
		{list, 3 + (listN+255)/256}, // 1 + n/256 (kvm2's listInFlight), and slack for a worker that falls a round behind
	} {
		t.Logf("%v", b.op)
		if r := slices.Max(b.op.rounds); r > b.max {
			t.Errorf("%s: %d round trips on the critical path, want ≤ %d", b.op.name, r, b.max)
		}
	}
}
