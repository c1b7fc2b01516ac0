package basecache

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
	"github.com/egressproxy/egressproxy/internal/obs"
	"github.com/egressproxy/egressproxy/internal/redact"
	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// formatOf is img's format, its zero value being qcow2.
func formatOf(img imagecache.Image) string {
	if img.Format == "" {
		return imagecache.FormatQCOW2
	}
	return img.Format
}

// Config configures a Cache.
type Config struct {
	// Entry is the provider entry name (naming.ValidateName rules).
	// Required.
	Entry string
	// Pool is the libvirt storage pool holding the bases. Required.
	Pool string
	// TransferBudget bounds one cold fetch (HTTP + upload + verify +
	// publish). Zero: 20m. A claim older than twice this is stale.
	TransferBudget time.Duration
	// HTTPGrace: the HTTP download's deadline is HTTPGrace before the end
	// of the fetch's TransferBudget (one clock: the budget counts from the
	// start of the fetch, so time spent waiting for another writer's claim
	// comes off the download, not off the grace), so a stalled mirror ends
	// as a clean error before the budget would have to cut the libvirt
	// link. Zero: 1m, or TransferBudget/4 when that is shorter. Must be <
	// TransferBudget.
	HTTPGrace time.Duration
	// HTTPClient fetches images. Zero: a client of the cache's own with no
	// overall timeout (the deadline comes from the budget), whose idle
	// connections Close closes (a caller's client, or the one a Fanout
	// shares, is left as it is).
	HTTPClient *http.Client
	// Progress, when set, is called with the transfer progress at most
	// every ProgressInterval (and once at the end of the upload), from the
	// goroutine that feeds the upload: it must not block for long.
	Progress func(imagecache.Progress)
	// ProgressInterval is the progress callback and log interval. Zero: 5s.
	ProgressInterval time.Duration
	// ClaimTimeout: a claim (see the package doc) whose holder has not
	// refreshed it for this long is stale and may be taken over; the
	// holder refreshes it every ClaimTimeout/4 and gives its work up when
	// it could not refresh for ClaimTimeout/2, so a claim is never taken
	// over while its holder works. Every cache sharing a pool should use
	// the same value. Zero: 2m.
	ClaimTimeout time.Duration
	// StreamStall is the no-progress timeout of every libvirt stream (the
	// upload and the read-back): no byte moved for this long, from the
	// start of the stream or since the last chunk, means the stream hangs.
	// Its dedicated connection is then discarded and the stream retried
	// once on a fresh one (the upload with a new download of the image).
	// Zero: 1m.
	StreamStall time.Duration
	// Logger receives progress and decision lines. Zero value: discard.
	Logger logr.Logger
	// TracerProvider makes the fetch/upload/verify spans. Zero: no spans.
	TracerProvider trace.TracerProvider
	// MeterProvider records the cache's metrics, each series labelled
	// with egressproxy.entry (Entry): the bytes of cold fetches by source,
	// their durations, failed checks of an image's bytes, evictions, and
	// the entry's published bases and their size (reported until Close).
	// Nil: no metrics, and no call made for them.
	MeterProvider metric.MeterProvider
	// Fanout, when set, shares the HTTP download of an image among the
	// concurrent cold fetches of every cache given the same Fanout (one
	// per entry, i.e. per host: see Fanout and ProcessFanout), and lets a
	// cache going cold later copy a base another of them published; each
	// host's upload, read-back digest, size check and marker stay its
	// own. A cache with a Fanout and no HTTPClient uses one client shared
	// by all such caches (downloads and copies are shared per client).
	// The cache joins the Fanout in New and leaves it in Close. Nil:
	// every fetch downloads on its own.
	Fanout *Fanout
}

