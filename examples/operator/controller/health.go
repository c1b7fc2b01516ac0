package controller

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/metric"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/examples/operator/api/v1alpha1"
	"github.com/egressproxy/egressproxy/health"
)

// DefaultHealthInterval is how often HealthRunnable checks the entries and
// probes the proxies when HealthOptions.Interval is zero.
const DefaultHealthInterval = 30 * time.Second

// HealthOptions configure a HealthRunnable.
type HealthOptions struct {
	// Interval between rounds (zero: DefaultHealthInterval).
	Interval time.Duration
	// ConnectTarget is the host:port every probe CONNECTs to through the
	// proxy. Required.
	ConnectTarget string
	// Tracker decides health from the probes (nil: a new tracker with
	// the Logger and MeterProvider below).
	Tracker *health.Tracker
	// Probe are the per-probe options (timeout, tunnel proof); the
	// credentials and TLS are set per proxy.
	Probe health.ProbeOptions
	// EgressURL is a "what is my address" URL every probe fetches through
	// its proxy (health.ProbeOptions.EgressURL): its answer is the
	// object's status.egressAddress, and a change is an
	// EgressAddressChanged event. Empty: none.
	EgressURL string
	// Events records the EgressAddressChanged events (the manager's
	// recorder). Nil: changes are logged only. Only a tracker the
	// runnable makes (Tracker nil) reports them.
	Events events.EventRecorder
	// Logger (zero: discard).
	Logger logr.Logger
	// MeterProvider records the new tracker's per-proxy state gauge and
	// its probes (nil: no-op; unused when Tracker is set).
	MeterProvider metric.MeterProvider
	// NewProxyInterval is how soon a proxy registered anew (a new one, or
	// one at a new address) is probed, and probed again at that pace
	// until the tracker has decided it Healthy or Unhealthy (at most
	// newProxyProbes times), instead of waiting for the next rounds: a
	// new proxy is Healthy seconds after its VM runs, not one to two
	// Intervals later. Zero: DefaultNewProxyInterval; negative: off.
	NewProxyInterval time.Duration
}

// DefaultNewProxyInterval is HealthOptions.NewProxyInterval's default.
const DefaultNewProxyInterval = time.Second

// newProxyProbes bounds the probes of a new proxy outside the rounds: the
// tracker's default Rise (2) and Fall (3) decide it within 3 probes unless
// its results alternate; after 5 it waits for the rounds like any other.
const newProxyProbes = 5

// Member is a proxy the reconciler registered for probing.
type Member struct {
	Key         types.NamespacedName // its EgressProxy
	UID         types.UID            // its EgressProxy's UID (events name it)
	ID          string               // its instance name
	Addr        string               // its address, "" when it has none
	Credentials Credentials
	TLS         *tls.Config // the probes' TLS to the proxy; nil: plain HTTP
}

// HealthRunnable is a manager Runnable: every Interval it Checks each
// provider entry (each in a loop of its own) and writes the result into
// the entry's EgressProxyHost (when Setup gave it a client), and probes
// every registered proxy, feeding a health.Tracker, and asks for a
// reconcile of the objects whose health changed (the reconciler copies the
// decision into status). It runs on the leader only, like the reconciler
// that registers the proxies.
type HealthRunnable struct {
	entries map[string]*egressproxy.Client
	opts    HealthOptions
	tracker *health.Tracker
	log     logr.Logger
	notify  func(types.NamespacedName) // set by Reconciler.SetupWithManager
	// notifyPool is called beside notify (set by
	// PoolReconciler.SetupWithManager): a child's health change
	// reconciles its pool even when the child's own reconcile cannot
	// write it (its entry unreachable).
	notifyPool func(types.NamespacedName)
	hosts      *hostWriter // set by Setup; nil: no EgressProxyHost objects

	mu         sync.Mutex
	members    map[string]Member // by ID
	entryState map[string]egressproxy.Health
	notified   map[string]health.State
	newcomers  map[string]int // by ID: probes left outside the rounds
	kick       chan struct{}  // a newcomer registered (buffered, 1)
}

