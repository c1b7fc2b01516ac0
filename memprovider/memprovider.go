package memprovider

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/guestconf"
	"github.com/egressproxy/egressproxy/internal/loopback"
	"github.com/egressproxy/egressproxy/internal/naming"
	"github.com/egressproxy/egressproxy/internal/obs"
	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// Options configure a Provider. A nil *Options is valid.
type Options struct {
	// ProvisionDelay is how long a new instance reports StateProvisioning
	// (no address) before it reports StateRunning. Zero: Running at once.
	ProvisionDelay time.Duration
	// Now is the clock used for CreatedAt and ProvisionDelay. Nil:
	// time.Now. Tests inject a fake clock to step through provisioning.
	Now func() time.Time
	// ServeProxies makes every Running instance serve a real HTTP CONNECT
	// proxy on ProxyAddress, port 0; Instance.IP is that address and
	// Instance.Port the listener's port. The proxy enforces the guest description its
	// Spec.UserData holds (see the package doc). False: no listener;
	// Instance.IP is a documentation address (192.0.2.x) and Port comes
	// from the Spec.
	ServeProxies bool
	// ProxyAddress is the IP address the served proxies listen on (with
	// ServeProxies); it must be one of the host's (else a Get or List
	// that would start a proxy fails Transient). Zero: 127.0.0.1. A
	// non-loopback address lets whatever refuses loopback endpoints (an
	// EndpointSlice, kube-proxy) reach the proxies, e.g. a documentation
	// address added to a test network namespace's interface.
	ProxyAddress netip.Addr
	// DialContext opens the served proxies' connection to a CONNECT
	// target they allow (network "tcp"). Zero: a dialer that reaches
	// loopback addresses and "localhost" only; the proxy answers any
	// other target it allows 502 Bad Gateway, as a guest answers a target
	// its network does not reach.
	DialContext func(ctx context.Context, network, address string) (net.Conn, error)
	// DialTimeout bounds the proxy's dial to a CONNECT target. Zero: 5s.
	DialTimeout time.Duration
	// Logger receives the client's line per operation and debug lines
	// (V(1)) about proxies. Zero value: discard.
	Logger logr.Logger
	// TracerProvider creates the client's span per operation. Nil: no-op.
	TracerProvider trace.TracerProvider
	// MeterProvider records the client's metrics: the duration of every
	// operation and the facts of the last Check. Nil: no-op.
	MeterProvider metric.MeterProvider
	// Capacity is the simulated host Check reports in Health.Capacity:
	// MemoryAvailableBytes, CPUs and PoolAvailableBytes as given, each
	// zero field its default (16 GiB, 8 and 100 GiB); Instances is not
	// read: Check counts the instances that run (Running or
	// Provisioning).
	Capacity egressproxy.Capacity
	// Images are the image keys the provider offers (see the package doc,
	// "Images"); the first is the default of a Spec without ImageKey, and
	// a Create of another key is Permanent. Each must be a valid key
	// (the rule of Spec.ImageKey); others are ignored. Zero: every valid key is
	// offered, and the default is DefaultImageKey.
	Images []string
	// CallDelay is a simulated round trip to the backend: every
	// operation (Create, Get, Delete, List, Check and the image
	// operations) waits it before it runs, as a call to a remote host
	// waits for the network. The wait honours the call's context (an
	// error of its class, as an ended context gives) and Close (the
	// error of a closed provider). It comes before any injected fault's
	// Delay. Zero: no wait. Benchmarks of an embedder at scale use it to
	// stand in for the hypervisors they cannot hold.
	CallDelay time.Duration
	// Entry names the entry in the client's metric series: every
	// measurement carries egressproxy.entry=Entry, as a kvm2 entry's
	// do, so a program with several memory entries tells their series
	// apart. Empty: no such attribute.
	Entry string
}

// Op names a provider operation, for InjectFault.
type Op string

// The operations faults can be injected into.
const (
	OpCreate Op = "create"
	OpGet    Op = "get"
	OpDelete Op = "delete"
	OpList   Op = "list"
	OpCheck  Op = "check"
	// The driver.ImageManager operations.
	OpListImages  Op = "list-images"
	OpVerifyImage Op = "verify-image"
	OpEvictImage  Op = "evict-image"
)

