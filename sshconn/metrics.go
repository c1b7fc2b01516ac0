package sshconn

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/egressproxy/egressproxy/internal/obs"
)

// meterName is the instrumentation scope of this package's metrics.
const meterName = "github.com/egressproxy/egressproxy/sshconn"

// The states of the shared connection the gauge reports.
const (
	stateIdle         = "idle"         // never dialed yet
	stateConnected    = "connected"    // up
	stateDisconnected = "disconnected" // declared dead, or the latest dial failed
)

// poolMeters are a Pool's instruments; the zero value records nothing.
type poolMeters struct {
	redials     metric.Int64Counter
	redialOpts  []metric.AddOption
	reg         metric.Registration
	stateGauge  metric.Int64ObservableGauge
	stateLabels [3]metric.ObserveOption // idle, connected, disconnected
}

func (p *Pool) initMeters(mp metric.MeterProvider, attrs []attribute.KeyValue) {
	if mp == nil {
		return
	}
	m := obs.Meter(mp, meterName)
	kv := obs.Clean(attrs)
	p.meters.redials, _ = m.Int64Counter(obs.MetricSSHRedials, metric.WithUnit("{dial}"),
		metric.WithDescription("Dials of the pool's shared SSH connection after its first: after it died or a dial failed."))
	p.meters.redialOpts = []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(kv...))}
	p.meters.stateGauge = obs.Int64Gauge(m, obs.MetricSSHConnectionState, "{connection}",
		"The pool's shared SSH connection, labelled with its state.")
	for i, st := range [...]string{stateIdle, stateConnected, stateDisconnected} {
		set := attribute.NewSet(append(kv[:len(kv):len(kv)], obs.KeySSHState.String(st))...)
		p.meters.stateLabels[i] = metric.WithAttributeSet(set)
	}
	reg, err := m.RegisterCallback(p.observeState, p.meters.stateGauge)
	if err == nil {
		p.meters.reg = reg
	}
}

// redialed counts one dial of the shared connection after the first.
func (p *Pool) redialed() {
	if p.meters.redials != nil {
		p.meters.redials.Add(context.Background(), 1, p.meters.redialOpts...)
	}
}

// observeState reports the shared connection once, under its state.
func (p *Pool) observeState(_ context.Context, o metric.Observer) error {
	p.mu.Lock()
	st := 0 // idle
	switch {
	case p.closed:
		p.mu.Unlock()
		return nil // its series end with it
	case p.lastErr != nil:
		st = 2
	case p.cur != nil && p.cur.isDead():
		st = 2
	case p.cur != nil:
		st = 1
	}
	p.mu.Unlock()
	o.ObserveInt64(p.meters.stateGauge, 1, p.meters.stateLabels[st])
	return nil
}

// stopMeters ends the state gauge's series (Close).
func (p *Pool) stopMeters() {
	if p.meters.reg != nil {
		_ = p.meters.reg.Unregister()
	}
}