// Base is a published, verified base image.
type Base struct {
	Volume string // volume name
	Path   string // volume path on the host
	Digest string // sha256 hex of the stored bytes
	Format string // "qcow2" or "raw"
	// Source is where Ensure got the base from, one of imagecache's
	// source names: pool (already published), mirror (downloaded by this
	// fetch), shared (a download of the mirror shared through
	// Config.Fanout), detached (shared, then finished on its own
	// download), peer (copied from a base another cache of the Fanout had
	// published: over the network, alone or shared, or inside its own
	// host). When the shared download switched sources while this fetch
	// read it, the sources' names in order joined by "+": "peer+mirror"
	// is a copy from a peer that the mirror finished. Empty from List and
	// Verify.
	Source string
}

// Entry is one base of this cache's entry, as found in the pool.
type Entry struct {
	Base
	// Marker is the marker volume name, "" when the base has no valid one
	// (debris; the next Ensure replaces it).
	Marker string
	// Size is the base's stored size in bytes on the host (its physical
	// size as libvirt reports it: the file size for a dir pool).
	Size int64
	// UsedBy are the names of defined domains (running or not) whose disks
	// are backed by the base.
	UsedBy []string
	// Unresolved names the disks on the host whose backing chain cannot be
	// followed to its end (in an inactive pool, a qcow2 file outside every
	// pool, a volume that vanished): any of them might use the base, so
	// UsedBy may be incomplete, and Evict refuses while one is listed.
	Unresolved []string
}

const (
	defaultBudget       = 20 * time.Minute
	defaultGrace        = time.Minute
	defaultInterval     = 5 * time.Second
	defaultStreamStall  = time.Minute
	defaultClaimTimeout = 2 * time.Minute
	// cleanupTimeout bounds deleting a failed volume or releasing a claim
	// after the operation's own context ended.
	cleanupTimeout = 30 * time.Second
	// closeWait bounds how long Close waits for in-flight fetches.
	closeWait = 10 * time.Second
	// pollInterval is how often a waiter looks for another writer's result.
	pollInterval = 500 * time.Millisecond
)

// Cache keeps the base images of one provider entry in one pool. It is safe
// for concurrent use.
type Cache struct {
	conn   Conn
	cfg    Config
	log    logr.Logger
	tracer trace.Tracer
	meters *cacheMeters // nil without Config.MeterProvider

	mu      sync.Mutex
	closed  bool
	flights map[string]*flight
	// instance prefixes the token of every claim this cache takes; live
	// holds the tokens of the claims it holds now. A claim of ours that is
	// not live is an orphan (its cleanup failed) and is reclaimed at once.
	instance string
	live     map[string]bool
	wg       sync.WaitGroup
	stop     context.Context // canceled by Close
	cancel   context.CancelFunc
	// segment is how many bytes one upload stream of a fetch carries
	// (segmentSize; tests make it small to get many segments).
	segment int64
	// drainStall: a volume whose size stays short of the bytes sent for
	// this long fails the upload (the constant drainStall; tests shorten
	// it).
	drainStall time.Duration

	// pool is the pool's handle (name and UUID) once looked up, so that
	// each call on the pool does not pay a lookup's round trip first (see
	// withPool).
	poolMu  sync.Mutex
	pool    libvirt.StoragePool
	poolSet bool
	// hostPools are the UUIDs of every pool of the cache's libvirtd, as
	// listed when it last looked for peers (sameHost).
	hostMu    sync.Mutex
	hostPools map[libvirt.UUID]bool

	// transport is the default HTTP client's transport (no
	// Config.HTTPClient, no Fanout): Close closes its idle connections.
	// Nil when the client is the caller's or shared.
	transport *http.Transport
}

type flight struct {
	done    chan struct{}
	base    Base
	err     error
	waiters int
	cancel  context.CancelFunc
	img     imagecache.Image
	// abandoned: every caller left; the fetch is being canceled.
	abandoned bool
}

