package egressproxy

import (
	"context"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/egressproxy/egressproxy/internal/obs"
)

// clientMeters are a Client's instruments: the duration of every
// operation, and the entry's facts from the last Check as observable
// gauges, reported until Close.
type clientMeters struct {
	attrs []attribute.KeyValue // Options.MetricAttributes, cleaned
	set   attribute.Set        // the same, as a set
	ops   metric.Float64Histogram

	reachable, pool, memory, cpus, instances metric.Int64ObservableGauge
	reg                                      metric.Registration // nil when the meter refused the callback

	mu    sync.Mutex
	facts *Health // the last Check's health; nil before the first
}

func (m *clientMeters) init(mp metric.MeterProvider, attrs []attribute.KeyValue) {
	m.attrs = obs.Clean(attrs)
	m.set = attribute.NewSet(m.attrs...)
	meter := obs.Meter(mp, tracerName)
	m.ops = obs.DurationHistogram(meter, obs.MetricClientOperationDuration, "Duration of the Client's operations.")
	m.reachable = obs.Int64Gauge(meter, obs.MetricEntryReachable, "{entry}", "Whether the entry's last Check found it reachable (1) or not (0).")
	m.pool = obs.Int64Gauge(meter, obs.MetricEntryPoolAvailable, obs.UnitBytes, "Free space of the entry's storage pool at its last Check.")
	m.memory = obs.Int64Gauge(meter, obs.MetricEntryMemoryAvailable, obs.UnitBytes, "Memory the entry's host can give new guests, at its last Check.")
	m.cpus = obs.Int64Gauge(meter, obs.MetricEntryCPUCount, "{cpu}", "Logical CPUs of the entry's host, at its last Check.")
	m.instances = obs.Int64Gauge(meter, obs.MetricEntryInstanceCount, "{instance}", "The owner's running instances on the entry, at its last Check.")
	reg, err := meter.RegisterCallback(m.observe, m.reachable, m.pool, m.memory, m.cpus, m.instances)
	if err == nil {
		m.reg = reg
	}
}

// operation records one operation's duration, with its error class when
// it failed.
func (m *clientMeters) operation(ctx context.Context, op string, elapsed time.Duration, err error) {
	kv := make([]attribute.KeyValue, 0, len(m.attrs)+2)
	kv = append(kv, m.attrs...)
	kv = append(kv, obs.KeyOperation.String(op))
	kv = obs.ErrorTypeAttr(kv, err)
	m.ops.Record(ctx, elapsed.Seconds(), metric.WithAttributes(kv...))
}

// checked keeps h as the entry's facts until the next Check.
func (m *clientMeters) checked(h Health) {
	f := &Health{Reachable: h.Reachable}
	if h.Capacity != nil {
		c := *h.Capacity
		f.Capacity = &c
	}
	m.mu.Lock()
	m.facts = f
	m.mu.Unlock()
}

// observe reports the facts of the last Check: reachable always, the
// capacity only when that Check learnt it.
func (m *clientMeters) observe(_ context.Context, o metric.Observer) error {
	m.mu.Lock()
	f := m.facts
	m.mu.Unlock()
	if f == nil {
		return nil
	}
	opt := metric.WithAttributeSet(m.set)
	var up int64
	if f.Reachable {
		up = 1
	}
	o.ObserveInt64(m.reachable, up, opt)
	if c := f.Capacity; c != nil {
		o.ObserveInt64(m.pool, c.PoolAvailableBytes, opt)
		o.ObserveInt64(m.memory, c.MemoryAvailableBytes, opt)
		o.ObserveInt64(m.cpus, int64(c.CPUs), opt)
		o.ObserveInt64(m.instances, int64(c.Instances), opt)
	}
	return nil
}

// close stops reporting the facts: their series end with the client.
func (m *clientMeters) close() {
	if m.reg != nil {
		_ = m.reg.Unregister()
	}
}
