package benchutil

import (
	"context"
	"fmt"
	"io"
	"net"
	"runtime"
	"sync"
	"time"

	"github.com/egressproxy/egressproxy/health"
	"github.com/egressproxy/egressproxy/internal/testing/allocprof"
)

// SinkTarget is a TCP listener on loopback that accepts connections and
// drains them until the peer closes: a CONNECT target for probes.
type SinkTarget struct {
	Addr string
	ln   net.Listener
	wg   sync.WaitGroup
	mu   sync.Mutex
	open map[net.Conn]struct{}
}

// NewSinkTarget starts a SinkTarget.
func NewSinkTarget() (*SinkTarget, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s := &SinkTarget{Addr: ln.Addr().String(), ln: ln, open: map[net.Conn]struct{}{}}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.mu.Lock()
			s.open[c] = struct{}{}
			s.mu.Unlock()
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				_, _ = io.Copy(io.Discard, c)
				c.Close()
				s.mu.Lock()
				delete(s.open, c)
				s.mu.Unlock()
			}()
		}
	}()
	return s, nil
}

// Close stops the listener, closes open connections and waits.
func (s *SinkTarget) Close() error {
	err := s.ln.Close()
	s.mu.Lock()
	for c := range s.open {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return err
}

// ProbeRound is one ProbeAll round's figures.
type ProbeRound struct {
	Probes       int
	Wall         time.Duration
	PerSecond    float64
	AllocsPerOp  float64 // process-wide mallocs per probe (includes the in-process target's accepts)
	Failed       int
	FirstFailure error
}

// ProbeThrough runs one ProbeAll round of n probes through proxyAddr (all
// the same proxy) to target with workers in flight.
func ProbeThrough(ctx context.Context, proxyAddr, target string, n, workers int) ProbeRound {
	return ProbeThroughAuth(ctx, proxyAddr, target, "", "", n, workers)
}

// ProbeThroughAuth is ProbeThrough with basic proxy credentials (none when
// user is empty).
func ProbeThroughAuth(ctx context.Context, proxyAddr, target, user, password string, n, workers int) ProbeRound {
	proxies := make([]health.Proxy, n)
	for i := range proxies {
		proxies[i] = health.Proxy{ID: fmt.Sprint("p", i), Address: proxyAddr}
	}
	opts := &health.ProbeAllOptions{Workers: workers, Target: target, Probe: health.ProbeOptions{Timeout: 10 * time.Second, Username: user, Password: password}}
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	start := time.Now()
	res := health.ProbeAll(ctx, proxies, opts)
	wall := time.Since(start)
	runtime.ReadMemStats(&m1)
	r := ProbeRound{Probes: n, Wall: wall, PerSecond: float64(n) / wall.Seconds(), AllocsPerOp: float64(m1.Mallocs-m0.Mallocs) / float64(n)}
	for _, x := range res {
		if !x.OK {
			r.Failed++
			if r.FirstFailure == nil {
				r.FirstFailure = x.Err
			}
		}
	}
	return r
}

// ProbeAllocs runs one round with every allocation profiled and returns the
// allocations made under health.Probe per probe (count, bytes): the
// library's own cost without the target's or the runtime's.
func ProbeAllocs(ctx context.Context, proxyAddr, target string, n, workers int) (allocs, bytes float64) {
	c, b := allocprof.Under("github.com/egressproxy/egressproxy/health.Probe", func() {
		ProbeThrough(ctx, proxyAddr, target, n, workers)
	})
	return float64(c) / float64(n), float64(b) / float64(n)
}
