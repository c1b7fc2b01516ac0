package kvm2

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/internal/basecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/libvirtconn"
	"github.com/egressproxy/egressproxy/internal/libvirterr"
	"github.com/egressproxy/egressproxy/internal/obs"
	"github.com/egressproxy/egressproxy/sshconn"
)

// tracerName is the instrumentation name of this package's spans.
const tracerName = "github.com/egressproxy/egressproxy/kvm2"

// provider is the kvm2 driver.Provider of one entry (one host, one pool). It
// is safe for concurrent use.
type provider struct {
	cfg    Config
	log    logr.Logger
	tracer trace.Tracer

	lv    lvSession  // the shared libvirt connection (sshSession)
	cache imageCache // the entry's base images (*basecache.Cache)
	locks nameLocks

	accel accelCache // whether the host offers KVM

	seedsBuilt atomic.Int64 // seeds Create built: none for an instance that exists

	closed    atomic.Bool
	closeOnce sync.Once
	closeErr  error
}

// Open validates cfg and returns the portable client of that entry. It does
// not touch the host: the first call dials, so Check can report an
// unreachable host, bad credentials or an unknown host key as a Health
// reason. A bad cfg is a Permanent error joining one
// *egressproxy.FieldError per broken rule, each naming the Go field path
// (Images["deb"].SHA256); Open requires a key source (a Config field or
// opts.Signer) and a known_hosts source, which a file read by ParseConfig
// may leave out. A nil opts is valid. Closing the client closes the
// entry's connections.
func Open(ctx context.Context, cfg Config, opts *Options) (*egressproxy.Client, error) {
	p, err := open(ctx, cfg, opts)
	if err != nil {
		return nil, err
	}
	return driver.NewClient(p, clientOptions(p.cfg, opts)), nil
}

// clientOptions are the options of the entry's client: opts' logger,
// tracer and meter providers, its metrics labelled with the entry.
func clientOptions(cfg Config, opts *Options) *egressproxy.Options {
	if opts == nil {
		opts = &Options{}
	}
	return &egressproxy.Options{Logger: opts.Logger, TracerProvider: opts.TracerProvider,
		MeterProvider: opts.MeterProvider, MetricAttributes: entryAttrs(cfg)}
}

// entryAttrs are the attributes of every metric of the entry.
func entryAttrs(cfg Config) []attribute.KeyValue {
	return []attribute.KeyValue{obs.KeyEntry.String(cfg.Entry)}
}