// New validates cfg (errors name the field, classed Permanent) and returns
// a Cache. It does no I/O.
func New(conn Conn, cfg Config) (*Cache, error) {
	cfg, err := withDefaults(conn, cfg)
	if err != nil {
		return nil, err
	}
	var transport *http.Transport // the default client's, ours to close
	if cfg.HTTPClient == nil {
		if cfg.Fanout != nil {
			cfg.HTTPClient = fanoutClient
		} else {
			// A transport of its own, not http.DefaultTransport: Close
			// closes its idle connections (the process's other users of
			// the default transport keep theirs).
			transport = http.DefaultTransport.(*http.Transport).Clone()
			cfg.HTTPClient = &http.Client{Transport: transport}
		}
	}
	log := cfg.Logger
	if log.GetSink() == nil {
		log = logr.Discard()
	}
	tp := cfg.TracerProvider
	if tp == nil {
		tp = noop.NewTracerProvider()
	}
	stop, cancel := context.WithCancel(context.Background())
	c := &Cache{
		conn:       conn,
		cfg:        cfg,
		log:        log.WithName("imagecache").WithValues("entry", cfg.Entry, "pool", cfg.Pool),
		tracer:     tp.Tracer("github.com/egressproxy/egressproxy/imagecache"),
		meters:     newCacheMeters(cfg.MeterProvider, cfg.Entry),
		flights:    map[string]*flight{},
		instance:   randHex(instanceBytes),
		live:       map[string]bool{},
		stop:       stop,
		cancel:     cancel,
		segment:    segmentSize,
		drainStall: drainStall,
		transport:  transport,
	}
	if cfg.Fanout != nil {
		cfg.Fanout.register(c)
	}
	return c, nil
}

// withDefaults validates conn and cfg (every problem at once, classed
// Permanent) and returns cfg with its zero durations set to the defaults.
func withDefaults(conn Conn, cfg Config) (Config, error) {
	var problems []error
	if conn == nil {
		problems = append(problems, &errs.FieldError{Field: "conn", Rule: "is required"})
	}
	if err := naming.ValidateName("Entry", cfg.Entry); err != nil {
		problems = append(problems, err)
	}
	if cfg.Pool == "" {
		problems = append(problems, &errs.FieldError{Field: "Pool", Rule: "is required"})
	}
	if cfg.TransferBudget < 0 || cfg.HTTPGrace < 0 || cfg.ProgressInterval < 0 || cfg.StreamStall < 0 || cfg.ClaimTimeout < 0 {
		problems = append(problems, &errs.FieldError{Field: "TransferBudget/HTTPGrace/ProgressInterval/StreamStall/ClaimTimeout", Rule: "must not be negative"})
	}
	cfg.TransferBudget = cmp.Or(cfg.TransferBudget, defaultBudget)
	cfg.HTTPGrace = cmp.Or(cfg.HTTPGrace, min(defaultGrace, cfg.TransferBudget/4))
	if cfg.HTTPGrace >= cfg.TransferBudget {
		problems = append(problems, &errs.FieldError{Field: "HTTPGrace", Value: cfg.HTTPGrace.String(), Rule: fmt.Sprintf("must be shorter than TransferBudget (%s)", cfg.TransferBudget)})
	}
	if len(problems) > 0 {
		return cfg, errs.WithCode(errs.Permanent, errors.Join(problems...))
	}
	cfg.StreamStall = cmp.Or(cfg.StreamStall, defaultStreamStall)
	cfg.ClaimTimeout = cmp.Or(cfg.ClaimTimeout, defaultClaimTimeout)
	cfg.ProgressInterval = cmp.Or(cfg.ProgressInterval, defaultInterval)
	return cfg, nil
}

// BaseName returns the volume name of img's base in this cache.
func (c *Cache) BaseName(img imagecache.Image) string {
	return BaseName(c.cfg.Entry, img.Key, formatOf(img))
}

func (c *Cache) staleAfter() time.Duration { return 2 * c.cfg.TransferBudget }

var errClosed = errs.WithCode(errs.Permanent, fmt.Errorf("imagecache: %w", errs.ErrClosed))

