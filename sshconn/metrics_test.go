package sshconn

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.opentelemetry.io/otel/attribute"

	"github.com/egressproxy/egressproxy/internal/obs"
	"github.com/egressproxy/egressproxy/internal/testing/metrictest"
	"github.com/egressproxy/egressproxy/internal/testing/sshtest"
)

// poolSeries returns the pool's series as key → value (the redials
// counter's value, the state gauge's), checking their shape on the way.
func poolSeries(t *testing.T, rd *metrictest.Reader) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	for _, s := range rd.Collect(t) {
		switch {
		case s.Scope != meterName:
			t.Errorf("%s: scope %q, want %q", s.Key(), s.Scope, meterName)
		case s.Name == obs.MetricSSHConnectionState && (s.Kind != metrictest.Gauge || s.Unit != "{connection}"):
			t.Errorf("%s: kind %s unit %q, want a gauge in {connection}", s.Key(), s.Kind, s.Unit)
		case s.Name == obs.MetricSSHRedials && (s.Kind != metrictest.Counter || s.Unit != "{dial}"):
			t.Errorf("%s: kind %s unit %q, want a counter in {dial}", s.Key(), s.Kind, s.Unit)
		}
		out[s.Key()] = s.Value
	}
	return out
}

// stateIs is the state gauge's series with the pool in state: one, 1
// under that state; plus the redials counter when redials is not negative.
func stateIs(state string, redials int) map[string]float64 {
	out := map[string]float64{
		metrictest.Key(obs.MetricSSHConnectionState, map[string]string{"egressproxy.entry": "e1", "egressproxy.ssh.state": state}): 1,
	}
	if redials >= 0 {
		out[metrictest.Key(obs.MetricSSHRedials, map[string]string{"egressproxy.entry": "e1"})] = float64(redials)
	}
	return out
}

// The shared connection's state follows it (idle before the first dial,
// connected, disconnected once it died, connected again after the redial,
// which the counter counts) and its series end with Close; every series
// carries the pool's MetricAttributes.
func TestMetricsConnectionStateAndRedials(t *testing.T) {
	f := newFixture(t)
	rd := metrictest.New(t)
	p := newPoolWith(t, f.config(), &Options{MeterProvider: rd.MeterProvider(),
		MetricAttributes: []attribute.KeyValue{obs.KeyEntry.String("e1")}})
	want := func(what string, m map[string]float64) {
		t.Helper()
		if d := cmp.Diff(m, poolSeries(t, rd)); d != "" {
			t.Errorf("%s (-want +got):\n%s", what, d)
		}
	}
	want("before the first dial", stateIs(stateIdle, -1))
	c1, err := p.Client(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	want("after the first dial", stateIs(stateConnected, -1))
	p.Kill(c1, errors.New("test"))
	<-p.Done(c1)
	want("after the link died", stateIs(stateDisconnected, -1))
	if _, err := p.Client(context.Background()); err != nil {
		t.Fatal(err)
	}
	want("after the redial", stateIs(stateConnected, 1))
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	want("after Close", map[string]float64{
		metrictest.Key(obs.MetricSSHRedials, map[string]string{"egressproxy.entry": "e1"}): 1,
	})
}

// A failed dial leaves the connection disconnected; a dial after it is a
// redial, failed or not.
func TestMetricsFailedDials(t *testing.T) {
	f := newFixture(t)
	cfg := f.config()
	cfg.KeyFile = sshtest.WriteKey(t, f.dir, "unauthorized", sshtest.GenEd25519(t))
	rd := metrictest.New(t)
	p := newPoolWith(t, cfg, &Options{MeterProvider: rd.MeterProvider(),
		MetricAttributes: []attribute.KeyValue{obs.KeyEntry.String("e1")}})
	for i := range 3 {
		p.mu.Lock()
		p.retryAt = time.Time{} // no backoff: each call dials
		p.mu.Unlock()
		if _, err := p.Client(context.Background()); errKind(err) != KindAuthRefused {
			t.Fatalf("dial %d: %v", i, err)
		}
	}
	if d := cmp.Diff(stateIs(stateDisconnected, 2), poolSeries(t, rd)); d != "" {
		t.Errorf("after three failed dials (-want +got):\n%s", d)
	}
}
