package health

import (
	"context"
	"errors"
	"fmt"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

func TestProbeAllResultsInOrder(t *testing.T) {
	t.Parallel()
	good := startFake(t, reply("HTTP/1.1 200 OK\r\n\r\n")).addr
	denied := startFake(t, reply("HTTP/1.1 403 Forbidden\r\n\r\n")).addr
	refused := closedAddr(t)
	var proxies []Proxy
	want := map[string]Kind{}
	for i := 0; i < 30; i++ {
		id := fmt.Sprintf("p%02d", i)
		addr, k := good, KindNone
		switch i % 3 {
		case 1:
			addr, k = denied, KindProxyStatus
		case 2:
			addr, k = refused, KindRefused
		}
		proxies = append(proxies, Proxy{ID: id, Address: addr})
		want[id] = k
	}
	proxies[0].Target = "override.test:80"
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { tp.Shutdown(context.Background()) })

	results := ProbeAll(context.Background(), proxies, &ProbeAllOptions{Workers: 4, Target: "example.test:443", TracerProvider: tp})
	if len(results) != len(proxies) {
		t.Fatalf("%d results for %d proxies", len(results), len(proxies))
	}
	for i, r := range results {
		if r.ID != proxies[i].ID || r.Proxy != proxies[i].Address {
			t.Fatalf("result %d is for %s/%s, want %s/%s", i, r.ID, r.Proxy, proxies[i].ID, proxies[i].Address)
		}
		if r.Kind != want[r.ID] || r.OK != (want[r.ID] == KindNone) {
			t.Errorf("%s: kind %v ok %v err %v, want %v", r.ID, r.Kind, r.OK, r.Err, want[r.ID])
		}
	}
	if results[0].Target != "override.test:80" || results[1].Target != "example.test:443" {
		t.Errorf("targets: %q %q", results[0].Target, results[1].Target)
	}
	spans := rec.Ended()
	if len(spans) != 1 || spans[0].Name() != "health.ProbeAll" {
		t.Fatalf("want one health.ProbeAll span, got %d", len(spans))
	}
	attrs := map[string]int64{}
	for _, a := range spans[0].Attributes() {
		attrs[string(a.Key)] = a.Value.AsInt64()
	}
	if attrs["health.targets"] != 30 || attrs["health.ok"] != 10 || attrs["health.failed"] != 20 || attrs["health.workers"] != 4 {
		t.Errorf("span attributes %v", attrs)
	}
}

func TestProbeAllBoundsConcurrency(t *testing.T) {
	tests := []struct {
		name    string
		workers int
		proxies int
		want    int // goroutines and connections allowed at once
	}{
		{name: "3 workers 12 proxies", workers: 3, proxies: 12, want: 3},
		{name: "workers capped by proxies", workers: 50, proxies: 5, want: 5},
		{name: "negative workers means one", workers: -2, proxies: 4, want: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// A proxy that holds every connection without answering
			// (no goroutine per connection on its side).
			silent := startFake(t, nil)
			proxies := make([]Proxy, tt.proxies)
			for i := range proxies {
				proxies[i] = Proxy{ID: fmt.Sprint(i), Address: silent.addr, Target: "example.test:443"}
			}
			// A sampler records the peak goroutine count; the round starts
			// once it runs, so base counts it and it sees the whole round.
			var peak atomic.Int64
			stop, sampling := make(chan struct{}), make(chan struct{})
			var wg sync.WaitGroup
			wg.Go(func() {
				close(sampling)
				for {
					select {
					case <-stop:
						return
					default:
					}
					if n := int64(runtime.NumGoroutine()); n > peak.Load() {
						peak.Store(n)
					}
					runtime.Gosched()
				}
			})
			<-sampling
			base := int64(runtime.NumGoroutine())
			results := ProbeAll(context.Background(), proxies, &ProbeAllOptions{Workers: tt.workers, Probe: ProbeOptions{Timeout: 100 * time.Millisecond}})
			close(stop)
			wg.Wait()
			for _, r := range results {
				if r.Kind != KindTimeout {
					t.Fatalf("%s: kind %v err %v, want timeout", r.ID, r.Kind, r.Err)
				}
			}
			if extra := peak.Load() - base; extra > int64(tt.want) {
				t.Errorf("%d extra goroutines during the round, want at most %d", extra, tt.want)
			}
			if got := silent.accepted.Load(); got != int64(tt.proxies) {
				t.Errorf("%d connections accepted, want %d", got, tt.proxies)
			}
		})
	}
}

