package health

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/obs"
)

// Defaults of TrackerOptions.
const (
	DefaultRise  = 2
	DefaultFall  = 3
	DefaultGrace = 2 * time.Minute
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
	ID   string
	Addr string // last non-empty address the proxy was reported with
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
}

// Healthy reports whether State is StateHealthy.
func (s Status) Healthy() bool { return s.State == StateHealthy }

// Observation is what one round learned about one proxy.
type Observation struct {
	ID string
	// Addr is the proxy's address in this round. Empty means the address
	// is unknown this round (e.g. one failed read of the VM's address): the
	// proxy keeps its state and Result is ignored.
	Addr string
	// Result is the probe of Addr (ignored when Addr is empty).
	Result Result
}

// Member is a proxy the embedder knows in a round: ID and its current
// address (empty when unknown).
type Member struct {
	ID   string
	Addr string
	// Username and Password are the proxy's own credentials for Round's
	// probe (Target.Username and Password); empty Username: the round's.
	Username string
	Password string
}

// TrackerOptions configures a Tracker. A nil *TrackerOptions is valid and
// means the zero value of every field.
type TrackerOptions struct {
	// Rise is N: consecutive successes needed to become healthy.
	// Zero means DefaultRise; negative is an error.
	Rise int `json:"rise,omitempty"`
	// Fall is M: consecutive failures needed to become unhealthy.
	// Zero means DefaultFall; negative is an error.
	Fall int `json:"fall,omitempty"`
	// Grace is how long a proxy that is missing from rounds, or reported
	// without an address, keeps its state before it is forgotten, counted
	// from when it was last seen with an address. Zero means DefaultGrace;
	// negative is an error. (Use Tracker.Remove to forget a proxy at once.)
	Grace time.Duration `json:"grace,omitempty"`
	// OnForget, when not nil, is called exactly once for every proxy the
	// tracker forgets (grace expired or Remove), with its last Status, after
	// the proxy is gone and outside the tracker's lock (it may call the
	// tracker). Zero: nothing is called.
	OnForget func(Status) `json:"-"`
	// Now is the tracker's clock. Zero: time.Now.
	Now func() time.Time `json:"-"`
	// Logger receives state changes and forgets (Info) and per-round
	// summaries (V(1)). Zero: logs are discarded.
	Logger logr.Logger `json:"-"`
	// TracerProvider provides the tracer for the span of each Round
	// ("health.Round"). Zero: no-op.
	TracerProvider trace.TracerProvider `json:"-"`
}

// Tracker keeps per-proxy health across probe rounds with rise/fall
// thresholds and a grace period for proxies whose address disappeared. It is
// safe for concurrent use.
type Tracker struct {
	rise, fall int
	grace      time.Duration
	onForget   func(Status)
	now        func() time.Time
	log        logr.Logger
	tp         trace.TracerProvider
	tracer     trace.Tracer

	mu      sync.Mutex
	entries map[string]*Status
}

// NewTracker returns a Tracker. A nil opts is valid (every default).
// Invalid options give a Permanent error joining one *errs.FieldError per
// field and rule, the validation error type of every package of this module.
func NewTracker(opts *TrackerOptions) (*Tracker, error) {
	var o TrackerOptions
	if opts != nil {
		o = *opts
	}
	var problems []error
	if o.Rise < 0 {
		problems = append(problems, &errs.FieldError{Field: "TrackerOptions.Rise", Value: strconv.Itoa(o.Rise), Rule: "must not be negative (zero means DefaultRise)"})
	}
	if o.Fall < 0 {
		problems = append(problems, &errs.FieldError{Field: "TrackerOptions.Fall", Value: strconv.Itoa(o.Fall), Rule: "must not be negative (zero means DefaultFall)"})
	}
	if o.Grace < 0 {
		problems = append(problems, &errs.FieldError{Field: "TrackerOptions.Grace", Value: o.Grace.String(), Rule: "must not be negative (zero means DefaultGrace)"})
	}
	if err := errors.Join(problems...); err != nil {
		return nil, errs.WithCode(errs.Permanent, err)
	}
	t := &Tracker{
		rise:     o.Rise,
		fall:     o.Fall,
		grace:    o.Grace,
		onForget: o.OnForget,
		now:      o.Now,
		log:      o.Logger,
		entries:  make(map[string]*Status),
	}
	if t.rise == 0 {
		t.rise = DefaultRise
	}
	if t.fall == 0 {
		t.fall = DefaultFall
	}
	if t.grace == 0 {
		t.grace = DefaultGrace
	}
	if t.now == nil {
		t.now = time.Now
	}
	if t.log.GetSink() == nil {
		t.log = logr.Discard()
	}
	tp := o.TracerProvider
	if tp == nil {
		tp = noop.NewTracerProvider()
	}
	t.tp = tp
	t.tracer = tp.Tracer(tracerName)
	return t, nil
}

