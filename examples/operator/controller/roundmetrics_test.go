package controller

import (
	"context"
	"maps"
	"testing"

	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/memprovider"
)

// roundSeries reads the health round series from controller-runtime's
// registry (the one --metrics-bind-address serves): the histogram's
// sample count and sum, and the gauge.
func roundSeries(t *testing.T) (count uint64, sum, proxies float64) {
	t.Helper()
	mfs, err := ctrlmetrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			switch mf.GetName() {
			case "egressproxy_operator_health_round_duration_seconds":
				count, sum = m.GetHistogram().GetSampleCount(), m.GetHistogram().GetSampleSum()
			case "egressproxy_operator_health_round_proxies":
				proxies = m.GetGauge().GetValue()
			}
		}
	}
	return count, sum, proxies
}

// Every health round is one sample of the round duration histogram, and
// the gauge says how many proxies it probed.
func TestHealthRoundSeries(t *testing.T) {
	ctx := context.Background()
	entries := map[string]*egressproxy.Client{"mem": memprovider.New(nil)}
	t.Cleanup(func() { _ = CloseEntries(entries) })
	hr, err := NewHealthRunnable(entries, HealthOptions{ConnectTarget: listenTarget(t)})
	if err != nil {
		t.Fatal(err)
	}
	hr.Register(Member{ID: "px-1", Addr: "127.0.0.1:1"})
	hr.Register(Member{ID: "px-2", Addr: "127.0.0.1:1"})
	hr.Register(Member{ID: "px-3"}) // no address: in the round, not probed
	count0, sum0, _ := roundSeries(t)
	hr.Round(ctx)
	hr.Round(ctx)
	count, sum, proxies := roundSeries(t)
	if count != count0+2 || sum <= sum0 {
		t.Errorf("after two rounds the round histogram has %d samples (sum %v), before %d (sum %v); want 2 more", count, sum, count0, sum0)
	}
	if proxies != 3 {
		t.Errorf("egressproxy_operator_health_round_proxies = %v after a round of 3 registered proxies, want 3", proxies)
	}
}

// healthStates reads egressproxy_operator_health_proxies by state.
func healthStates(t *testing.T) map[string]float64 {
	t.Helper()
	mfs, err := ctrlmetrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "egressproxy_operator_health_proxies" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "state" {
					out[l.GetValue()] = m.GetGauge().GetValue()
				}
			}
		}
	}
	return out
}

// The gauge of decisions counts the registered proxies by this replica's
// tracker state after every probe: undecided until Rise successes (or
// Fall failures), a proxy without an address never decided.
func TestHealthProxiesByState(t *testing.T) {
	ctx := context.Background()
	mem := memprovider.New(&memprovider.Options{ServeProxies: true})
	entries := map[string]*egressproxy.Client{"mem": mem}
	t.Cleanup(func() { _ = CloseEntries(entries) })
	hr, err := NewHealthRunnable(entries, HealthOptions{ConnectTarget: listenTarget(t)})
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"px-1", "px-2"} {
		inst, err := mem.Create(ctx, egressproxy.Spec{Name: name, UID: "uid-" + name})
		if err != nil {
			t.Fatal(err)
		}
		hr.Register(Member{ID: name, Addr: inst.Address()})
	}
	hr.Register(Member{ID: "px-3", Addr: "127.0.0.1:1"}) // nothing listens
	hr.Register(Member{ID: "px-4"})                      // no address
	for round, want := range []map[string]float64{
		{"healthy": 0, "unhealthy": 0, "unknown": 4},
		{"healthy": 2, "unhealthy": 0, "unknown": 2},
		{"healthy": 2, "unhealthy": 1, "unknown": 1},
	} {
		hr.Round(ctx)
		if got := healthStates(t); !maps.Equal(got, want) {
			t.Errorf("after round %d: egressproxy_operator_health_proxies = %v, want %v", round+1, got, want)
		}
	}
}