// Fault describes how the next calls of one operation misbehave.
type Fault struct {
	// Code is the class of the returned error. OK with a nil Err: the call
	// is only delayed, then runs normally. OK with a non-nil Err: Err is
	// returned as is (unclassed, like a buggy backend).
	Code errs.ErrorCode
	// Err is the cause. Nil with a Code: a generic "injected fault" error.
	Err error
	// Delay is waited before the call runs (or fails). It honours the
	// call's context and Close.
	Delay time.Duration
	// Waiting, when set, is called as a delayed call starts its Delay: a
	// test can then act (cancel, Close) while the call is surely in
	// flight, without sleeping. It must not block.
	Waiting func()
	// Times is how many calls the fault applies to; 0 means every call
	// until ClearFaults.
	Times int
	// Reason is used for OpCheck only: a failing Check reports
	// Health{Reachable: false, Reason: Reason} (ReasonUnreachable when
	// empty) rather than an error, as the Provider contract requires.
	Reason egressproxy.HealthReason
}

// provider is the in-memory driver.Provider. It is safe for concurrent use.
type provider struct {
	opts  Options
	now   func() time.Time
	log   logr.Logger
	close chan struct{} // closed by Close: wakes fault delays

	mu       sync.Mutex
	closed   bool
	items    map[string]*item
	faults   map[Op][]*Fault
	nextIP   int
	proxies  sync.WaitGroup // every proxy goroutine
	reserved map[int]bool   // documentation addresses in use
	images   imageSet       // configured keys and their bases
}

type item struct {
	inst   egressproxy.Instance
	spec   egressproxy.Spec  // the spec it was created from (for ErrSpecConflict's message)
	guest  *guestconf.Config // the guest description of its user-data; nil: none
	image  string            // the image key it uses (its spec's, or the default)
	forced egressproxy.State // state forced by SetState; "" = follow the clock
	ready  time.Time         // when Provisioning turns Running
	host   int               // last octet of the 192.0.2.x address
	proxy  *proxyServer      // non-nil while the served proxy runs
}

// New returns the portable client over a new, empty in-memory entry. Its
// Control, for tests that make it misbehave, is reached with Client.As:
//
//	c := memprovider.New(nil)
//	var ctl *memprovider.Control
//	c.As(&ctl)
//	ctl.InjectFault(memprovider.OpGet, memprovider.Fault{Code: egressproxy.Transient, Times: 1})
func New(opts *Options) *egressproxy.Client {
	p := newProvider(opts)
	var attrs []attribute.KeyValue
	if p.opts.Entry != "" {
		attrs = append(attrs, obs.KeyEntry.String(p.opts.Entry))
	}
	return driver.NewClient(p, &egressproxy.Options{Logger: p.opts.Logger, TracerProvider: p.opts.TracerProvider, MeterProvider: p.opts.MeterProvider,
		MetricAttributes: attrs})
}

// Control steers one memprovider entry from a test: faults injected into
// its operations, states forced on its instances, an image base damaged on
// purpose. Get it from the entry's client with Client.As.
type Control struct{ p *provider }

// As offers *Control (see Client.As).
func (p *provider) As(target any) bool {
	if c, ok := target.(**Control); ok && c != nil {
		*c = &Control{p: p}
		return true
	}
	return false
}

func newProvider(opts *Options) *provider {
	var o Options
	if opts != nil {
		o = *opts
	}
	now := o.Now
	if now == nil {
		now = time.Now
	}
	log := o.Logger
	if log.GetSink() == nil {
		log = logr.Discard()
	}
	if o.DialTimeout <= 0 {
		o.DialTimeout = 5 * time.Second
	}
	if o.DialContext == nil {
		d := &net.Dialer{Timeout: o.DialTimeout}
		o.DialContext = func(ctx context.Context, network, address string) (net.Conn, error) {
			if !loopback.HostPort(address) {
				return nil, errNotLoopback
			}
			return d.DialContext(ctx, network, address)
		}
	}
	if o.Capacity.MemoryAvailableBytes == 0 {
		o.Capacity.MemoryAvailableBytes = defaultMemoryAvailable
	}
	if o.Capacity.CPUs == 0 {
		o.Capacity.CPUs = defaultCPUs
	}
	if o.Capacity.PoolAvailableBytes == 0 {
		o.Capacity.PoolAvailableBytes = defaultPoolAvailable
	}
	return &provider{
		opts:     o,
		now:      now,
		log:      log,
		close:    make(chan struct{}),
		items:    map[string]*item{},
		faults:   map[Op][]*Fault{},
		reserved: map[int]bool{},
		images:   newImageSet(o.Images),
	}
}