// Update records one complete round. Every observation with an address
// counts as a probe of that proxy; a proxy reported without an address, or
// tracked but absent from obs, keeps its state and is forgotten once Grace
// has passed since it was last seen with an address. A result of
// KindCanceled (the embedder's context ended) counts as seen but not as a
// probe: it changes no counter or state. Observations of one ID are applied
// in order.
func (t *Tracker) Update(obs []Observation) {
	now := t.now()
	var forgotten []Status
	var changes []change
	t.mu.Lock()
	for i := range obs {
		ob := &obs[i]
		e, ok := t.entries[ob.ID]
		if !ok {
			e = &Status{ID: ob.ID, State: StateUnknown, Since: now, LastSeen: now}
			t.entries[ob.ID] = e
		}
		if ob.Addr == "" {
			continue
		}
		e.Addr = ob.Addr
		e.LastSeen = now
		if ob.Result.Kind == KindCanceled {
			// The embedder's context ended: says nothing about the proxy.
			continue
		}
		if prev := e.State; t.record(e, &ob.Result, now) {
			changes = append(changes, change{from: prev, to: *e})
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
		t.log.Info("proxy health changed", "id", c.to.ID, "addr", c.to.Addr,
			"from", c.from.String(), "to", c.to.State.String(), "lastError", c.to.LastErr)
	}
	t.forget(forgotten, "grace period expired")
}

type change struct {
	from State
	to   Status
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
		t.log.Info("proxy forgotten", "id", s.ID, "addr", s.Addr, "state", s.State.String(),
			"lastSeen", s.LastSeen, "reason", why)
		if t.onForget != nil {
			t.onForget(s)
		}
	}
}

// Round probes every member that has an address (ProbeAll with opts; the
// tracker's TracerProvider when opts has none), records the round with
// Update (members without an address, and tracked proxies not in members,
// are handled as Update describes) and returns the probe results. One span
// ("health.Round") covers the round.
//
// opts.TargetAddr is required: with nil opts or an empty TargetAddr every
// result is KindBadInput, no connection is made, the round is not recorded
// (no proxy's state changes) and the mistake is logged as an error.
func (t *Tracker) Round(ctx context.Context, members []Member, opts *ProbeAllOptions) []Result {
	ctx, span := t.tracer.Start(ctx, "health.Round", trace.WithAttributes(
		attribute.Int("health.members", len(members))))
	defer span.End()

	var o ProbeAllOptions
	if opts != nil {
		o = *opts
	}
	if o.TracerProvider == nil {
		o.TracerProvider = t.tp
	}
	targets := make([]Target, 0, len(members))
	for _, m := range members {
		if m.Addr != "" {
			targets = append(targets, Target{ID: m.ID, ProxyAddr: m.Addr, Username: m.Username, Password: m.Password})
		}
	}
	results := ProbeAll(ctx, targets, &o)
	if o.TargetAddr == "" {
		// Every probe failed as KindBadInput without a connection: the
		// caller forgot the target, the proxies are not at fault. Never
		// mark a fleet down for it.
		err := errors.New("health: Tracker.Round needs ProbeAllOptions.TargetAddr (the CONNECT target every probe tunnels to); the round was not recorded and no proxy's state changed")
		t.log.Error(err, "round not recorded", "members", len(members))
		obs.Fail(span, errs.WithCode(errs.Permanent, err)) // a caller's mistake: error.type Permanent
		return results
	}
	obs := make([]Observation, 0, len(members))
	j := 0
	for _, m := range members {
		ob := Observation{ID: m.ID, Addr: m.Addr}
		if m.Addr != "" {
			ob.Result = results[j]
			j++
		}
		obs = append(obs, ob)
	}
	t.Update(obs)
	healthy := 0
	t.mu.Lock()
	for _, e := range t.entries {
		if e.State == StateHealthy {
			healthy++
		}
	}
	tracked := len(t.entries)
	t.mu.Unlock()
	span.SetAttributes(attribute.Int("health.probed", len(targets)),
		attribute.Int("health.tracked", tracked), attribute.Int("health.healthy", healthy))
	t.log.V(1).Info("health round", "members", len(members), "probed", len(targets),
		"tracked", tracked, "healthy", healthy)
	return results
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
