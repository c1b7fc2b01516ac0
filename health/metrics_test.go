package health

import (
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/egressproxy/egressproxy/internal/obs"
	"github.com/egressproxy/egressproxy/internal/testing/eventually"
	"github.com/egressproxy/egressproxy/internal/testing/metrictest"
)

// probeCounts maps each series of the probe duration histogram to its
// count, checking the instrument's shape on the way.
func probeCounts(t *testing.T, all []metrictest.Series) map[string]uint64 {
	t.Helper()
	out := map[string]uint64{}
	for _, s := range metrictest.Named(all, obs.MetricHealthProbeDuration) {
		if s.Kind != metrictest.Histogram || s.Unit != "s" || s.Scope != tracerName || len(s.Attrs) != 1 {
			t.Errorf("%s: kind %s unit %q scope %q: want a histogram in s of %s labelled with the kind only", s.Key(), s.Kind, s.Unit, s.Scope, tracerName)
		}
		out[s.Attrs[string(obs.KeyProbeKind)]] = s.Count
	}
	return out
}

// ProbeAll records one measurement per probe, labelled with the probe's
// kind ("none" for a success), and nothing without a MeterProvider.
func TestMetricsProbeDuration(t *testing.T) {
	t.Parallel()
	good := startFake(t, reply("HTTP/1.1 200 OK\r\n\r\n")).addr
	denied := startFake(t, reply("HTTP/1.1 403 Forbidden\r\n\r\n")).addr
	refused := closedAddr(t)
	rd := metrictest.New(t)
	proxies := []Proxy{{ID: "a", Address: good}, {ID: "b", Address: good}, {ID: "c", Address: denied}, {ID: "d", Address: refused}}
	ProbeAll(context.Background(), proxies, &ProbeAllOptions{Target: "example.test:443"}) // no MeterProvider
	if got := rd.Collect(t); len(got) != 0 {
		t.Fatalf("series without a MeterProvider: %v", got)
	}
	res := ProbeAll(context.Background(), proxies, &ProbeAllOptions{Target: "example.test:443", MeterProvider: rd.MeterProvider()})
	var sum time.Duration
	for _, r := range res {
		sum += r.Total
	}
	all := rd.Collect(t)
	want := map[string]uint64{"none": 2, "proxy-status": 1, "refused": 1}
	if d := cmp.Diff(want, probeCounts(t, all)); d != "" {
		t.Errorf("probes per kind (-want +got):\n%s", d)
	}
	var got float64
	for _, s := range metrictest.Named(all, obs.MetricHealthProbeDuration) {
		got += s.Sum
	}
	if d := got - sum.Seconds(); d < -1e-9 || d > 1e-9 {
		t.Errorf("sum of durations %v s, want the results' %v", got, sum.Seconds())
	}
}

// Round records its probes with the tracker's MeterProvider, or with the
// round's own when its options name one.
func TestMetricsRoundProbesUseTheTrackersOrTheRoundsProvider(t *testing.T) {
	t.Parallel()
	good := startFake(t, reply("HTTP/1.1 200 OK\r\n\r\n")).addr
	tracker, round := metrictest.New(t), metrictest.New(t)
	tr, err := NewTracker(&TrackerOptions{MeterProvider: tracker.MeterProvider()})
	if err != nil {
		t.Fatal(err)
	}
	members := []Proxy{{ID: "a", Address: good}}
	if _, err := tr.Round(context.Background(), members, &ProbeAllOptions{Target: "example.test:443"}); err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Round(context.Background(), members, &ProbeAllOptions{Target: "example.test:443", MeterProvider: round.MeterProvider()}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		rd   *metrictest.Reader
	}{{"tracker's", tracker}, {"round's", round}} {
		if d := cmp.Diff(map[string]uint64{"none": 1}, probeCounts(t, c.rd.Collect(t))); d != "" {
			t.Errorf("the %s provider: probes per kind (-want +got):\n%s", c.name, d)
		}
	}
}

// states returns the per-proxy gauge as "id state" → value, checking the
// instrument's shape on the way.
func states(t *testing.T, rd *metrictest.Reader) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	for _, s := range metrictest.Named(rd.Collect(t), obs.MetricHealthProxyState) {
		if s.Kind != metrictest.Gauge || s.Unit != "{proxy}" || s.Scope != tracerName || len(s.Attrs) != 2 {
			t.Errorf("%s: kind %s unit %q scope %q: want a gauge in {proxy} of %s labelled with the proxy and the state", s.Key(), s.Kind, s.Unit, s.Scope, tracerName)
		}
		out[s.Attrs[string(obs.KeyProxyID)]+" "+s.Attrs[string(obs.KeyHealthState)]] = s.Value
	}
	return out
}

