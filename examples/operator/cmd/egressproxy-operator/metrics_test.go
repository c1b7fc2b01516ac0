package main

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/memprovider"
)

// The library's instruments reach the Prometheus registry under the names
// docs/observability.md gives, with their attributes as labels.
func TestMeterProviderToPrometheus(t *testing.T) {
	reg := prometheus.NewRegistry()
	mp, err := newMeterProvider(reg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	c := memprovider.New(&memprovider.Options{MeterProvider: mp})
	t.Cleanup(func() { _ = c.Close() })
	ctx := context.Background()
	if _, err := c.Create(ctx, egressproxy.Spec{Name: "px", UID: "uid-px"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Check(ctx); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			labels := ""
			for _, l := range m.GetLabel() {
				if l.GetName() == "egressproxy_operation" {
					labels = "{" + l.GetName() + "=" + l.GetValue() + "}"
				}
			}
			switch {
			case m.GetHistogram() != nil:
				got[mf.GetName()+"_count"+labels] = float64(m.GetHistogram().GetSampleCount())
			case m.GetGauge() != nil:
				got[mf.GetName()+labels] = m.GetGauge().GetValue()
			}
		}
	}
	for name, want := range map[string]float64{
		"egressproxy_client_operation_duration_seconds_count{egressproxy_operation=create}": 1,
		"egressproxy_client_operation_duration_seconds_count{egressproxy_operation=check}":  1,
		"egressproxy_entry_reachable":            1,
		"egressproxy_entry_instance_count":       1,
		"egressproxy_entry_cpu_count":            8,
		"egressproxy_entry_pool_available_bytes": 100 << 30,
	} {
		if got[name] != want {
			t.Errorf("%s = %v, want %v", name, got[name], want)
		}
	}
	if t.Failed() {
		t.Logf("gathered: %v", got)
	}
}