// NewHealthRunnable returns the runnable over entries.
func NewHealthRunnable(entries map[string]*egressproxy.Client, opts HealthOptions) (*HealthRunnable, error) {
	if opts.Interval <= 0 {
		opts.Interval = DefaultHealthInterval
	}
	if opts.NewProxyInterval == 0 {
		opts.NewProxyInterval = DefaultNewProxyInterval
	}
	log := opts.Logger
	if log.GetSink() == nil {
		log = logr.Discard()
	}
	if host, port, err := net.SplitHostPort(opts.ConnectTarget); err != nil || host == "" || port == "" {
		return nil, fmt.Errorf("health: ConnectTarget %q: must be host:port", opts.ConnectTarget)
	}
	h := &HealthRunnable{
		entries: entries, opts: opts, log: log.WithName("health"),
		members: map[string]Member{}, entryState: map[string]egressproxy.Health{}, notified: map[string]health.State{},
		newcomers: map[string]int{}, kick: make(chan struct{}, 1),
	}
	h.tracker = opts.Tracker
	if h.tracker == nil {
		var err error
		if h.tracker, err = health.NewTracker(&health.TrackerOptions{Logger: log, MeterProvider: opts.MeterProvider, OnEgressChange: h.egressChanged}); err != nil {
			return nil, err
		}
	}
	return h, nil
}

// ReasonEgressAddressChanged is the reason of the event a proxy's egress
// address change makes.
const ReasonEgressAddressChanged = "EgressAddressChanged"

// egressChanged is the tracker's OnEgressChange: a changed egress address
// (not the first one learned) is an event on the object and a log line;
// either way the object is reconciled, which writes the address into its
// status.
func (h *HealthRunnable) egressChanged(s health.Status, previous netip.Addr) {
	h.mu.Lock()
	m, ok := h.members[s.ID]
	h.mu.Unlock()
	if !ok {
		return
	}
	if previous.IsValid() {
		h.log.Info("proxy egress address changed", "proxy", m.Key.String(), "instance", m.ID,
			"egressAddress", s.EgressAddress.String(), "previous", previous.String())
		if h.opts.Events != nil {
			obj := &v1alpha1.EgressProxy{ObjectMeta: metav1.ObjectMeta{Namespace: m.Key.Namespace, Name: m.Key.Name, UID: m.UID}}
			h.opts.Events.Eventf(obj, nil, corev1.EventTypeNormal, ReasonEgressAddressChanged, "ProbeEgress",
				"the proxy's egress address changed from %s to %s", previous, s.EgressAddress)
		}
	}
	if h.notify != nil {
		h.notify(m.Key)
	}
}

// NeedLeaderElection makes the runnable run on the leader only.
func (h *HealthRunnable) NeedLeaderElection() bool { return true }

// Register adds or updates a proxy to probe. A new proxy with an
// address, or one whose address changed, is probed soon
// (HealthOptions.NewProxyInterval) rather than at the next round.
func (h *HealthRunnable) Register(m Member) {
	h.mu.Lock()
	prev, had := h.members[m.ID]
	h.members[m.ID] = m
	fresh := m.Addr != "" && (!had || prev.Addr != m.Addr) && h.opts.NewProxyInterval > 0
	if fresh {
		h.newcomers[m.ID] = newProxyProbes
	}
	h.mu.Unlock()
	if fresh {
		select {
		case h.kick <- struct{}{}:
		default:
		}
	}
}

// member is the proxy id as registered, if it is.
func (h *HealthRunnable) member(id string) (Member, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	m, ok := h.members[id]
	return m, ok
}

// Unregister stops probing the proxy and forgets its health.
func (h *HealthRunnable) Unregister(_ types.NamespacedName, id string) {
	h.mu.Lock()
	delete(h.members, id)
	delete(h.notified, id)
	delete(h.newcomers, id)
	h.mu.Unlock()
	h.tracker.Remove(id)
}

// ProxyStatus is the health the reconciler writes into status.
type ProxyStatus struct {
	Health  v1alpha1.Health
	Reason  string
	Message string
	// EgressAddress is the last egress address learned, "" when none.
	EgressAddress string
}

// ProxyHealth returns the tracker's decision about proxy id at addr.
func (h *HealthRunnable) ProxyHealth(id, addr string) ProxyStatus {
	if addr == "" {
		return ProxyStatus{Health: v1alpha1.HealthUnknown, Reason: ReasonNoAddress, Message: "the VM has no proxy address to probe"}
	}
	st, ok := h.tracker.Get(id)
	if !ok {
		return ProxyStatus{Health: v1alpha1.HealthUnknown, Reason: ReasonPending, Message: "not probed yet"}
	}
	ps := proxyStatus(st)
	if st.EgressAddress.IsValid() {
		ps.EgressAddress = st.EgressAddress.String()
	}
	return ps
}

