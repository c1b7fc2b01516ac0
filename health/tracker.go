package health

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/obs"
)

// Defaults of TrackerOptions' zero fields.
const (
	defaultRise  = 2
	defaultFall  = 3
	defaultGrace = 2 * time.Minute
)

// State is a proxy's health as decided by a Tracker.
type State uint8

const (
	// StateUnknown: tracked, but neither threshold has been reached yet.
	StateUnknown State = iota
	// StateHealthy: the last Rise probes (at least) succeeded.
	StateHealthy
	// StateUnhealthy: the last Fall probes (at least) failed.
	StateUnhealthy
)

func (s State) String() string {
	switch s {
	case StateUnknown:
		return "unknown"
	case StateHealthy:
		return "healthy"
	case StateUnhealthy:
		return "unhealthy"
	}
	return "state(?)"
}

// Status is a snapshot of one tracked proxy.
type Status struct {
	ID      string
	Address string // last non-empty address the proxy was reported with
	// State is the current decision; Since is when it was entered (tracker
	// clock), or when the proxy was first tracked for StateUnknown.
	State State
	Since time.Time

	// LastProbe is when the last probe result was recorded (tracker
	// clock); zero if none was.
	LastProbe time.Time
	// LastLatency is the Total latency of the last recorded probe,
	// successful or not.
	LastLatency time.Duration
	// LastKind, LastStatusCode and LastErr describe the last recorded
	// probe; LastErr is nil (and LastKind KindNone) when it succeeded.
	LastKind       Kind
	LastStatusCode int
	LastErr        error

	// LastSeen is when the proxy was last reported with an address (or
	// first reported, if it never had one). It is forgotten once
	// Grace has passed since LastSeen.
	LastSeen time.Time

	// Successes and Failures are the current runs of consecutive
	// successful and failed probes (one of them is always 0).
	Successes int
	Failures  int

	// EgressAddress is the last address the proxy's traffic was seen
	// leaving from (Result.EgressAddress of a probe with an EgressURL);
	// the zero Addr until one is learned. A probe that learns none
	// (failed, or its fetch failed) keeps it.
	EgressAddress netip.Addr
	// EgressSince is when EgressAddress was learned (tracker clock).
	EgressSince time.Time
}

// Healthy reports whether State is StateHealthy.
func (s Status) Healthy() bool { return s.State == StateHealthy }

// observation is what one round learned about one proxy.
type observation struct {
	id string
	// address is the proxy's address in this round. Empty means the
	// address is unknown this round (e.g. one failed read of the VM's
	// address): the proxy keeps its state and result is ignored.
	address string
	// result is the probe of address (ignored when address is empty).
	result Result
}

// TrackerOptions configures a Tracker. A nil *TrackerOptions is valid and
// means the zero value of every field.
type TrackerOptions struct {
	// Rise is N: consecutive successes needed to become healthy.
	// Zero means 2; negative is an error.
	Rise int
	// Fall is M: consecutive failures needed to become unhealthy.
	// Zero means 3; negative is an error.
	Fall int
	// Grace is how long a proxy that is missing from rounds, or reported
	// without an address, keeps its state before it is forgotten, counted
	// from when it was last seen with an address. Zero means 2m; negative
	// is an error. (Use Tracker.Remove to forget a proxy at once.)
	Grace time.Duration
	// OnForget, when not nil, is called exactly once for every proxy the
	// tracker forgets (grace expired or Remove), with its last Status, after
	// the proxy is gone and outside the tracker's lock (it may call the
	// tracker). Zero: nothing is called.
	OnForget func(Status)
	// OnEgressChange, when not nil, is called once for every change of a
	// proxy's egress address a round learns (Status.EgressAddress), with
	// the proxy's Status after the round and the address it had before:
	// the zero Addr when this is the first one learned. It is called
	// after the round is recorded, outside the tracker's lock (it may call
	// the tracker). A change is an event of its own, not a health
	// failure: it changes no state or counter. Zero: nothing is called.
	OnEgressChange func(s Status, previous netip.Addr)
	// Now is the tracker's clock. Zero: time.Now.
	Now func() time.Time
	// Logger receives state changes and forgets (Info) and per-round
	// summaries (V(1)), on a logger named "health". Zero: logs are
	// discarded.
	Logger logr.Logger
	// TracerProvider provides the tracer for the span of each Round
	// ("health.Round"). Zero: no-op.
	TracerProvider trace.TracerProvider
	// MeterProvider records the state of every tracked proxy, a gauge
	// with one series per proxy and state that end when the tracker
	// forgets the proxy (egressproxy.health.proxy.state), and each probe
	// of a Round whose options name no MeterProvider
	// (egressproxy.health.probe.duration). The gauge is reported while
	// the Tracker is in use: one that is no longer referenced stops
	// reporting once it is garbage collected. Zero: nothing is recorded.
	MeterProvider metric.MeterProvider
}