var _ driver.Provider = (*provider)(nil)

// errNotLoopback is the default dialer's refusal of a target beyond
// loopback.
var errNotLoopback = errors.New("memprovider: the default dialer reaches loopback targets only")

// InjectFault makes the next f.Times calls of op (every call when Times is
// 0) misbehave as f describes. Faults of one operation apply in the order
// they were injected.
func (c *Control) InjectFault(op Op, f Fault) {
	p := c.p
	p.mu.Lock()
	defer p.mu.Unlock()
	p.faults[op] = append(p.faults[op], &f)
}

// ClearFaults removes every injected fault.
func (c *Control) ClearFaults() {
	p := c.p
	p.mu.Lock()
	defer p.mu.Unlock()
	p.faults = map[Op][]*Fault{}
}

// SetState forces the state of an existing instance (for example
// StateFailed or StateStopped, to test an embedder's handling of them).
// An empty state returns it to normal provisioning. It returns NotFound
// when the instance does not exist.
func (c *Control) SetState(ref egressproxy.Ref, s egressproxy.State) error {
	p := c.p
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return errClosed()
	}
	it, ok := p.items[ref.Name]
	if !ok || it.inst.UID != ref.UID {
		return notFound(ref)
	}
	it.forced = s
	return nil
}

func errClosed() error {
	return errs.WithCode(errs.Permanent, fmt.Errorf("memprovider: %w", errs.ErrClosed))
}

func notFound(ref egressproxy.Ref) error {
	return errs.Errorf(errs.NotFound, "memprovider: no instance with UID %s", errs.Quote(ref.UID))
}

// enter checks ctx and closed, then applies an injected fault. A non-nil
// fault result with a nil error means "report unhealthy" (OpCheck only).
func (p *provider) enter(ctx context.Context, op Op) (*Fault, error) {
	if err := ctx.Err(); err != nil {
		return nil, errs.FromContext(err)
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, errClosed()
	}
	var f *Fault
	if q := p.faults[op]; len(q) > 0 {
		f = q[0]
		if f.Times > 0 {
			f.Times--
			if f.Times == 0 {
				p.faults[op] = q[1:]
			}
		}
		cp := *f
		f = &cp
	}
	p.mu.Unlock()
	if p.opts.CallDelay > 0 {
		if err := p.wait(ctx, p.opts.CallDelay); err != nil {
			return nil, err
		}
	}
	if f == nil {
		return nil, nil
	}
	if f.Delay > 0 {
		t := time.NewTimer(f.Delay)
		defer t.Stop()
		if f.Waiting != nil {
			f.Waiting()
		}
		select {
		case <-ctx.Done():
			return nil, errs.FromContext(ctx.Err())
		case <-p.close:
			return nil, errClosed()
		case <-t.C:
		}
	}
	if f.Code == errs.OK && f.Err == nil {
		return nil, nil
	}
	if op == OpCheck {
		return f, nil
	}
	err := f.Err
	if err == nil {
		err = fmt.Errorf("memprovider: injected %s fault", f.Code)
	}
	if f.Code == errs.OK {
		return nil, err
	}
	return nil, errs.WithCode(f.Code, err)
}

// wait waits d, or until ctx ends (its error) or the provider is closed.
func (p *provider) wait(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return errs.FromContext(ctx.Err())
	case <-p.close:
		return errClosed()
	case <-t.C:
		return nil
	}
}

