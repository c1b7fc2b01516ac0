package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/testing/benchutil"
	"github.com/egressproxy/egressproxy/internal/testing/lab/delayproxy"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
	"github.com/egressproxy/egressproxy/sshconn"
)

// rttOps is one operation measured on loopback and through the delay
// proxy, interleaved.
type rttOps struct {
	direct, remote opStats
	rounds         []float64 // round trips on the critical path, through the proxy
}

// beyond is the remote wall time beyond loopback in RTTs (medians).
func (r *rttOps) beyond(rtt time.Duration) float64 {
	return (med(r.remote.wallMS) - med(r.direct.wallMS)) / float64(rtt.Milliseconds())
}

type rttResult struct {
	rtt       time.Duration
	n         int
	hit, cold rttOps
	list      rttOps
	seqMS     []float64 // sequential List (1 + 2n calls one after another) through the proxy
	seqRPCs   int
	// coldTimeline is the last cold Create's calls through the proxy in
	// order, those that start a round trip marked (RPCCounter.Timeline).
	coldTimeline string
}

// runRTT measures the control path on the stack through an in-process
// delay proxy in front of its sshd (-rtt-ms of round-trip time): Create of
// a cached image and cold (a fresh entry: the blank 32 MiB qcow2 base of
// about 200 KB is fetched, so the transfer is negligible), List of
// -rtt-list powered-off instances, and next to it the sequential List
// (ConnectListAllDomains, then DomainGetXMLDesc and DomainGetState per
// domain, one after another, with go-libvirt over the same proxy). Round
// trips on the critical path are counted by the RPC counter
// (benchutil.RPCCounter.Rounds).
func runRTT(ctx context.Context, env teststack.Env, o options) (*rttResult, error) {
	rtt := time.Duration(o.rttMS) * time.Millisecond
	if rtt <= 0 {
		return nil, fmt.Errorf("-rtt-ms must be > 0")
	}
	px, err := delayproxy.New(delayproxy.Config{Target: env.SSHAddr, RTT: rtt})
	if err != nil {
		return nil, err
	}
	defer px.Close()
	paddr := px.Addr().String()
	res := &rttResult{rtt: rtt, n: o.rttList}
	gap := rtt / 2
	var timeline string // of the last call measured
	measure := func(k *benchutil.KVM, s *opStats, rounds *[]float64, fn func() error) error {
		k.Counter.Take()
		t0 := time.Now()
		err := fn()
		d := time.Since(t0)
		r := k.Counter.Rounds(gap)
		timeline = k.Counter.Timeline(gap)
		calls := k.Counter.Take()
		s.add(benchutil.Op{Wall: d, RPCs: len(calls), Calls: benchutil.Summary(calls)})
		if rounds != nil {
			*rounds = append(*rounds, float64(r))
		}
		return err
	}
	runs := o.runs
	// Cold Create: a fresh entry per run, loopback and proxy alternating.
	for i := range 2 * min(runs, 3) {
		remote := i%2 == 1
		k, err := newKVM(ctx, env, "o")
		if err != nil {
			return nil, err
		}
		p := k.Counted
		st, rounds := &res.cold.direct, (*[]float64)(nil)
		if remote {
			if p, err = k.OpenVia(ctx, paddr); err != nil {
				k.Close()
				return nil, err
			}
			st, rounds = &res.cold.remote, &res.cold.rounds
		}
		if _, err := p.Check(ctx); err != nil {
			k.Close()
			return nil, err
		}
		s := k.Spec("cold", 0)
		err = measure(k, st, rounds, func() error { _, err := p.Create(ctx, s); return err })
		k.Close()
		if err != nil {
			return nil, fmt.Errorf("cold Create: %w", err)
		}
		if remote {
			res.coldTimeline = timeline
		}
	}
	logf("rtt: cold Create loopback %v ms, through the proxy %v ms, %v round trips", res.cold.direct.wallMS, res.cold.remote.wallMS, res.cold.rounds)

	k, err := newKVM(ctx, env, "r")
	if err != nil {
		return nil, err
	}
	defer k.Close()
	remote, err := k.OpenVia(ctx, paddr)
	if err != nil {
		return nil, err
	}
	warm := k.Spec("warm", 0)
	if _, err := k.Plain.Create(ctx, warm); err != nil {
		return nil, err
	}
	if err := k.Plain.Delete(ctx, warm.Ref()); err != nil {
		return nil, err
	}
	for _, p := range []*egressproxy.Client{k.Counted, remote} {
		if _, err := p.Check(ctx); err != nil {
			return nil, err
		}
	}
	for i := range 2 * runs {
		p, st, rounds := k.Counted, &res.hit.direct, (*[]float64)(nil)
		if i%2 == 1 {
			p, st, rounds = remote, &res.hit.remote, &res.hit.rounds
		}
		s := k.Spec("h", i)
		if err := measure(k, st, rounds, func() error { _, err := p.Create(ctx, s); return err }); err != nil {
			return nil, fmt.Errorf("cache-hit Create: %w", err)
		}
		if err := k.Plain.Delete(ctx, s.Ref()); err != nil {
			return nil, err
		}
	}
	logf("rtt: cache-hit Create loopback %v ms, through the proxy %v ms, %v round trips", res.hit.direct.wallMS, res.hit.remote.wallMS, res.hit.rounds)

	for i := range o.rttList {
		s := k.Spec("l", i)
		if _, err := k.Plain.Create(ctx, s); err != nil {
			return nil, fmt.Errorf("fill Create %s: %w", s.Name, err)
		}
		if err := k.Stop(ctx, s.Name); err != nil {
			return nil, err
		}
	}
	seq, err := newSeqLister(ctx, env, paddr, k.Counter.Path())
	if err != nil {
		return nil, err
	}
	defer seq.close()
	prefix := k.DomainName("")
	for i := range runs {
		for j := range 3 {
			var err error
			switch (i + j) % 3 {
			case 0:
				err = measure(k, &res.list.direct, nil, func() error { return listN(ctx, k.Counted, o.rttList) })
			case 1:
				err = measure(k, &res.list.remote, &res.list.rounds, func() error { return listN(ctx, remote, o.rttList) })
			case 2:
				k.Counter.Take()
				t0 := time.Now()
				var n int
				n, err = seq.list(prefix)
				res.seqMS = append(res.seqMS, float64(time.Since(t0).Microseconds())/1000)
				res.seqRPCs = len(k.Counter.Take())
				if err == nil && n != o.rttList {
					err = fmt.Errorf("sequential listing found %d domains, want %d", n, o.rttList)
				}
			}
			if err != nil {
				return nil, fmt.Errorf("list: %w", err)
			}
		}
	}
	logf("rtt: List of %d loopback %v ms, through the proxy %v ms (%v round trips), sequential %v ms", o.rttList, res.list.direct.wallMS, res.list.remote.wallMS, res.list.rounds, res.seqMS)
	return res, nil
}

