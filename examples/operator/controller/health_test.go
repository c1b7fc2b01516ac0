package controller

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/health"
	"github.com/egressproxy/egressproxy/internal/testing/eventually"
	"github.com/egressproxy/egressproxy/internal/testing/metrictest"
	"github.com/egressproxy/egressproxy/memprovider"
)

// TestHealthMetrics: the runnable's tracker records to HealthOptions'
// MeterProvider: a registered proxy has a state series from its first
// round, and none once it is unregistered.
func TestHealthMetrics(t *testing.T) {
	ctx := context.Background()
	m := metrictest.New(t)
	entries := map[string]*egressproxy.Client{"mem": memprovider.New(nil)}
	t.Cleanup(func() { _ = CloseEntries(entries) })
	hr, err := NewHealthRunnable(entries, HealthOptions{ConnectTarget: listenTarget(t), MeterProvider: m.MeterProvider()})
	if err != nil {
		t.Fatal(err)
	}
	states := func() map[string]string {
		out := map[string]string{}
		for _, s := range m.Collect(t) {
			if s.Name == "egressproxy.health.proxy.state" && s.Value == 1 {
				out[s.Attrs["egressproxy.proxy.id"]] = s.Attrs["egressproxy.health.state"]
			}
		}
		return out
	}
	hr.Register(Member{ID: "px-1", Addr: "127.0.0.1:1"})
	hr.Round(ctx)
	if got := states(); got["px-1"] == "" {
		t.Errorf("state series after a round: %v, want one for px-1", got)
	}
	hr.Unregister(types.NamespacedName{}, "px-1")
	if got := states(); len(got) != 0 {
		t.Errorf("state series after Unregister: %v, want none", got)
	}
}

// TestUnregisterDuringRound: a proxy unregistered while the round's probe
// of it is in flight is not tracked after the round, and has no series.
func TestUnregisterDuringRound(t *testing.T) {
	ctx := context.Background()
	m := metrictest.New(t)
	entries := map[string]*egressproxy.Client{"mem": memprovider.New(nil)}
	t.Cleanup(func() { _ = CloseEntries(entries) })
	hr, err := NewHealthRunnable(entries, HealthOptions{ConnectTarget: "127.0.0.1:9", MeterProvider: m.MeterProvider(),
		Probe: health.ProbeOptions{Timeout: time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	// The proxy accepts the probe's connection and answers nothing until
	// the test closes it.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	accepted := make(chan net.Conn, 1)
	go func() {
		if c, err := ln.Accept(); err == nil {
			accepted <- c
		}
	}()
	hr.Register(Member{ID: "px-1", Addr: ln.Addr().String()})
	done := make(chan struct{})
	go func() {
		defer close(done)
		hr.Round(ctx)
	}()
	conn := <-accepted
	hr.Unregister(types.NamespacedName{}, "px-1") // while its probe is in flight
	conn.Close()
	<-done
	if st, ok := hr.tracker.Get("px-1"); ok {
		t.Errorf("px-1 after the round: tracked (%v), want forgotten", st.State)
	}
	for _, s := range m.Collect(t) {
		if s.Name == "egressproxy.health.proxy.state" {
			t.Errorf("state series after the round: %s", s.Key())
		}
	}
}

// TestStartChecksApart: Start Checks each entry on its own loop, apart
// from the probes: while one entry's Check hangs and a probe hangs, the
// other entry is Checked again and again.
func TestStartChecksApart(t *testing.T) {
	slow, fast := memprovider.New(nil), memprovider.New(nil)
	entries := map[string]*egressproxy.Client{"slow": slow, "fast": fast}
	t.Cleanup(func() { _ = CloseEntries(entries) })
	var ctl *memprovider.Control
	if !slow.As(&ctl) {
		t.Fatal("no memprovider Control")
	}
	slowInFlight := make(chan struct{})
	var once sync.Once
	ctl.InjectFault(memprovider.OpCheck, memprovider.Fault{Delay: time.Hour, Waiting: func() { once.Do(func() { close(slowInFlight) }) }})
	hr, err := NewHealthRunnable(entries, HealthOptions{Interval: 10 * time.Millisecond, ConnectTarget: "127.0.0.1:9",
		Probe: health.ProbeOptions{Timeout: time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	// The proxy accepts the probe's connection and answers nothing.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	probeInFlight := make(chan net.Conn, 1)
	go func() {
		if c, err := ln.Accept(); err == nil {
			probeInFlight <- c
		}
	}()
	hr.Register(Member{ID: "px-1", Addr: ln.Addr().String()})

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- hr.Start(ctx) }()
	<-slowInFlight
	select {
	case conn := <-probeInFlight:
		defer conn.Close()
	case <-time.After(10 * time.Second):
		t.Fatal("no probe while slow's Check hangs")
	}
	var first time.Time
	eventually.True(t, 10*time.Second, func() bool {
		hl, ok := hr.EntryHealth("fast")
		first = hl.CheckedAt
		return ok
	}, "fast's first Check while slow's Check and the probe hang")
	eventually.True(t, 10*time.Second, func() bool {
		hl, _ := hr.EntryHealth("fast")
		return hl.CheckedAt.After(first)
	}, "fast Checked again while slow's Check and the probe hang")
	if _, ok := hr.EntryHealth("slow"); ok {
		t.Error("slow has a Check result while its Check hangs")
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Start: %v", err)
	}
}