// Create creates the instance, or returns the existing one with the same
// name, UID and spec digest. Same name and UID but another spec:
// errs.ErrSpecConflict (Permanent), naming the fields that differ (never
// their user-data). Same name, other UID: Permanent.
func (p *provider) Create(ctx context.Context, spec egressproxy.Spec) (egressproxy.Instance, error) {
	if _, err := p.enter(ctx, OpCreate); err != nil {
		return egressproxy.Instance{}, err
	}
	if err := spec.Validate(); err != nil {
		return egressproxy.Instance{}, err
	}
	g, err := readGuest(spec)
	if err != nil {
		return egressproxy.Instance{}, err
	}
	key := p.images.resolve(spec.ImageKey)
	if !p.images.configured(key) {
		return egressproxy.Instance{}, errs.WithCode(errs.Permanent, &errs.FieldError{Field: "ImageKey", Value: key, Rule: "is not a configured image of this provider"})
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return egressproxy.Instance{}, errClosed()
	}
	if it, ok := p.items[spec.Name]; ok {
		if it.inst.UID != spec.UID {
			return egressproxy.Instance{}, errs.Errorf(errs.Permanent,
				"memprovider: the name is taken by an instance with another UID")
		}
		if d := spec.Digest(); d != it.inst.SpecDigest {
			return egressproxy.Instance{}, errs.Errorf(errs.Permanent,
				"memprovider: %w (%s)", errs.ErrSpecConflict, specDiff(it.spec, spec))
		}
		return p.readLocked(it)
	}
	port := spec.Port
	if port == 0 {
		port = naming.DefaultPort
	}
	now := p.now().UTC()
	it := &item{
		inst: egressproxy.Instance{
			Ref:        egressproxy.Ref{Name: spec.Name, UID: spec.UID},
			CreatedAt:  now,
			Port:       port,
			SpecDigest: spec.Digest(),
		},
		spec:  spec,
		guest: g,
		image: key,
		ready: now.Add(p.opts.ProvisionDelay),
		host:  p.allocHostLocked(),
	}
	p.images.publishLocked(key)
	p.items[spec.Name] = it
	return p.readLocked(it)
}

// specDiff names the fields in which b differs from a (values only for
// Port, ImageKey and MachineType: user-data may hold secrets).
func specDiff(a, b egressproxy.Spec) string {
	var out []string
	if a.EffectivePort() != b.EffectivePort() {
		out = append(out, fmt.Sprintf("Port %d, now %d", a.EffectivePort(), b.EffectivePort()))
	}
	if a.ImageKey != b.ImageKey {
		out = append(out, fmt.Sprintf("ImageKey %s, now %s", errs.Quote(a.ImageKey), errs.Quote(b.ImageKey)))
	}
	if a.MachineType != b.MachineType {
		out = append(out, fmt.Sprintf("MachineType %s, now %s", errs.Quote(a.MachineType), errs.Quote(b.MachineType)))
	}
	if a.UserData != b.UserData {
		out = append(out, "UserData differs")
	}
	if len(out) == 0 {
		return "the digest differs"
	}
	return strings.Join(out, "; ")
}

// readGuest reads the guest description of spec's user-data: nil when the
// user-data was not rendered by package guest. Rendered user-data that
// cannot be read, or that names another port than the spec, is Permanent
// (a guest would not serve what the embedder expects); the error never
// quotes the user-data.
func readGuest(spec egressproxy.Spec) (*guestconf.Config, error) {
	g, ok, err := guestconf.Parse(spec.UserData)
	switch {
	case !ok:
		return nil, nil
	case err != nil:
		return nil, errs.WithCode(errs.Permanent, &errs.FieldError{Field: "UserData", Rule: "is a guest description memprovider cannot read: " + err.Error()})
	case g.Port != spec.EffectivePort():
		return nil, errs.WithCode(errs.Permanent, &errs.FieldError{Field: "Port", Value: strconv.Itoa(spec.EffectivePort()),
			Rule: fmt.Sprintf("differs from the port %d the guest description in UserData listens on", g.Port)})
	}
	return g, nil
}

func (p *provider) allocHostLocked() int {
	for i := 0; i < 254; i++ {
		h := (p.nextIP+i)%254 + 1
		if !p.reserved[h] {
			p.reserved[h] = true
			p.nextIP = h
			return h
		}
	}
	return 0 // more than 254 instances: they share .0, harmless in memory
}

// readLocked computes the instance as a backend would report it now,
// starting or stopping its served proxy as its state requires. It returns a
// copy.
func (p *provider) readLocked(it *item) (egressproxy.Instance, error) {
	inst := it.inst
	inst.State = p.stateLocked(it)
	if inst.State != egressproxy.StateRunning {
		p.stopProxyLocked(it)
		return inst, nil
	}
	if !p.opts.ServeProxies {
		inst.IP = "192.0.2." + strconv.Itoa(it.host)
		inst.AddressSource = "static"
		return inst, nil
	}
	if it.proxy == nil {
		ps, err := p.startProxy(it.inst.Name, it.guest)
		if err != nil {
			return egressproxy.Instance{}, errs.Errorf(errs.Transient,
				"memprovider: serving the proxy: %w", err)
		}
		it.proxy = ps
	}
	inst.IP = p.proxyAddr().String()
	inst.Port = it.proxy.port
	inst.AddressSource = "listener"
	return inst, nil
}

