package controller

import (
	"context"
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
