package health

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/egressproxy/egressproxy/internal/testing/allocprof"
)

// fastProxies is a set of minimal in-process CONNECT responders on loopback:
// one goroutine per listener, serving its connections one after the other
// (accept, read the request head, answer 200, wait for the client to close).
type fastProxies struct {
	lns   []net.Listener
	addrs []string
	wg    sync.WaitGroup
}

var connectOK = []byte("HTTP/1.1 200 Connection established\r\n\r\n")

func startFastProxies(tb testing.TB, n int) *fastProxies {
	tb.Helper()
	p := &fastProxies{}
	lc := net.ListenConfig{KeepAlive: -1}
	for i := 0; i < n; i++ {
		ln, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
		if err != nil {
			p.close()
			tb.Fatalf("listener %d: %v", i, err)
		}
		p.lns = append(p.lns, ln)
		p.addrs = append(p.addrs, ln.Addr().String())
		p.wg.Add(1)
		go p.serve(ln)
	}
	tb.Cleanup(p.close)
	return p
}

func (p *fastProxies) serve(ln net.Listener) {
	defer p.wg.Done()
	var buf [512]byte
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		n := 0
		for !bytes.Contains(buf[:n], []byte("\r\n\r\n")) && n < len(buf) {
			m, err := c.Read(buf[n:])
			if err != nil {
				break
			}
			n += m
		}
		if _, err := c.Write(connectOK); err == nil {
			for {
				if _, err := c.Read(buf[:]); err != nil {
					break
				}
			}
		}
		c.Close()
	}
}

func (p *fastProxies) close() {
	for _, ln := range p.lns {
		ln.Close()
	}
	p.wg.Wait()
}

// probeAllocs runs one round with every allocation profiled and returns the
// allocations (count, bytes) made under Probe, per probe: the library's own
// cost, without the in-process fake proxies' accept path.
func probeAllocs(tb testing.TB, proxies []Proxy, opts *ProbeAllOptions) (allocs, bytes float64) {
	var res []Result
	n, b := allocprof.Under("github.com/egressproxy/egressproxy/health.Probe", func() {
		res = ProbeAll(context.Background(), proxies, opts)
	})
	for _, r := range res {
		if !r.OK {
			tb.Fatalf("%s: %v", r.ID, r.Err)
		}
	}
	return float64(n) / float64(len(proxies)), float64(b) / float64(len(proxies))
}

// BenchmarkProbe1000Proxies probes 1,000 in-process CONNECT proxies on
// loopback per op with ProbeAll and a fixed worker count. Reported:
//
//	probes/s           probes completed per second of wall time
//	allocs/probe       process-wide mallocs per probe (library + fake proxies)
//	probe-allocs/probe allocations made under Probe only (memory profile)
//	probe-B/probe      bytes allocated under Probe only
//	goroutines/inflight peak extra goroutines during the rounds / workers
func BenchmarkProbe1000Proxies(b *testing.B) {
	const nProxies = 1000
	px := startFastProxies(b, nProxies)
	proxies := make([]Proxy, nProxies)
	for i, a := range px.addrs {
		proxies[i] = Proxy{ID: fmt.Sprint("p", i), Address: a}
	}
	for _, workers := range []int{32, 128} {
		b.Run(fmt.Sprintf("workers=%d", workers), func(b *testing.B) {
			opts := &ProbeAllOptions{Workers: workers, Target: "203.0.113.1:443", Probe: ProbeOptions{Timeout: 5 * time.Second}}
			// Warm up (pools, listeners' accept queues).
			for _, r := range ProbeAll(context.Background(), proxies, opts) {
				if !r.OK {
					b.Fatalf("warm-up %s: %v", r.ID, r.Err)
				}
			}
			var peak atomic.Int64
			stop, sampling := make(chan struct{}), make(chan struct{})
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				close(sampling)
				t := time.NewTicker(time.Millisecond)
				defer t.Stop()
				for {
					select {
					case <-stop:
						return
					case <-t.C:
						if n := int64(runtime.NumGoroutine()); n > peak.Load() {
							peak.Store(n)
						}
					}
				}
			}()
			<-sampling
			base := int64(runtime.NumGoroutine())
			var ms0, ms1 runtime.MemStats
			runtime.ReadMemStats(&ms0)
			failed := 0
			var firstErr error
			b.ResetTimer()
			start := time.Now()
			for i := 0; i < b.N; i++ {
				for _, r := range ProbeAll(context.Background(), proxies, opts) {
					if !r.OK {
						failed++
						if firstErr == nil {
							firstErr = r.Err
						}
					}
				}
			}
			elapsed := time.Since(start)
			b.StopTimer()
			runtime.ReadMemStats(&ms1)
			close(stop)
			wg.Wait()
			if failed > 0 {
				b.Fatalf("%d probes failed, first: %v", failed, firstErr)
			}
			probes := float64(b.N * nProxies)
			b.ReportMetric(probes/elapsed.Seconds(), "probes/s")
			b.ReportMetric(float64(ms1.Mallocs-ms0.Mallocs)/probes, "allocs/probe")
			b.ReportMetric(float64(peak.Load()-base)/float64(workers), "goroutines/inflight")
			a, by := probeAllocs(b, proxies, opts)
			b.ReportMetric(a, "probe-allocs/probe")
			b.ReportMetric(by, "probe-B/probe")
		})
	}
}