// proxyStatus is the health of a tracked proxy.
func proxyStatus(st health.Status) ProxyStatus {
	switch st.State {
	case health.StateHealthy:
		return ProxyStatus{Health: v1alpha1.HealthHealthy, Reason: ReasonHealthy, Message: "the last probes succeeded"}
	case health.StateUnhealthy:
		msg := "the last probes failed"
		if st.LastErr != nil {
			msg = st.LastErr.Error()
		}
		return ProxyStatus{Health: v1alpha1.HealthUnhealthy, Reason: KindReason(st.LastKind), Message: msg}
	}
	return ProxyStatus{Health: v1alpha1.HealthUnknown, Reason: ReasonPending, Message: "not enough probes yet"}
}

// ProxyState is the tracker's record of proxy id, if it has one.
func (h *HealthRunnable) ProxyState(id string) (health.Status, bool) {
	return h.tracker.Get(id)
}

// KindReason turns a health.Kind into a condition reason:
// "Probe" + its CamelCase Reason ("ProbeAuthRequired").
func KindReason(k health.Kind) string { return "Probe" + k.Reason() }

// EntryHealth returns the last Check of entry.
func (h *HealthRunnable) EntryHealth(entry string) (egressproxy.Health, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	hl, ok := h.entryState[entry]
	return hl, ok
}

// Start runs, until ctx ends, one loop per entry that Checks it every
// Interval, and the loop of probe rounds every Interval: an entry whose
// host hangs delays its own Checks only, never another entry's or the
// probes.
func (h *HealthRunnable) Start(ctx context.Context) error {
	var wg sync.WaitGroup
	for entry, c := range h.entries {
		wg.Go(func() { every(ctx, h.opts.Interval, func() { h.checkEntry(ctx, entry, c) }) })
	}
	h.probeLoop(ctx)
	wg.Wait()
	return nil
}

// probeLoop runs a round every Interval (the first at once) and, between
// rounds, probes the proxies registered anew every NewProxyInterval while
// there are any (rounds and these probes never overlap).
func (h *HealthRunnable) probeLoop(ctx context.Context) {
	tick := time.NewTicker(h.opts.Interval)
	defer tick.Stop()
	var soon *time.Timer
	defer func() {
		if soon != nil {
			soon.Stop()
		}
	}()
	round := func() {
		h.pruneHosts(ctx)
		h.probeRound(ctx)
	}
	round()
	for {
		var soonC <-chan time.Time
		if soon != nil {
			soonC = soon.C
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			round()
		case <-h.kick:
			if soon == nil {
				soon = time.NewTimer(h.opts.NewProxyInterval)
			}
			continue
		case <-soonC:
			soon = nil
			if h.probeNewcomers(ctx) {
				soon = time.NewTimer(h.opts.NewProxyInterval)
			}
		}
	}
}

// probeNewcomers probes the proxies registered anew once, and reports
// whether any is left undecided with probes to spare.
func (h *HealthRunnable) probeNewcomers(ctx context.Context) bool {
	h.mu.Lock()
	var ms []Member
	for id, left := range h.newcomers {
		m, ok := h.members[id]
		if !ok || m.Addr == "" || left <= 0 {
			delete(h.newcomers, id)
			continue
		}
		h.newcomers[id] = left - 1
		ms = append(ms, m)
	}
	h.mu.Unlock()
	if len(ms) == 0 {
		return false
	}
	h.probe(ctx, ms)
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, m := range ms {
		st, _ := h.tracker.Get(m.ID)
		if st.State == health.StateHealthy || st.State == health.StateUnhealthy || h.newcomers[m.ID] <= 0 {
			delete(h.newcomers, m.ID)
		}
	}
	return len(h.newcomers) > 0
}