// Ensure returns img's published base, fetching, verifying and publishing
// it first when the pool has no usable one. Concurrent Ensure calls for one
// image share one fetch. The fetch runs under its own TransferBudget; when
// every caller waiting for it has gone, it is canceled.
//
// Errors: Permanent for a bad image, an HTTP 4xx, a digest different from
// the configured one (naming both and the remedy); Transient for network,
// libvirt, short or corrupt transfers and a pool without room; the
// caller's context codes when ctx ends first.
func (c *Cache) Ensure(ctx context.Context, img imagecache.Image) (_ Base, opErr error) {
	ctx, span := c.start(ctx, "imagecache.Ensure", "")
	defer func() { endOp(span, opErr, img.URL) }()
	if err := img.Validate(); err != nil {
		return Base{}, err
	}
	name := c.BaseName(img)
	setVolume(span, name)
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return Base{}, errClosed
	}
	f, ok := c.flights[name]
	if ok && f.abandoned {
		ok = false // its callers all left and it is being canceled: start afresh
	}
	if ok && f.img != img {
		c.mu.Unlock()
		return Base{}, errs.Errorf(errs.Permanent, "image %q: another Ensure of the same key with a different URL, digest or format is in flight", img.Key)
	}
	if !ok {
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.TransferBudget)
		stop := context.AfterFunc(c.stop, cancel)
		f = &flight{done: make(chan struct{}), cancel: cancel, img: img}
		c.flights[name] = f
		c.wg.Add(1)
		var arrived func()
		if fo := c.cfg.Fanout; fo != nil {
			// Until this flight reaches its GET, a download of the image
			// by another cache keeps byte 0 for it (JoinWindow).
			arrived = fo.expect(c.fanKey(img))
			fctx = context.WithValue(fctx, arrivalKey{}, arrived)
		}
		go func() {
			defer c.wg.Done()
			defer stop()
			defer cancel()
			if arrived != nil {
				defer arrived()
			}
			b, err := c.ensure(fctx, img, name)
			c.mu.Lock()
			f.base, f.err = b, err
			if c.flights[name] == f {
				delete(c.flights, name)
			}
			c.mu.Unlock()
			close(f.done)
		}()
	}
	f.waiters++
	c.mu.Unlock()

	select {
	case <-f.done:
		if code := errs.Code(f.err); ctx.Err() == nil && (code == errs.DeadlineExceeded || code == errs.Canceled) {
			// Our own budget ran out, or Close canceled the fetch; not
			// the caller's context.
			if c.stop.Err() != nil {
				return Base{}, errs.Errorf(errs.Transient, "image %q: the cache was closed during the fetch: %w", img.Key, f.err)
			}
			return Base{}, errs.Errorf(errs.Transient, "image %q: transfer budget %s exhausted: %w", img.Key, c.cfg.TransferBudget, f.err)
		}
		if f.err == nil {
			span.SetAttributes(attribute.String("imagecache.source", f.base.Source))
		}
		return f.base, f.err
	case <-ctx.Done():
		c.mu.Lock()
		f.waiters--
		if f.waiters == 0 {
			f.abandoned = true
			f.cancel()
		}
		c.mu.Unlock()
		return Base{}, errs.FromContext(ctx.Err())
	}
}