func listN(ctx context.Context, p *egressproxy.Client, n int) error {
	got, err := p.List(ctx)
	if err == nil && len(got) != n {
		err = fmt.Errorf("listed %d instances, want %d", len(got), n)
	}
	return err
}

// seqLister is a go-libvirt client on its own SSH connection through addr
// (the delay proxy) to socket.
type seqLister struct {
	pool *sshconn.Pool
	l    *libvirt.Libvirt
}

func newSeqLister(ctx context.Context, env teststack.Env, addr, socket string) (*seqLister, error) {
	known, err := os.ReadFile(env.KnownHosts)
	if err != nil {
		return nil, err
	}
	pool, err := sshconn.New(sshconn.Config{Address: addr, User: env.SSHUser, KeyFile: env.SSHKey, KnownHosts: []byte(benchutil.RepinKnownHosts(string(known), env.SSHAddr, addr))}, nil)
	if err != nil {
		return nil, err
	}
	client, err := pool.Client(ctx)
	if err != nil {
		pool.Close()
		return nil, err
	}
	conn, err := pool.DialUnix(ctx, client, socket)
	if err != nil {
		pool.Close()
		return nil, err
	}
	l := libvirt.NewWithDialer(&singleConn{c: conn})
	if err := l.ConnectToURI(libvirt.ConnectURI(env.LibvirtURI)); err != nil {
		conn.Close()
		pool.Close()
		return nil, err
	}
	return &seqLister{pool: pool, l: l}, nil
}

// list makes the 1 + 2n calls of a sequential List, one after another, of
// the domains whose name starts with prefix, and returns how many.
func (s *seqLister) list(prefix string) (int, error) {
	doms, _, err := s.l.ConnectListAllDomains(1, libvirt.ConnectListDomainsActive|libvirt.ConnectListDomainsInactive)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, d := range doms {
		if !strings.HasPrefix(d.Name, prefix) {
			continue
		}
		if _, err := s.l.DomainGetXMLDesc(d, 0); err != nil {
			return n, err
		}
		if _, _, err := s.l.DomainGetState(d, 0); err != nil {
			return n, err
		}
		n++
	}
	return n, nil
}

func (s *seqLister) close() {
	_ = s.l.Disconnect()
	_ = s.pool.Close()
}

type singleConn struct{ c net.Conn }

func (o *singleConn) Dial() (net.Conn, error) {
	if o.c == nil {
		return nil, fmt.Errorf("bench: connection already used")
	}
	c := o.c
	o.c = nil
	return c, nil
}