// proxyAddr is the address the served proxies listen on.
func (p *provider) proxyAddr() netip.Addr {
	if p.opts.ProxyAddress.IsValid() {
		return p.opts.ProxyAddress.Unmap()
	}
	return netip.AddrFrom4([4]byte{127, 0, 0, 1})
}

// stateLocked is it's state now: forced, or following the clock.
func (p *provider) stateLocked(it *item) egressproxy.State {
	switch {
	case it.forced != "":
		return it.forced
	case p.now().Before(it.ready):
		return egressproxy.StateProvisioning
	default:
		return egressproxy.StateRunning
	}
}

func (p *provider) stopProxyLocked(it *item) {
	if it.proxy != nil {
		it.proxy.shutdown()
		it.proxy = nil
	}
}

// Get reads the instance. Missing, or present with another UID: NotFound.
func (p *provider) Get(ctx context.Context, ref egressproxy.Ref) (egressproxy.Instance, error) {
	if _, err := p.enter(ctx, OpGet); err != nil {
		return egressproxy.Instance{}, err
	}
	if err := naming.ValidateRef(ref.Name, ref.UID); err != nil {
		return egressproxy.Instance{}, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return egressproxy.Instance{}, errClosed()
	}
	it, ok := p.items[ref.Name]
	if !ok || it.inst.UID != ref.UID {
		return egressproxy.Instance{}, notFound(ref)
	}
	return p.readLocked(it)
}

// Delete removes the instance and stops its proxy. Missing (or another
// UID under that name): nil, and nothing is removed.
func (p *provider) Delete(ctx context.Context, ref egressproxy.Ref) error {
	if _, err := p.enter(ctx, OpDelete); err != nil {
		return err
	}
	if err := naming.ValidateRef(ref.Name, ref.UID); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return errClosed()
	}
	it, ok := p.items[ref.Name]
	if !ok || it.inst.UID != ref.UID {
		return nil
	}
	p.stopProxyLocked(it)
	delete(p.reserved, it.host)
	delete(p.items, ref.Name)
	return nil
}

// List returns every instance, sorted by name.
func (p *provider) List(ctx context.Context) ([]egressproxy.Instance, error) {
	if _, err := p.enter(ctx, OpList); err != nil {
		return nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, errClosed()
	}
	out := make([]egressproxy.Instance, 0, len(p.items))
	for _, it := range p.items {
		inst, err := p.readLocked(it)
		if err != nil {
			return nil, err
		}
		out = append(out, inst)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// The simulated host of a zero Options.Capacity field.
const (
	defaultMemoryAvailable = 16 << 30
	defaultCPUs            = 8
	defaultPoolAvailable   = 100 << 30
)

// Check reports the provider reachable, with details: "backend"
// ("memory"), "instances", "serveProxies", and the Capacity of
// Options.Capacity with the instances that run. An OpCheck fault makes it
// report unreachable instead (no Capacity).
func (p *provider) Check(ctx context.Context) (egressproxy.Health, error) {
	f, err := p.enter(ctx, OpCheck)
	if err != nil {
		return egressproxy.Health{}, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return egressproxy.Health{}, errClosed()
	}
	h := egressproxy.Health{
		Reachable: true,
		Details: map[string]string{
			"backend":      "memory",
			"instances":    strconv.Itoa(len(p.items)),
			"serveProxies": strconv.FormatBool(p.opts.ServeProxies),
		},
		CheckedAt: p.now().UTC(),
	}
	capacity := p.opts.Capacity
	capacity.Instances = 0
	for _, it := range p.items {
		if st := p.stateLocked(it); st == egressproxy.StateRunning || st == egressproxy.StateProvisioning {
			capacity.Instances++
		}
	}
	h.Capacity = &capacity
	if f != nil {
		h.Capacity = nil
		h.Reachable = false
		h.Reason = f.Reason
		if h.Reason == egressproxy.ReasonNone {
			h.Reason = egressproxy.ReasonUnreachable
		}
		h.Message = "injected fault"
		if f.Err != nil {
			h.Message = f.Err.Error()
		}
	}
	return h, nil
}

// Close stops every served proxy and its goroutines and waits for them.
// Instances are forgotten (it is memory). Calls after Close return an error
// wrapping errs.ErrClosed, classed Permanent. Close is idempotent and
// returns nil.
func (p *provider) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	close(p.close)
	for _, it := range p.items {
		p.stopProxyLocked(it)
	}
	p.items = nil
	p.mu.Unlock()
	p.proxies.Wait()
	return nil
}