// ensure is the state machine of one image: decide from a pool snapshot,
// then hit, wait, claim, clean debris or fetch.
func (c *Cache) ensure(ctx context.Context, img imagecache.Image, name string) (Base, error) {
	log := c.log.WithValues("volume", name)
	for {
		d, vol, err := c.lookVol(ctx, img, name, "")
		if err != nil {
			return Base{}, err
		}
		switch d.Action {
		case actHit:
			return hit(c.published(ctx, img, name, d.Digest, vol))
		case actMismatch, actAmbiguous:
			return Base{}, c.conflict(img, name, d)
		case actWait:
			log.V(1).Info("another writer holds a claim; waiting", "claims", d.Others, "reason", d.Reason)
			if err := sleep(ctx, pollInterval); err != nil {
				return Base{}, errs.Errorf(errs.Transient, "base %s: another writer (%s) is still fetching it: %w", name, strings.Join(d.Others, ", "), err)
			}
			continue
		}
		// actAcquire: take a claim and decide again. The base will most
		// likely be fetched: its upload's connection is dialled and the
		// pool's free space read meanwhile (see startAhead), and the
		// Fanout knows this host is going cold for the image.
		a := c.startAhead(ctx)
		cold := c.goingCold(img)
		b, retry, err := c.underClaim(ctx, name, func(ctx context.Context, d decision) (Base, error) {
			switch d.Action {
			case actHit:
				return hit(c.published(ctx, img, name, d.Digest, nil))
			case actMismatch, actAmbiguous:
				return Base{}, c.conflict(img, name, d)
			}
			// actFetch
			if err := c.removeDebris(ctx, name, d); err != nil {
				return Base{}, err
			}
			a.stale = len(d.Remove) > 0 // space freed: the free space read ahead is too low
			return c.fetch(ctx, img, name, a)
		})
		cold()
		a.end()
		if retry {
			continue
		}
		return b, err
	}
}

// look lists the pool and decides. want comes from img (empty for a
// zero Image); ownToken is the token of the claim we hold ("" for none).
func (c *Cache) look(ctx context.Context, img imagecache.Image, name, ownToken string) (decision, error) {
	d, _, err := c.lookVol(ctx, img, name, ownToken)
	return d, err
}

// lookVol is look that also returns the listing's handle of volume name
// (nil when the pool has none), so that a hit reads the base's path
// without looking the pool and the volume up again (two round trips less
// on every Create of a cached image).
func (c *Cache) lookVol(ctx context.Context, img imagecache.Image, name, ownToken string) (decision, *libvirt.StorageVol, error) {
	vols, err := c.listVols(ctx)
	if err != nil {
		return decision{}, nil, err
	}
	d := decide(c.snapshot(volNames(vols), name, img.SHA256, ownToken))
	if d.Action != actFetch {
		for _, r := range d.Remove {
			c.log.V(1).Info("removing stale volume", "volume", r)
			c.deleteQuiet(ctx, r)
		}
	}
	for i := range vols {
		if vols[i].Name == name {
			return d, &vols[i], nil
		}
	}
	return d, nil, nil
}

// evictHint is the remedy texts give for a base that must go: the call
// that evicts it (egressproxy.Client.EvictImage, which kvm2 implements with
// Cache.Evict) and the CLI command over it.
const evictHint = "evict the base with EvictImage (egressproxyctl images evict)"

// conflict is the permanent error of a mismatching or ambiguous marker.
func (c *Cache) conflict(img imagecache.Image, name string, d decision) error {
	if d.Action == actAmbiguous {
		return errs.Errorf(errs.Permanent,
			"base %s in pool %s has several digest markers (%s); it is left untouched because running VMs may use it: delete the proxies using it, then "+evictHint+", or add the image under a new key",
			name, c.cfg.Pool, strings.Join(d.Digests, ", "))
	}
	return errs.Errorf(errs.Permanent,
		"base %s in pool %s has sha256 %s but image %q is configured with sha256 %s; it is left untouched because running VMs may use it: add the image under a new key, or delete the proxies using it, then "+evictHint,
		name, c.cfg.Pool, d.Digest, img.Key, img.SHA256)
}