// every runs f, then again every d, until ctx ends.
func every(ctx context.Context, d time.Duration, f func()) {
	tick := time.NewTicker(d)
	defer tick.Stop()
	for {
		f()
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// Round checks every entry (at once) and then probes every registered
// proxy, once.
func (h *HealthRunnable) Round(ctx context.Context) {
	h.pruneHosts(ctx)
	var wg sync.WaitGroup
	for entry, c := range h.entries {
		wg.Go(func() { h.checkEntry(ctx, entry, c) })
	}
	wg.Wait()
	if ctx.Err() != nil {
		return
	}
	h.probeRound(ctx)
}

// pruneHosts deletes the hosts of entries no longer configured, until
// that has succeeded once.
func (h *HealthRunnable) pruneHosts(ctx context.Context) {
	if h.hosts == nil {
		return
	}
	if err := h.hosts.prune(ctx); err != nil && ctx.Err() == nil {
		h.log.Info("hosts of removed entries not deleted; trying again next round", "err", err)
	}
}

// checkEntry Checks entry, writes the result into its EgressProxyHost and
// records it for the reconciler. A Check that could not run because ctx
// ended records nothing.
func (h *HealthRunnable) checkEntry(ctx context.Context, entry string, c *egressproxy.Client) {
	hl, err := c.Check(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return
		}
		hl = egressproxy.Health{Reason: egressproxy.ReasonUnknown, Message: err.Error(), CheckedAt: time.Now().UTC()}
	}
	if h.hosts != nil {
		if err := h.hosts.write(ctx, entry, hl); err != nil && ctx.Err() == nil {
			h.log.Info("host status not written", "entry", entry, "err", err)
		}
	}
	h.mu.Lock()
	prev, had := h.entryState[entry]
	h.entryState[entry] = hl
	h.mu.Unlock()
	if had && (prev.Reachable != hl.Reachable || prev.Reason != hl.Reason) {
		h.log.Info("provider entry health changed", "entry", entry, "reachable", hl.Reachable, "reason", string(hl.Reason))
	}
}

// probeRound probes every registered proxy once and asks for a reconcile
// of the objects whose health changed.
func (h *HealthRunnable) probeRound(ctx context.Context) {
	h.mu.Lock()
	ms := make([]Member, 0, len(h.members))
	for _, m := range h.members {
		ms = append(ms, m)
	}
	h.mu.Unlock()
	t0 := time.Now()
	if h.probe(ctx, ms) {
		observeRound(t0, len(ms))
	}
}

// probe probes ms once, as one Tracker round, and asks for a reconcile of
// the objects whose health changed. It reports whether the round was
// recorded.
func (h *HealthRunnable) probe(ctx context.Context, ms []Member) bool {
	// One Tracker round over the proxies, each with its own credentials
	// (none for a proxy without); one without an address keeps its state.
	var proxies []health.Proxy
	keys := map[string]types.NamespacedName{}
	for _, m := range ms {
		keys[m.ID] = m.Key
		proxies = append(proxies, health.Proxy{ID: m.ID, Address: m.Addr, Username: m.Credentials.User, Password: m.Credentials.Password, ProxyTLS: m.TLS})
	}
	po := h.opts.Probe
	po.Username, po.Password, po.ProxyTLS = "", "", nil // per proxy only: none for a proxy without
	po.EgressURL = h.opts.EgressURL
	if _, err := h.tracker.Round(ctx, proxies, &health.ProbeAllOptions{Target: h.opts.ConnectTarget, Probe: po}); err != nil {
		h.log.Error(err, "health round not recorded")
		return false
	}
	// A proxy unregistered while the round probed it was tracked again
	// when the round recorded its result: forget it again, so that its
	// state, and its series of the state gauge, end with its object.
	var gone []string
	h.mu.Lock()
	for id := range keys {
		if _, ok := h.members[id]; !ok {
			gone = append(gone, id)
		}
	}
	h.mu.Unlock()
	for _, id := range gone {
		h.tracker.Remove(id)
	}
	if ctx.Err() != nil {
		return true
	}

	var changed []types.NamespacedName
	h.mu.Lock()
	counts := map[health.State]int{}
	for id := range h.members {
		st, _ := h.tracker.Get(id) // a proxy not tracked yet: StateUnknown
		counts[st.State]++
	}
	observeStates(counts)
	for id, key := range keys {
		st, _ := h.tracker.Get(id)
		if prev, ok := h.notified[id]; !ok || prev != st.State {
			h.notified[id] = st.State
			if ok {
				changed = append(changed, key)
			}
		}
	}
	h.mu.Unlock()
	for _, k := range changed {
		if h.notify != nil {
			h.notify(k)
		}
		if h.notifyPool != nil {
			h.notifyPool(k)
		}
	}
	return true
}