// countingDialer counts the connections open at once on the client side.
type countingDialer struct {
	open, peak atomic.Int64
}

func (d *countingDialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	n := d.open.Add(1)
	for {
		p := d.peak.Load()
		if n <= p || d.peak.CompareAndSwap(p, n) {
			break
		}
	}
	return &countedConn{Conn: c, d: d}, nil
}

type countedConn struct {
	net.Conn
	d    *countingDialer
	once sync.Once
}

func (c *countedConn) Close() error {
	c.once.Do(func() { c.d.open.Add(-1) })
	return c.Conn.Close()
}

func TestProbeAllPeakConnections(t *testing.T) {
	t.Parallel()
	slow := startFake(t, func(c net.Conn) {
		time.Sleep(5 * time.Millisecond)
		reply("HTTP/1.1 200 OK\r\n\r\n")(c)
	})
	proxies := make([]Proxy, 40)
	for i := range proxies {
		proxies[i] = Proxy{ID: fmt.Sprint(i), Address: slow.addr}
	}
	d := &countingDialer{}
	results := ProbeAll(context.Background(), proxies, &ProbeAllOptions{Workers: 5, Target: "example.test:443", Probe: ProbeOptions{DialContext: d.DialContext}})
	for _, r := range results {
		if !r.OK {
			t.Fatalf("%s: %v", r.ID, r.Err)
		}
	}
	if p := d.peak.Load(); p > 5 || p < 1 {
		t.Fatalf("peak of %d open connections, want 1..5", p)
	}
	if n := d.open.Load(); n != 0 {
		t.Fatalf("%d connections left open", n)
	}
}

func TestProbeAllCanceled(t *testing.T) {
	t.Parallel()
	silent := startFake(t, nil)
	proxies := make([]Proxy, 20)
	for i := range proxies {
		proxies[i] = Proxy{ID: fmt.Sprint(i), Address: silent.addr, Target: "example.test:443"}
	}
	t.Run("before start", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		results := ProbeAll(ctx, proxies, &ProbeAllOptions{Workers: 4})
		for _, r := range results {
			var pe *ProbeError
			if r.Kind != KindCanceled || !errors.As(r.Err, &pe) || pe.Kind != KindCanceled {
				t.Fatalf("%s: kind %v, want canceled", r.ID, r.Kind)
			}
		}
		if n := silent.accepted.Load(); n != 0 {
			t.Fatalf("%d connections made after cancel", n)
		}
	})
	t.Run("during the round", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		start := time.Now()
		results := ProbeAll(ctx, proxies, &ProbeAllOptions{Workers: 4, Probe: ProbeOptions{Timeout: time.Hour}})
		if d := time.Since(start); d > 5*time.Second {
			t.Fatalf("round returned after %v", d)
		}
		for _, r := range results {
			if r.Kind != KindTimeout {
				t.Fatalf("%s: kind %v, want timeout", r.ID, r.Kind)
			}
		}
		if n := silent.accepted.Load(); n > 4 {
			t.Fatalf("%d connections made, want at most the 4 in flight at the deadline", n)
		}
	})
	t.Run("empty", func(t *testing.T) {
		if got := ProbeAll(context.Background(), nil, nil); len(got) != 0 {
			t.Fatalf("got %d results", len(got))
		}
	})
}