// removeDebris deletes what decide found to be debris, while we hold the
// only claim. A base some domain still uses is never deleted.
func (c *Cache) removeDebris(ctx context.Context, name string, d decision) error {
	for _, r := range d.Remove {
		if r == name {
			u, err := c.usersOf(ctx, []string{name})
			if err != nil {
				return err
			}
			if ds := u.users[name]; len(ds) > 0 {
				return errs.Errorf(errs.Permanent, "base %s has no valid digest marker (%s) but domains %s use it; refusing to replace it: delete those domains or restore the marker", name, d.Reason, strings.Join(ds, ", "))
			}
			if err := u.refuseIfUsed(name, "replace"); err != nil {
				return err
			}
		}
		c.log.Info("removing debris", "volume", r, "reason", d.Reason)
		if err := c.deleteVolume(ctx, r); err != nil {
			return err
		}
	}
	return nil
}

// hit marks the Base of a hit as imagecache.SourcePool.
func hit(b Base, err error) (Base, error) {
	if err == nil {
		b.Source = imagecache.SourcePool
	}
	return b, err
}

// published returns the Base of a hit.
// vol, when not nil, is the volume's handle from the listing that found
// the hit; otherwise the volume is looked up. With metrics, the first hit
// on a base the cache found rather than published also reads its stored
// size (the base.usage gauge), in the same call.
func (c *Cache) published(ctx context.Context, img imagecache.Image, name, digest string, vol *libvirt.StorageVol) (Base, error) {
	var path string
	size := int64(-1)
	needSize := c.meters.needsSize(name)
	getPath := func(l Libvirt, v libvirt.StorageVol) error {
		var err error
		if path, err = l.StorageVolGetPath(v); err != nil || !needSize {
			return err
		}
		// Best effort: the gauge waits for the next chance.
		if _, _, phys, err := l.StorageVolGetInfoFlags(v, uint32(libvirt.StorageVolGetPhysical)); err == nil {
			size = int64(min(phys, math.MaxInt64))
		}
		return nil
	}
	var err error
	if vol != nil {
		v := *vol
		err = c.do(ctx, func(l Libvirt) error { return getPath(l, v) })
	} else {
		err = c.doVol(ctx, name, getPath)
	}
	if err != nil {
		return Base{}, c.classify(ctx, fmt.Errorf("look up base %s: %w", name, err))
	}
	if size >= 0 {
		c.meters.sized(name, size)
	}
	return Base{Volume: name, Path: path, Digest: digest, Format: formatOf(img)}, nil
}

// Close cancels in-flight fetches and waits for them (bounded). Later calls
// return a Permanent error wrapping errs.ErrClosed.
func (c *Cache) Close() error {
	c.mu.Lock()
	c.closed = true
	c.mu.Unlock()
	if c.cfg.Fanout != nil {
		c.cfg.Fanout.unregister(c)
	}
	c.meters.close()
	c.cancel()
	done := make(chan struct{})
	go func() { c.wg.Wait(); close(done) }()
	t := time.NewTimer(closeWait)
	defer t.Stop()
	if c.transport != nil {
		// Keep-alive connections to the mirror, and their goroutines,
		// end with the cache, not up to 90 s later.
		defer c.transport.CloseIdleConnections()
	}
	select {
	case <-done:
		return nil
	case <-t.C:
		return errs.Errorf(errs.Transient, "imagecache: in-flight fetches did not end within %s", closeWait)
	}
}

func (c *Cache) checkOpen() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return errClosed
	}
	return nil
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// start starts the span name of this cache with the entry and, when not
// empty, the volume (see docs/observability.md).
func (c *Cache) start(ctx context.Context, name, volume string, extra ...attribute.KeyValue) (context.Context, trace.Span) {
	return obs.Start(ctx, c.tracer, name, obs.Attrs{Entry: c.cfg.Entry, Volume: volume}, extra...)
}

// endOp ends the span of a public operation with err's text redacted
// (rawURL's secrets and any URL's userinfo removed), without changing err:
// every caller waiting for one fetch returns the same error.
func endOp(span trace.Span, err error, rawURL string) {
	obs.End(span, redact.View(err, rawURL))
}

// setVolume adds the volume attribute once an operation knows it.
func setVolume(span trace.Span, volume string) {
	span.SetAttributes(obs.Attrs{Volume: volume}.KeyValues()...)
}