// Tracker keeps per-proxy health across probe rounds with rise/fall
// thresholds and a grace period for proxies whose address disappeared. It is
// safe for concurrent use.
type Tracker struct {
	rise, fall int
	grace      time.Duration
	onForget   func(Status)
	onEgress   func(Status, netip.Addr)
	now        func() time.Time
	log        logr.Logger
	tp         trace.TracerProvider
	tracer     trace.Tracer
	probes     *probeMeter // nil: no MeterProvider
	series     stateSeries // the state gauge's attribute sets

	mu      sync.Mutex
	entries map[string]*Status
}

// NewTracker returns a Tracker. A nil opts is valid (every default).
// Invalid options give a Permanent error joining one
// *egressproxy.FieldError per field and rule, named by its field in
// TrackerOptions ("Rise").
func NewTracker(opts *TrackerOptions) (*Tracker, error) {
	var o TrackerOptions
	if opts != nil {
		o = *opts
	}
	var problems []error
	if o.Rise < 0 {
		problems = append(problems, &errs.FieldError{Field: "Rise", Value: strconv.Itoa(o.Rise), Rule: "must not be negative (zero means 2)"})
	}
	if o.Fall < 0 {
		problems = append(problems, &errs.FieldError{Field: "Fall", Value: strconv.Itoa(o.Fall), Rule: "must not be negative (zero means 3)"})
	}
	if o.Grace < 0 {
		problems = append(problems, &errs.FieldError{Field: "Grace", Value: o.Grace.String(), Rule: "must not be negative (zero means 2m)"})
	}
	if err := errors.Join(problems...); err != nil {
		return nil, errs.WithCode(errs.Permanent, err)
	}
	t := &Tracker{
		rise:     o.Rise,
		fall:     o.Fall,
		grace:    o.Grace,
		onForget: o.OnForget,
		onEgress: o.OnEgressChange,
		now:      o.Now,
		log:      logr.Discard(),
		entries:  make(map[string]*Status),
	}
	if t.rise == 0 {
		t.rise = defaultRise
	}
	if t.fall == 0 {
		t.fall = defaultFall
	}
	if t.grace == 0 {
		t.grace = defaultGrace
	}
	if t.now == nil {
		t.now = time.Now
	}
	if o.Logger.GetSink() != nil {
		t.log = o.Logger.WithName("health")
	}
	tp := o.TracerProvider
	if tp == nil {
		tp = noop.NewTracerProvider()
	}
	t.tp = tp
	t.tracer = tp.Tracer(tracerName)
	t.probes = newProbeMeter(o.MeterProvider)
	t.registerStateGauge(o.MeterProvider)
	return t, nil
}

// update records one complete round. Every observation with an address
// counts as a probe of that proxy; a proxy reported without an address, or
// tracked but absent from obs, keeps its state and is forgotten once Grace
// has passed since it was last seen with an address. A result of
// KindCanceled (the embedder's context ended) counts as seen but not as a
// probe: it changes no counter or state. Observations of one ID are applied
// in order.
func (t *Tracker) update(obs []observation) {
	now := t.now()
	var forgotten []Status
	var changes []change
	var egress []egressChange
	t.mu.Lock()
	for i := range obs {
		ob := &obs[i]
		e, ok := t.entries[ob.id]
		if !ok {
			e = &Status{ID: ob.id, State: StateUnknown, Since: now, LastSeen: now}
			t.entries[ob.id] = e
		}
		if ob.address == "" {
			continue
		}
		e.Address = ob.address
		e.LastSeen = now
		if ob.result.Kind == KindCanceled {
			// The embedder's context ended: says nothing about the proxy.
			continue
		}
		if prev := e.State; t.record(e, &ob.result, now) {
			changes = append(changes, change{from: prev, to: *e})
		}
		if a := ob.result.EgressAddress; a.IsValid() && a != e.EgressAddress {
			prev := e.EgressAddress
			e.EgressAddress, e.EgressSince = a, now
			egress = append(egress, egressChange{previous: prev, to: *e})
		}
	}
	for id, e := range t.entries {
		if now.Sub(e.LastSeen) >= t.grace {
			delete(t.entries, id)
			forgotten = append(forgotten, *e)
		}
	}
	t.mu.Unlock()
	for _, c := range changes {
		t.log.Info("proxy health changed", "id", c.to.ID, "address", c.to.Address,
			"from", c.from.String(), "to", c.to.State.String(), "lastError", c.to.LastErr)
	}
	for _, c := range egress {
		if c.previous.IsValid() {
			t.log.Info("proxy egress address changed", "id", c.to.ID, "address", c.to.Address,
				"egressAddress", c.to.EgressAddress.String(), "previous", c.previous.String())
		} else {
			t.log.Info("proxy egress address learned", "id", c.to.ID, "address", c.to.Address,
				"egressAddress", c.to.EgressAddress.String())
		}
		if t.onEgress != nil {
			t.onEgress(c.to, c.previous)
		}
	}
	t.forget(forgotten, "grace period expired")
}

type change struct {
	from State
	to   Status
}

type egressChange struct {
	previous netip.Addr
	to       Status
}

