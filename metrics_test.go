package egressproxy_test

import (
	"context"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"go.opentelemetry.io/otel/attribute"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/internal/obs"
	"github.com/egressproxy/egressproxy/internal/testing/metrictest"
	"github.com/egressproxy/egressproxy/memprovider"
)

const scope = "github.com/egressproxy/egressproxy"

// opKey is the series of one operation's outcome in the duration
// histogram.
func opKey(op, errType string) string {
	a := map[string]string{"egressproxy.operation": op}
	if errType != "" {
		a["error.type"] = errType
	}
	return metrictest.Key(obs.MetricClientOperationDuration, a)
}

// Every Client operation adds one measurement to the duration histogram,
// labelled with the operation and, when it failed, the error's class: the
// series and their counts after a scripted run are exactly these.
func TestMetricsOperationDuration(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rd := metrictest.New(t)
	c := memprovider.New(&memprovider.Options{MeterProvider: rd.MeterProvider()})
	var ctl *memprovider.Control
	c.As(&ctl)

	spec := goodSpec()
	mustNo := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	_, err := c.Create(ctx, spec)
	mustNo("Create", err)
	_, err = c.Create(ctx, egressproxy.Spec{Name: "Bad Name", UID: "u"})
	if egressproxy.Code(err) != egressproxy.Permanent {
		t.Fatalf("bad Create: %v", err)
	}
	_, err = c.Get(ctx, spec.Ref())
	mustNo("Get", err)
	_, err = c.Get(ctx, egressproxy.Ref{Name: "proxy-z", UID: "uid-z"})
	if egressproxy.Code(err) != egressproxy.NotFound {
		t.Fatalf("Get missing: %v", err)
	}
	ctl.InjectFault(memprovider.OpList, memprovider.Fault{Code: egressproxy.Transient, Times: 1})
	_, err = c.List(ctx)
	if egressproxy.Code(err) != egressproxy.Transient {
		t.Fatalf("List with a fault: %v", err)
	}
	_, err = c.List(ctx)
	mustNo("List", err)
	_, err = c.Check(ctx)
	mustNo("Check", err)
	_, err = c.WaitRunning(ctx, spec.Ref(), nil)
	mustNo("WaitRunning", err)
	_, err = c.ListImages(ctx)
	mustNo("ListImages", err)
	_, err = c.VerifyImage(ctx, memprovider.DefaultImageKey)
	mustNo("VerifyImage", err)
	if err := c.EvictImage(ctx, memprovider.DefaultImageKey); egressproxy.Code(err) != egressproxy.Permanent {
		t.Fatalf("EvictImage of a base in use: %v", err)
	}
	mustNo("Delete", c.Delete(ctx, spec.Ref()))
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if err := c.Delete(cancelled, spec.Ref()); egressproxy.Code(err) != egressproxy.Canceled {
		t.Fatalf("Delete with a cancelled context: %v", err)
	}
	mustNo("Close", c.Close())
	if _, err := c.Get(ctx, spec.Ref()); egressproxy.Code(err) != egressproxy.Permanent {
		t.Fatalf("Get after Close: %v", err)
	}

	got := map[string]uint64{}
	for _, s := range metrictest.Named(rd.Collect(t), obs.MetricClientOperationDuration) {
		if s.Scope != scope || s.Unit != "s" || s.Kind != metrictest.Histogram {
			t.Errorf("%s: scope %q unit %q kind %s, want %s, s, histogram", s.Key(), s.Scope, s.Unit, s.Kind, scope)
		}
		if !cmp.Equal(s.Bounds, obs.DurationBuckets()) {
			t.Errorf("%s: buckets %v", s.Key(), s.Bounds)
		}
		if s.Sum < 0 {
			t.Errorf("%s: sum %v", s.Key(), s.Sum)
		}
		got[s.Key()] = s.Count
	}
	want := map[string]uint64{
		opKey("create", ""):               1,
		opKey("create", "Permanent"):      1,
		opKey("get", ""):                  1,
		opKey("get", "NotFound"):          1,
		opKey("get", "Permanent"):         1, // after Close
		opKey("list", "Transient"):        1,
		opKey("list", ""):                 1,
		opKey("check", ""):                1,
		opKey("wait", ""):                 1,
		opKey("list-images", ""):          1,
		opKey("verify-image", ""):         1,
		opKey("evict-image", "Permanent"): 1,
		opKey("delete", ""):               1,
		opKey("delete", "Canceled"):       1,
		opKey("close", ""):                1,
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("operation duration series: count per series (-want +got):\n%s", d)
	}
}