// open is Open without the client: the driver itself.
func open(ctx context.Context, cfg Config, opts *Options) (*provider, error) {
	if err := ctx.Err(); err != nil {
		return nil, errs.FromContext(err)
	}
	if opts == nil {
		opts = &Options{}
	}
	cfg, err := cfg.validate(opts.Signer != nil)
	if err != nil {
		return nil, err
	}
	base := opts.Logger
	if base.GetSink() == nil {
		base = logr.Discard()
	}
	// Each package names its own logger and adds its own keys once:
	// imagecache adds entry and pool itself, sshconn only its address.
	log := base.WithValues("entry", cfg.Entry)
	tp := opts.TracerProvider
	if tp == nil {
		tp = noop.NewTracerProvider()
	}
	pool, err := sshconn.New(sshconn.Config{
		Address:           cfg.Address,
		User:              cfg.User,
		KeyFile:           cfg.KeyFile,
		Key:               cfg.Key,
		KeyPassphrase:     cfg.KeyPassphrase,
		AgentSocket:       cfg.AgentSocket,
		KnownHostsFile:    cfg.KnownHostsFile,
		KnownHosts:        cfg.KnownHosts,
		DialTimeout:       cfg.DialTimeout,
		KeepaliveInterval: cfg.KeepaliveInterval,
		KeepaliveCount:    cfg.KeepaliveCount,
	}, &sshconn.Options{Logger: log, Signer: opts.Signer, MeterProvider: opts.MeterProvider, MetricAttributes: entryAttrs(cfg)})
	if err != nil {
		return nil, errs.WithCode(errs.Permanent, fmt.Errorf("kvm2: invalid config: %w", err))
	}
	lv := libvirtconn.New(pool, libvirtconn.Config{
		Address:     cfg.Address,
		Socket:      cfg.LibvirtSocket,
		URI:         cfg.LibvirtURI,
		CallTimeout: cfg.CallTimeout,
	}, &libvirtconn.Options{Logger: log, MeterProvider: opts.MeterProvider, MetricAttributes: entryAttrs(cfg)})
	fanout := basecache.ProcessFanout()
	if opts.PrivateImageCache {
		fanout = nil
	}
	cache, err := basecache.New(basecache.SSH(lv), basecache.Config{
		Entry:            cfg.Entry,
		Pool:             cfg.Pool,
		TransferBudget:   cfg.TransferBudget,
		ClaimTimeout:     cfg.ClaimTimeout,
		HTTPClient:       opts.HTTPClient,
		Progress:         opts.ImageProgress,
		ProgressInterval: opts.ImageProgressInterval,
		Fanout:           fanout,
		Logger:           base,
		TracerProvider:   tp,
		MeterProvider:    opts.MeterProvider,
	})
	if err != nil {
		_ = lv.Close()
		_ = pool.Close()
		return nil, errs.WithCode(errs.Permanent, fmt.Errorf("kvm2: invalid config: %w", err))
	}
	return newProvider(cfg, log, tp.Tracer(tracerName), &sshSession{lv: lv, pool: pool}, cache), nil
}

func (p *provider) checkOpen() error {
	if p.closed.Load() {
		return errs.WithCode(errs.Permanent, fmt.Errorf("kvm2 %s: %w", p.cfg.Entry, errs.ErrClosed))
	}
	return nil
}

// do runs fn on the shared libvirt connection inside a child span of the
// public operation's, named "kvm2.libvirt." + op without its "kvm2." prefix
// (a fixed set: see docs/observability.md), and returns fn's error
// unclassified (the caller classifies; the span gets classify's class).
func (p *provider) do(ctx context.Context, op string, fn func(lvAPI) error, attrs ...attribute.KeyValue) error {
	ctx, span := obs.Start(ctx, p.tracer, "kvm2.libvirt."+strings.TrimPrefix(op, "kvm2."), obs.Attrs{}, libvirtAttrs(attrs)...)
	err := p.lv.Do(ctx, fn)
	obs.End(span, classify(err))
	return err
}

// libvirtAttrs puts the attributes of a libvirt span in the convention's
// namespaces: "volume" is egressproxy.volume, the others get "kvm2.".
func libvirtAttrs(attrs []attribute.KeyValue) []attribute.KeyValue {
	out := make([]attribute.KeyValue, len(attrs))
	for i, kv := range attrs {
		if kv.Key == "volume" {
			kv.Key = obs.KeyVolume
		} else {
			kv.Key = "kvm2." + kv.Key
		}
		out[i] = kv
	}
	return out
}

// start starts the span of a public operation (entry, the instance when
// there is one, its overlay volume when withVolume) and returns the
// function that ends it with the operation's error.
func (p *provider) start(ctx context.Context, name, instance string, withVolume bool) (context.Context, func(error)) {
	a := obs.Attrs{Entry: p.cfg.Entry, Instance: instance}
	if withVolume && instance != "" {
		a.Volume = overlayVolume(domainName(p.cfg.Entry, instance))
	}
	ctx, span := obs.Start(ctx, p.tracer, name, a)
	return ctx, func(err error) { obs.End(span, err) }
}

// detailPoolRefresh is the Check detail set when libvirt refused to refresh
// a pool that has a volume being built in it.
const detailPoolRefresh = "poolRefresh"