// record applies one probe result to e and reports whether e's state
// changed. t.mu is held.
func (t *Tracker) record(e *Status, r *Result, now time.Time) bool {
	e.LastProbe = now
	e.LastLatency = r.Total
	e.LastStatusCode = r.StatusCode
	prev := e.State
	if r.OK {
		e.LastKind, e.LastErr = KindNone, nil
		e.Successes++
		e.Failures = 0
		if e.State != StateHealthy && e.Successes >= t.rise {
			e.State, e.Since = StateHealthy, now
		}
	} else {
		e.LastKind, e.LastErr = r.Kind, r.Err
		if e.LastKind == KindNone {
			e.LastKind = KindNetwork // a failed Result without a Kind
		}
		e.Failures++
		e.Successes = 0
		if e.State != StateUnhealthy && e.Failures >= t.fall {
			e.State, e.Since = StateUnhealthy, now
		}
	}
	return e.State != prev
}

func (t *Tracker) forget(forgotten []Status, why string) {
	for _, s := range forgotten {
		t.log.Info("proxy forgotten", "id", s.ID, "address", s.Address, "state", s.State.String(),
			"lastSeen", s.LastSeen, "reason", why)
		if t.onForget != nil {
			t.onForget(s)
		}
	}
}

// Round probes every proxy that has an Address (ProbeAll with opts), records
// the round and returns the probe results, in the order of those proxies.
// Proxies without an Address, and tracked proxies absent from proxies, are
// not probed: they keep their state and are forgotten once Grace has passed
// since they were last seen with an address. A KindCanceled result (ctx
// ended) counts as seen but not as a probe. One span ("health.Round")
// covers the round; opts without a Logger, TracerProvider or MeterProvider
// use the tracker's.
//
// Every probed proxy needs a CONNECT target, its own Target or
// opts.Target. When one has neither (nil opts included), Round probes
// nothing, records nothing and returns a Permanent error with a
// *egressproxy.FieldError for Target: a caller's mistake never marks a
// fleet down.
func (t *Tracker) Round(ctx context.Context, proxies []Proxy, opts *ProbeAllOptions) ([]Result, error) {
	ctx, span := t.tracer.Start(ctx, "health.Round", trace.WithAttributes(
		attribute.Int("health.members", len(proxies))))
	defer span.End()

	var o ProbeAllOptions
	if opts != nil {
		o = *opts
	}
	if err := checkTargets(proxies, o.Target); err != nil {
		obs.Fail(span, err) // a caller's mistake: error.type Permanent
		return nil, err
	}
	log := t.log
	if o.Logger.GetSink() != nil {
		log = o.Logger.WithName("health")
	}
	tp := o.TracerProvider
	if tp == nil {
		tp = t.tp
	}
	probed := make([]Proxy, 0, len(proxies))
	for _, p := range proxies {
		if p.Address != "" {
			probed = append(probed, p)
		}
	}
	pm := t.probes
	if o.MeterProvider != nil {
		pm = newProbeMeter(o.MeterProvider)
	}
	results := probeAll(ctx, probed, &o, log, tp, pm)
	round := make([]observation, 0, len(proxies))
	j := 0
	for _, p := range proxies {
		ob := observation{id: p.ID, address: p.Address}
		if p.Address != "" {
			ob.result = results[j]
			j++
		}
		round = append(round, ob)
	}
	t.update(round)
	healthy := 0
	t.mu.Lock()
	for _, e := range t.entries {
		if e.State == StateHealthy {
			healthy++
		}
	}
	tracked := len(t.entries)
	t.mu.Unlock()
	span.SetAttributes(attribute.Int("health.probed", len(probed)),
		attribute.Int("health.tracked", tracked), attribute.Int("health.healthy", healthy))
	t.log.V(1).Info("health round", "members", len(proxies), "probed", len(probed),
		"tracked", tracked, "healthy", healthy)
	return results, nil
}

// checkTargets reports a proxy with an address but no CONNECT target of
// its own when the round has none either.
func checkTargets(proxies []Proxy, roundTarget string) error {
	if roundTarget != "" {
		return nil
	}
	for _, p := range proxies {
		if p.Address != "" && p.Target == "" {
			return errs.WithCode(errs.Permanent, &errs.FieldError{Field: "Target",
				Rule: "must be set: proxy " + errs.Quote(p.ID) + " has no Target of its own (the CONNECT target every probe tunnels to)"})
		}
	}
	return nil
}

// Remove forgets id at once. It reports whether id was tracked; OnForget is
// called when it was.
func (t *Tracker) Remove(id string) bool {
	t.mu.Lock()
	e, ok := t.entries[id]
	if ok {
		delete(t.entries, id)
	}
	t.mu.Unlock()
	if ok {
		t.forget([]Status{*e}, "removed")
	}
	return ok
}

// Get returns the status of id.
func (t *Tracker) Get(id string) (Status, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e, ok := t.entries[id]
	if !ok {
		return Status{}, false
	}
	return *e, true
}

// Snapshot returns the status of every tracked proxy, sorted by ID.
func (t *Tracker) Snapshot() []Status {
	t.mu.Lock()
	out := make([]Status, 0, len(t.entries))
	for _, e := range t.entries {
		out = append(out, *e)
	}
	t.mu.Unlock()
	slices.SortFunc(out, func(a, b Status) int { return strings.Compare(a.ID, b.ID) })
	return out
}