// proxyStates is the gauge's series of proxies in the given states: one
// per proxy, 1 under its state.
func proxyStates(m map[string]State) map[string]float64 {
	out := map[string]float64{}
	for id, st := range m {
		out[id+" "+st.String()] = 1
	}
	return out
}

// The per-proxy gauge reports exactly the proxies the tracker tracks, each
// once under its state; a proxy whose state changed has no series under the
// old one, and a proxy removed, or forgotten after its grace, none at all
// in the next collection.
func TestMetricsProxyStateGauge(t *testing.T) {
	t.Parallel()
	good := startFake(t, reply("HTTP/1.1 200 OK\r\n\r\n")).addr
	denied := startFake(t, reply("HTTP/1.1 403 Forbidden\r\n\r\n")).addr
	rd := metrictest.New(t)
	clock := &fakeClock{now: time.Unix(10, 0)}
	tr, err := NewTracker(&TrackerOptions{Rise: 2, Fall: 2, Grace: time.Minute, Now: clock.Now, MeterProvider: rd.MeterProvider()})
	if err != nil {
		t.Fatal(err)
	}
	if got := states(t, rd); len(got) != 0 {
		t.Fatalf("series before any round: %v", got)
	}
	members := []Proxy{{ID: "good", Address: good}, {ID: "denied", Address: denied}, {ID: "booting"}, {ID: "other", Address: good}}
	opts := &ProbeAllOptions{Target: "example.test:443"}
	round := func(m []Proxy) {
		t.Helper()
		if _, err := tr.Round(context.Background(), m, opts); err != nil {
			t.Fatal(err)
		}
	}
	round(members)
	want := proxyStates(map[string]State{"good": StateUnknown, "denied": StateUnknown, "booting": StateUnknown, "other": StateUnknown})
	if d := cmp.Diff(want, states(t, rd)); d != "" {
		t.Errorf("after one round (-want +got):\n%s", d)
	}
	round(members)
	want = proxyStates(map[string]State{"good": StateHealthy, "denied": StateUnhealthy, "booting": StateUnknown, "other": StateHealthy})
	if d := cmp.Diff(want, states(t, rd)); d != "" {
		t.Errorf("after two rounds (-want +got):\n%s", d)
	}

	if !tr.Remove("other") {
		t.Fatal("Remove(other) = false")
	}
	want = proxyStates(map[string]State{"good": StateHealthy, "denied": StateUnhealthy, "booting": StateUnknown})
	if d := cmp.Diff(want, states(t, rd)); d != "" {
		t.Errorf("after Remove(other) (-want +got):\n%s", d)
	}

	// booting and denied are not seen again; once their grace has passed,
	// the next round forgets them.
	clock.Advance(time.Minute)
	round([]Proxy{{ID: "good", Address: good}})
	want = proxyStates(map[string]State{"good": StateHealthy})
	if d := cmp.Diff(want, states(t, rd)); d != "" {
		t.Errorf("after the grace of booting and denied (-want +got):\n%s", d)
	}
	// The attribute sets kept between collections are the members' only.
	tr.series.mu.Lock()
	n := len(tr.series.sets)
	tr.series.mu.Unlock()
	if n != 1 {
		t.Errorf("%d attribute sets kept for 1 tracked proxy", n)
	}
}

// A long ID is bounded in the gauge's attribute, like every string
// attribute.
func TestMetricsProxyIDBounded(t *testing.T) {
	t.Parallel()
	rd := metrictest.New(t)
	tr, err := NewTracker(&TrackerOptions{MeterProvider: rd.MeterProvider()})
	if err != nil {
		t.Fatal(err)
	}
	long := string(make([]byte, 4096))
	tr.update([]observation{{id: long}})
	all := metrictest.Named(rd.Collect(t), obs.MetricHealthProxyState)
	if len(all) != 1 {
		t.Fatalf("%d series, want 1", len(all))
	}
	for _, s := range all {
		if id := s.Attrs[string(obs.KeyProxyID)]; len(id) > obs.MaxAttrLen {
			t.Errorf("an ID of %d bytes: not bounded", len(id))
		}
	}
}

// A Tracker nobody references any more stops reporting: its callback is
// unregistered once it is collected, so a program that replaces its
// tracker does not keep the old one's series (or the tracker) alive.
func TestMetricsCollectedTrackerStopsReporting(t *testing.T) {
	t.Parallel()
	rd := metrictest.New(t)
	func() {
		tr, err := NewTracker(&TrackerOptions{MeterProvider: rd.MeterProvider()})
		if err != nil {
			t.Fatal(err)
		}
		tr.update([]observation{{id: "a"}})
		if got := states(t, rd); len(got) != 1 {
			t.Fatalf("series of a live tracker: %v", got)
		}
	}()
	eventually.True(t, 10*time.Second, func() bool {
		runtime.GC()
		return len(states(t, rd)) == 0
	}, "the collected tracker's series are still reported")
}