// BenchmarkProbe measures one probe at a time against one fast proxy.
func BenchmarkProbe(b *testing.B) {
	px := startFastProxies(b, 1)
	b.ReportAllocs()
	for b.Loop() {
		if r := Probe(context.Background(), px.addrs[0], "203.0.113.1:443", nil); !r.OK {
			b.Fatal(r.Err)
		}
	}
}

// jsonExporter is a metric exporter that encodes every export as JSON and
// throws it away: an exporter's work without a network.
type jsonExporter struct{ exports atomic.Int64 }

func (e *jsonExporter) Temporality(k sdkmetric.InstrumentKind) metricdata.Temporality {
	return sdkmetric.DefaultTemporalitySelector(k)
}

func (e *jsonExporter) Aggregation(k sdkmetric.InstrumentKind) sdkmetric.Aggregation {
	return sdkmetric.DefaultAggregationSelector(k)
}

func (e *jsonExporter) Export(_ context.Context, rm *metricdata.ResourceMetrics) error {
	e.exports.Add(1)
	return json.NewEncoder(io.Discard).Encode(rm)
}

func (e *jsonExporter) ForceFlush(context.Context) error { return nil }
func (e *jsonExporter) Shutdown(context.Context) error   { return nil }

// BenchmarkProbe1000ProxiesMeter runs Tracker.Round over the 1,000
// in-process proxies of BenchmarkProbe1000Proxies (workers=32) without a
// MeterProvider (meter=none) and with the OpenTelemetry SDK's, exporting
// every second through a JSON encoder (meter=sdk): what the probe
// histogram and the per-proxy state gauge cost the probe hot path.
// Reported: probes/s (wall time) and cpu-µs/probe (the process's user and
// system CPU per probe, fake proxies and exports included), which a
// machine shared with other work disturbs less. Run the two alternately
// (one process each) and compare medians (docs/health-benchmark.md).
func BenchmarkProbe1000ProxiesMeter(b *testing.B) {
	const nProxies = 1000
	px := startFastProxies(b, nProxies)
	proxies := make([]Proxy, nProxies)
	for i, a := range px.addrs {
		proxies[i] = Proxy{ID: fmt.Sprint("p", i), Address: a}
	}
	for _, meter := range []string{"none", "sdk"} {
		b.Run("meter="+meter, func(b *testing.B) {
			var mp metric.MeterProvider
			exp := &jsonExporter{}
			if meter == "sdk" {
				sdk := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewPeriodicReader(exp, sdkmetric.WithInterval(time.Second))))
				b.Cleanup(func() { _ = sdk.Shutdown(context.Background()) })
				mp = sdk
			}
			tr, err := NewTracker(&TrackerOptions{MeterProvider: mp})
			if err != nil {
				b.Fatal(err)
			}
			opts := &ProbeAllOptions{Workers: 32, Target: "203.0.113.1:443", Probe: ProbeOptions{Timeout: 5 * time.Second}}
			round := func() {
				res, err := tr.Round(context.Background(), proxies, opts)
				if err != nil {
					b.Fatal(err)
				}
				for _, r := range res {
					if !r.OK {
						b.Fatalf("%s: %v", r.ID, r.Err)
					}
				}
			}
			round() // warm up
			var ms0, ms1 runtime.MemStats
			runtime.ReadMemStats(&ms0)
			cpu0 := processCPU(b)
			b.ResetTimer()
			start := time.Now()
			for i := 0; i < b.N; i++ {
				round()
			}
			elapsed := time.Since(start)
			b.StopTimer()
			cpu := processCPU(b) - cpu0
			runtime.ReadMemStats(&ms1)
			probes := float64(b.N * nProxies)
			b.ReportMetric(probes/elapsed.Seconds(), "probes/s")
			b.ReportMetric(float64(cpu.Microseconds())/probes, "cpu-µs/probe")
			b.ReportMetric(float64(ms1.Mallocs-ms0.Mallocs)/probes, "allocs/probe")
			if meter == "sdk" && exp.exports.Load() == 0 && elapsed > 2*time.Second {
				b.Errorf("no export in %v", elapsed)
			}
		})
	}
}

// BenchmarkProbeMeterRecord is the cost a probe's measurement adds to the
// hot path, with the SDK's MeterProvider (a ManualReader, never collected).
func BenchmarkProbeMeterRecord(b *testing.B) {
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
	b.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	m := newProbeMeter(mp)
	r := Result{OK: true, Total: 150 * time.Microsecond}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		m.record(ctx, &r)
	}
}

// BenchmarkTrackerStateCollect is the cost of one collection of the state
// gauge of a tracker of 1,000 proxies (1,000 series), paid by the
// exporter's goroutine, not by probes.
func BenchmarkTrackerStateCollect(b *testing.B) {
	rd := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd))
	b.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	tr, err := NewTracker(&TrackerOptions{MeterProvider: mp})
	if err != nil {
		b.Fatal(err)
	}
	obs := make([]observation, 1000)
	for i := range obs {
		obs[i] = observation{id: fmt.Sprint("p", i), address: "127.0.0.1:1", result: Result{OK: true}}
	}
	tr.update(obs)
	var rm metricdata.ResourceMetrics
	b.ReportAllocs()
	for b.Loop() {
		if err := rd.Collect(context.Background(), &rm); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	if n := len(rm.ScopeMetrics[0].Metrics[0].Data.(metricdata.Gauge[int64]).DataPoints); n != 1000 {
		b.Fatalf("%d series collected, want 1000", n)
	}
	runtime.KeepAlive(tr) // the gauge reports only while the tracker lives
}
