package health

import (
	"context"
	"runtime"
	"sync"
	"weak"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/egressproxy/egressproxy/internal/obs"
)

// probeMeter records each probe's duration by its kind. The attribute set
// of every kind is built once, so a probe's measurement allocates nothing
// of ours.
type probeMeter struct {
	hist metric.Float64Histogram
	opts [kindCount][]metric.RecordOption
}

// newProbeMeter returns the probe instruments of mp, nil for a nil mp
// (nothing is recorded).
func newProbeMeter(mp metric.MeterProvider) *probeMeter {
	if mp == nil {
		return nil
	}
	m := &probeMeter{hist: obs.DurationHistogram(obs.Meter(mp, tracerName), obs.MetricHealthProbeDuration,
		"Duration of each probe of ProbeAll and Tracker.Round, by its outcome.")}
	for k := range kindCount {
		set := attribute.NewSet(obs.KeyProbeKind.String(k.String()))
		m.opts[k] = []metric.RecordOption{metric.WithAttributeSet(set)}
	}
	return m
}

// record adds r's duration under its kind.
func (m *probeMeter) record(ctx context.Context, r *Result) {
	if m == nil {
		return
	}
	k := r.Kind
	if k >= kindCount {
		k = KindNetwork // a Kind this package does not make; kept in the fixed set
	}
	m.hist.Record(ctx, r.Total.Seconds(), m.opts[k]...)
}

// registerStateGauge makes mp's gauge of every tracked proxy's state read
// t. The callback holds t weakly: a Tracker nobody holds any more is
// collected, and its callback unregistered then, so its series end with it.
func (t *Tracker) registerStateGauge(mp metric.MeterProvider) {
	if mp == nil {
		return
	}
	m := obs.Meter(mp, tracerName)
	g := obs.Int64Gauge(m, obs.MetricHealthProxyState, "{proxy}",
		"Proxies the tracker tracks, one series per proxy labelled with its state.")
	reg, err := m.RegisterCallback(stateCallback(weak.Make(t), g), g)
	if err != nil {
		return
	}
	runtime.AddCleanup(t, func(r metric.Registration) { _ = r.Unregister() }, reg)
}

// stateCallback observes the tracker wt points to while it lives; it holds
// no strong reference to it.
func stateCallback(wt weak.Pointer[Tracker], g metric.Int64ObservableGauge) metric.Callback {
	return func(_ context.Context, o metric.Observer) error {
		if t := wt.Value(); t != nil {
			t.observeStates(o, g)
		}
		return nil
	}
}

// stateSeries keeps the attribute set of each tracked proxy's series
// between collections, so that a collection builds sets only for proxies
// that are new or changed state; a proxy missing from a collection is
// dropped from it.
type stateSeries struct {
	mu   sync.Mutex // collections of several readers may run at once
	gen  uint64     // the current collection
	sets map[string]stateSet
}

type stateSet struct {
	state State
	opt   metric.ObserveOption
	gen   uint64 // the last collection that reported it
}

// observeStates reports the proxies tracked now, and only those, each once
// with 1 and its state: a proxy the tracker forgot (grace expired, Remove)
// is absent from the next collection, and a proxy whose state changed has
// its series under the new state only.
func (t *Tracker) observeStates(o metric.Observer, g metric.Int64ObservableGauge) {
	type member struct {
		id    string
		state State
	}
	t.mu.Lock()
	members := make([]member, 0, len(t.entries))
	for id, e := range t.entries {
		members = append(members, member{id, e.State})
	}
	t.mu.Unlock()

	c := &t.series
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.sets == nil {
		c.sets = map[string]stateSet{}
	}
	c.gen++
	for _, mb := range members {
		ss, ok := c.sets[mb.id]
		if !ok || ss.state != mb.state {
			set := attribute.NewSet(obs.KeyProxyID.String(obs.Bound(mb.id)), obs.KeyHealthState.String(mb.state.String()))
			ss = stateSet{state: mb.state, opt: metric.WithAttributeSet(set)}
		}
		ss.gen = c.gen
		c.sets[mb.id] = ss
		o.ObserveInt64(g, 1, ss.opt)
	}
	for id, ss := range c.sets {
		if ss.gen != c.gen {
			delete(c.sets, id)
		}
	}
}