// errPoolNotActive marks a pool that exists but does not run.
var errPoolNotActive = libvirterr.ErrPoolInactive

var poolStateNames = map[uint8]string{
	uint8(libvirt.StoragePoolInactive):     "inactive",
	uint8(libvirt.StoragePoolBuilding):     "building",
	uint8(libvirt.StoragePoolRunning):      "running",
	uint8(libvirt.StoragePoolDegraded):     "degraded",
	uint8(libvirt.StoragePoolInaccessible): "inaccessible",
}

func poolStateName(s uint8) string {
	if n, ok := poolStateNames[s]; ok {
		return n
	}
	return "state-" + strconv.Itoa(int(s))
}

// formatLibVersion turns libvirt's major*1e6+minor*1e3+micro into
// "major.minor.micro".
func formatLibVersion(v uint64) string {
	return fmt.Sprintf("%d.%d.%d", v/1000000, v/1000%1000, v%1000)
}

// formatGiB formats bytes as GiB with two decimals.
func formatGiB(b uint64) string {
	return strconv.FormatFloat(float64(b)/(1<<30), 'f', 2, 64)
}

// Check reports the entry's health without creating anything: Reachable with
// Details hostname, libvirtVersion, poolState, poolFreeGiB, domainType (what
// Create defines: "kvm" or "qemu") and acceleration ("kvm" or "none") — and
// poolRefresh when libvirt refused to refresh the pool because a volume is
// being built in it (another call's Create; poolFreeGiB is then as of the
// last refresh, and the entry is still Reachable) — and the Capacity: the
// host's CPUs (libvirt's node info), its available memory (libvirt's node
// memory stats: free, buffers and page cache), the owner's instances whose
// domains run (as List counts Running and Provisioning) and the pool's free
// space; when libvirtd refuses the node calls the entry is still Reachable,
// without a Capacity, with a capacity detail saying why — or
// not Reachable with a Reason (CredentialsUnavailable, Unauthorized,
// HostKeyUnknown, HostKeyMismatch, Forbidden, PoolNotFound, PoolNotActive,
// Unreachable, Unknown) and a Message. Details learnt before the failure are
// kept.
//
// Counting the running instances lists the host's domains, which libvirtd
// answers only once no domain of the host is being started: a Check while a
// Create (of any process) boots a domain on the same host takes about as
// long as that start (docs/observability.md). Entries on other hosts are
// not affected.
//
// Unless DomainType is "qemu", Check reads the host's domain capabilities
// and refreshes what Create uses. With the zero DomainType on
// a host that offers no KVM, the entry is Reachable but degraded: domainType
// "qemu", acceleration "none", and a "degraded" detail saying that guests
// run without acceleration. An explicit "kvm" on such a host is not
// Reachable: Reason Unknown, with the Message naming the field DomainType.
//
// The error is only for the call itself: the context ended (Canceled /
// DeadlineExceeded) or the provider is closed (ErrClosed, Permanent).
func (p *provider) Check(ctx context.Context) (_ egressproxy.Health, opErr error) {
	ctx, end := p.start(ctx, "kvm2.Check", "", false)
	defer func() { end(opErr) }()
	if err := p.checkOpen(); err != nil {
		return egressproxy.Health{}, err
	}
	var (
		mu       sync.Mutex
		details  = map[string]string{}
		kvm      bool                  // whether the host offers KVM, when DomainType is not "qemu"
		capacity *egressproxy.Capacity // nil when libvirtd refused to tell it
	)
	set := func(k, v string) {
		mu.Lock()
		details[k] = v
		mu.Unlock()
	}
	err := p.do(ctx, "kvm2.Check", func(l lvAPI) error {
		host, err := l.ConnectGetHostname()
		if err != nil {
			return fmt.Errorf("get hostname: %w", err)
		}
		set("hostname", host)
		ver, err := l.ConnectGetLibVersion()
		if err != nil {
			return fmt.Errorf("get libvirt version: %w", err)
		}
		set("libvirtVersion", formatLibVersion(ver))
		pool, err := l.StoragePoolLookupByName(p.cfg.Pool)
		if err != nil {
			return fmt.Errorf("look up storage pool %q: %w", p.cfg.Pool, err)
		}
		refreshErr := l.StoragePoolRefresh(pool, 0)
		state, _, _, avail, err := l.StoragePoolGetInfo(pool)
		if err != nil {
			return fmt.Errorf("get storage pool %q info: %w", p.cfg.Pool, err)
		}
		set("poolState", poolStateName(state))
		if state != uint8(libvirt.StoragePoolRunning) {
			return fmt.Errorf("storage pool %q is %s: %w", p.cfg.Pool, poolStateName(state), errPoolNotActive)
		}
		switch {
		case refreshErr == nil:
		case libvirterr.PoolBusy(refreshErr):
			// A volume is being built in the pool (another call's
			// Create): libvirt refuses refreshes until it is done. The
			// pool runs; its figures are those of the last refresh.
			set(detailPoolRefresh, "skipped: "+errs.ClipMessage(refreshErr.Error()))
		default:
			return fmt.Errorf("refresh storage pool %q: %w", p.cfg.Pool, refreshErr)
		}
		set("poolFreeGiB", formatGiB(avail))
		if p.cfg.DomainType != domainTypeQEMU {
			if kvm, err = readKVMOffered(l); err != nil {
				return err
			}
		}
		c, err := p.readCapacity(ctx, l)
		switch {
		case err == nil:
			c.PoolAvailableBytes = int64(avail)
			capacity = &c
		case capacityRefused(err):
			set(detailCapacity, "unavailable: "+errs.ClipMessage(err.Error()))
		default:
			return err
		}
		return nil
	}, attribute.String("pool", p.cfg.Pool))
	if err == nil {
		// fn has returned: kvm is its answer.
		typ := domainTypeQEMU
		if p.cfg.DomainType != domainTypeQEMU {
			p.learnAccel(kvm)
			typ, err = p.decideDomainType(kvm)
		}
		accelDetails(set, p.cfg.DomainType, typ)
	}

	mu.Lock()
	h := egressproxy.Health{Details: details, CheckedAt: time.Now().UTC()}
	mu.Unlock()
	if err == nil {
		h.Reachable = true
		h.Capacity = capacity
		p.log.V(1).Info("check: reachable", "hostname", details["hostname"], "libvirtVersion", details["libvirtVersion"],
			"poolState", details["poolState"], "poolFreeGiB", details["poolFreeGiB"], "domainType", details[detailDomainType])
		return h, nil
	}
	// The call itself failed: the caller's context ended or we are closed.
	if cerr := ctx.Err(); cerr != nil {
		return egressproxy.Health{}, errs.FromContext(fmt.Errorf("kvm2 %s: %w", p.cfg.Entry, err))
	}
	if sshKind(err) == sshconn.KindClosed || p.closed.Load() {
		return egressproxy.Health{}, errs.WithCode(errs.Permanent, fmt.Errorf("kvm2 %s: %w", p.cfg.Entry, closedError{Err: err}))
	}
	h.Reason = healthReason(err)
	h.Message = errs.ClipMessage(err.Error())
	p.log.Info("check: unhealthy", "reason", string(h.Reason), "err", err)
	return h, nil
}

// Close releases the libvirt connection, the SSH connection and every
// goroutine the provider started. It does not delete instances. It is
// idempotent; calls after Close fail with errs.ErrClosed (Permanent).
func (p *provider) Close() error {
	p.closeOnce.Do(func() {
		p.closed.Store(true)
		cerr := p.cache.Close()
		lerr := p.lv.Close() // the libvirt session, then the SSH pool
		p.closeErr = errors.Join(cerr, lerr)
		p.log.V(1).Info("closed")
	})
	return p.closeErr
}
