package memprovider_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/memprovider"
)

// Options.CallDelay: every operation waits the simulated round trip before
// it runs; an ended context or Close cuts the wait short with the error of
// its class.
func TestCallDelay(t *testing.T) {
	t.Parallel()
	const d = 60 * time.Millisecond
	c := memprovider.New(&memprovider.Options{CallDelay: d})
	defer c.Close()
	ctx := context.Background()
	ref := egressproxy.Ref{Name: "ep-delay-1", UID: "uid-1"}

	for _, op := range []struct {
		name string
		call func() error
	}{
		{"Create", func() error { _, err := c.Create(ctx, egressproxy.Spec{Name: ref.Name, UID: ref.UID}); return err }},
		{"Get", func() error { _, err := c.Get(ctx, ref); return err }},
		{"List", func() error { _, err := c.List(ctx); return err }},
		{"Check", func() error { _, err := c.Check(ctx); return err }},
		{"ListImages", func() error { _, err := c.ListImages(ctx); return err }},
		{"Delete", func() error { return c.Delete(ctx, ref) }},
	} {
		t0 := time.Now()
		if err := op.call(); err != nil {
			t.Fatalf("%s: %v", op.name, err)
		}
		if took := time.Since(t0); took < d {
			t.Errorf("%s took %v, want at least the call delay %v", op.name, took, d)
		}
	}

	// Without the option, no wait (a generous bound: the machine is
	// shared).
	fast := memprovider.New(nil)
	defer fast.Close()
	t0 := time.Now()
	for range 10 {
		if _, err := fast.Check(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if took := time.Since(t0); took >= 10*d {
		t.Errorf("10 Checks without a call delay took %v", took)
	}

	// A deadline shorter than the delay: DeadlineExceeded, well before
	// the delay would have ended.
	slow := memprovider.New(&memprovider.Options{CallDelay: time.Hour})
	dctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	t0 = time.Now()
	_, err := slow.Get(dctx, ref)
	if egressproxy.Code(err) != egressproxy.DeadlineExceeded {
		t.Errorf("Get with a 20ms deadline and an hour's delay = %v (class %s), want DeadlineExceeded", err, egressproxy.Code(err))
	}
	if took := time.Since(t0); took > 30*time.Second {
		t.Errorf("Get with a 20ms deadline returned after %v", took)
	}
	// Close during the wait: the waiting call ends with ErrClosed.
	done := make(chan error, 1)
	go func() { _, err := slow.List(ctx); done <- err }()
	time.Sleep(20 * time.Millisecond) // let it start waiting; Close is right either way
	if err := slow.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, egressproxy.ErrClosed) {
			t.Errorf("List waiting its delay when Close came = %v, want ErrClosed", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("List waiting an hour's delay did not end with Close")
	}
}

// Options.Entry labels every measurement of the client with
// egressproxy.entry, so two memory entries' series differ; without it the
// attribute is absent.
func TestEntryAttribute(t *testing.T) {
	t.Parallel()
	rd := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd))
	defer mp.Shutdown(context.Background())
	a := memprovider.New(&memprovider.Options{MeterProvider: mp, Entry: "mem-a"})
	defer a.Close()
	b := memprovider.New(&memprovider.Options{MeterProvider: mp})
	defer b.Close()
	ctx := context.Background()
	for range 3 {
		if _, err := a.List(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := b.List(ctx); err != nil {
		t.Fatal(err)
	}
	var rm metricdata.ResourceMetrics
	if err := rd.Collect(ctx, &rm); err != nil {
		t.Fatal(err)
	}
	counts := map[string]uint64{} // by egressproxy.entry ("-": absent)
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "egressproxy.client.operation.duration" {
				continue
			}
			h, ok := m.Data.(metricdata.Histogram[float64])
			if !ok {
				t.Fatalf("%s is a %T", m.Name, m.Data)
			}
			for _, dp := range h.DataPoints {
				entry := "-"
				if v, ok := dp.Attributes.Value(attribute.Key("egressproxy.entry")); ok {
					entry = v.AsString()
				}
				counts[entry] += dp.Count
			}
		}
	}
	if counts["mem-a"] != 3 || counts["-"] != 1 || len(counts) != 2 {
		t.Errorf("operation counts by egressproxy.entry = %v, want mem-a:3 and 1 without the attribute", counts)
	}
}