// The entry's facts from the last Check are gauges: none before the first
// Check; reachability and the capacity after one, following the instances
// that run; only reachability (0) after a Check that found the entry
// unreachable; nothing after Close.
func TestMetricsEntryFacts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rd := metrictest.New(t)
	c := memprovider.New(&memprovider.Options{MeterProvider: rd.MeterProvider(),
		Capacity: egressproxy.Capacity{MemoryAvailableBytes: 3 << 30, CPUs: 4, PoolAvailableBytes: 7 << 30}})
	var ctl *memprovider.Control
	c.As(&ctl)

	facts := func() map[string]float64 {
		out := map[string]float64{}
		for _, s := range rd.Collect(t) {
			if !strings.HasPrefix(s.Name, "egressproxy.entry.") {
				continue
			}
			if s.Kind != metrictest.Gauge || s.Scope != scope || len(s.Attrs) != 0 {
				t.Errorf("%s: kind %s scope %q attrs %v, want a gauge of %s without attributes", s.Key(), s.Kind, s.Scope, s.Attrs, scope)
			}
			out[s.Name+" "+s.Unit] = s.Value
		}
		return out
	}
	check := func(what string, want map[string]float64) {
		t.Helper()
		if _, err := c.Check(ctx); err != nil {
			t.Fatalf("%s: Check: %v", what, err)
		}
		if d := cmp.Diff(want, facts()); d != "" {
			t.Errorf("%s: entry facts (-want +got):\n%s", what, d)
		}
	}
	all := func(instances float64) map[string]float64 {
		return map[string]float64{
			obs.MetricEntryReachable + " {entry}":        1,
			obs.MetricEntryMemoryAvailable + " By":       3 << 30,
			obs.MetricEntryCPUCount + " {cpu}":           4,
			obs.MetricEntryPoolAvailable + " By":         7 << 30,
			obs.MetricEntryInstanceCount + " {instance}": instances,
		}
	}

	if got := facts(); len(got) != 0 {
		t.Errorf("facts before any Check: %v", got)
	}
	check("empty entry", all(0))
	for _, n := range []string{"a", "b"} {
		if _, err := c.Create(ctx, egressproxy.Spec{Name: n, UID: "uid-" + n}); err != nil {
			t.Fatal(err)
		}
	}
	if err := ctl.SetState(egressproxy.Ref{Name: "b", UID: "uid-b"}, egressproxy.StateStopped); err != nil {
		t.Fatal(err)
	}
	check("one running, one stopped", all(1))

	ctl.InjectFault(memprovider.OpCheck, memprovider.Fault{Code: egressproxy.Transient, Reason: egressproxy.ReasonUnreachable, Times: 1})
	check("unreachable", map[string]float64{obs.MetricEntryReachable + " {entry}": 0})
	check("reachable again", all(1))

	// A Check that fails as a call (its context ended) leaves the facts.
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := c.Check(cancelled); err == nil {
		t.Fatal("Check with a cancelled context succeeded")
	}
	if d := cmp.Diff(all(1), facts()); d != "" {
		t.Errorf("after a cancelled Check (-want +got):\n%s", d)
	}

	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if got := facts(); len(got) != 0 {
		t.Errorf("facts after Close: %v", got)
	}
}

// A backend's MetricAttributes label every measurement of its client, on
// the histogram and on the gauges alike; an empty value is left out.
func TestMetricsAttributesOfTheBackend(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rd := metrictest.New(t)
	r := &recorder{}
	c := driver.NewClient(r, &egressproxy.Options{MeterProvider: rd.MeterProvider(),
		MetricAttributes: []attribute.KeyValue{obs.KeyEntry.String("hv-1"), attribute.String("empty", "")}})
	defer c.Close()
	if _, err := c.Check(ctx); err != nil {
		t.Fatal(err)
	}
	all := rd.Collect(t)
	wantKeys := []string{
		metrictest.Key(obs.MetricClientOperationDuration, map[string]string{"egressproxy.entry": "hv-1", "egressproxy.operation": "check"}),
		metrictest.Key(obs.MetricEntryReachable, map[string]string{"egressproxy.entry": "hv-1"}),
	}
	var got []string
	for _, s := range all {
		got = append(got, s.Key())
	}
	// The recorder's Health has no Capacity: reachability only.
	if d := cmp.Diff(wantKeys, got); d != "" {
		t.Errorf("series (-want +got):\n%s", d)
	}
}
