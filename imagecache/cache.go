// Package imagecache keeps verified base images in a libvirt storage pool,
// one per (provider entry, image key, format), for overlays to be backed by.
//
// It owns: the volume naming (see BaseName), downloading an image over HTTP
// straight into a volume in constant memory, verifying what libvirt actually
// stored before publishing it, the digest markers, the claims that keep two
// writers (two processes, e.g. during a leader handover) from touching one
// base at once, single-flight inside one process, eviction that refuses while
// a domain uses the base, List and Verify.
//
// It does not own the libvirt connection (Conn; SSH adapts
// *sshconn.Libvirt), the overlays and domains that use a base (kvm2 does),
// or retries: every error is classed with the provider error codes and the
// caller decides.
//
// Spans (imagecache.Ensure, Fetch, Upload, Verify, Evict, List) and their
// attributes are listed in docs/observability.md.
//
// # Publish protocol
//
// A base "base-<entry>--<key>.<format>" is usable only together with exactly
// one marker "<base>.sha256-<digest>" (a 0-byte volume whose name carries the
// digest, so creating it is atomic). The marker is created last, after the
// stored bytes were read back and hashed.
//
// Whoever creates, fills or deletes a base first holds a claim: it creates a
// uniquely named 0-byte claim volume "claim-<entry>--<key>.<format>.<ns>.<hex>",
// then lists the pool; if any other fresh claim exists it drops its own and
// retries after a random pause (create-then-look, so two writers can never
// both proceed). The claim's name carries a token (this cache's instance and
// the claim's own) and the time it was last refreshed: its holder refreshes
// it every ClaimTimeout/4 (a new claim volume with the same token, then the
// old one deleted) and gives its work up when it could not refresh for
// ClaimTimeout/2. A claim whose newest volume is older than ClaimTimeout is
// stale: its writer is gone, and anyone may delete it. A claim of this
// cache's instance that it no longer holds (its cleanup failed) is reclaimed
// at once. Claims of writers that do not refresh them are stale after twice
// the transfer budget. Every cache that shares a pool must use the same
// ClaimTimeout (order of magnitude) and roughly synchronised clocks. Readers use only base + marker; a base without a marker is debris
// only when nobody holds a fresh claim, so a volume another live writer is
// still filling is never deleted.
//
// # Overlapped verification
//
// A cold fetch uploads the image in segments of 32 MiB, one StorageVolUpload
// at the segment's offset each, on one dedicated connection; a second
// dedicated connection reads back every segment whose upload stream has
// finished (StorageVolDownload with offset and length) while the next one is
// uploaded, and hashes the bytes in order. (An image of one segment has
// nothing to read back while it uploads: its read-back takes the upload's
// connection over once the upload is over, rather than dialling one.) On a link the read-back's bytes
// flow the other way, so the fetch takes about one transfer plus the
// read-back of the last segment instead of upload plus read-back. What
// decides is unchanged: the sha256 of the bytes read back from the host's
// volume, the volume's physical size, and the drain before each segment's
// end. libvirt allows it (a download refuses only a volume being built; an
// upload refuses a volume being set up for another stream, only during that
// setup, so a read-back starts once the next upload streams, and an upload
// refused so before its first byte is tried again; an upload at an offset
// neither truncates nor syncs, and its stream is confirmed only after its
// writer wrote every byte and closed the file): see
// docs/overlapped-verification.md for the sources and the measurements.
//
// # Round trips
//
// On a link with real round-trip time every call is a round trip, so a cold
// fetch overlaps what does not depend on each other: once a look at the
// pool says the base must be fetched, the upload's connection is dialled
// (its SSH and libvirt handshakes) and the pool's free space read while the
// claim is taken; every call on the new base uses the handle its creation
// answered (libvirtd resolves a volume handle by pool and volume name, on
// any connection), so nothing is looked up; the volume's size is asked for
// while the last range is read back, and the base's path while the marker
// is created. Nothing moves across the protocol's order: the marker is
// still created after the checks, and the claim released after the marker.
//
// # Fan-out across hosts
//
// Caches (one per entry, i.e. per host) given the same Config.Fanout —
// ProcessFanout() for the whole process, which is what kvm2 gives every
// provider unless Options.NoImageFanout is set — share the HTTP download
// of an image (same URL, same configured SHA256, same HTTP client) among
// their concurrent cold fetches, and a cache going cold later copies a
// base another one has published instead of downloading it. Without a
// Fanout (imagecache's zero Config) every fetch downloads on its own.
// Only bytes are shared: every host uploads, reads back, hashes, checks
// the size of and marks its own base, so every promise above holds per
// host, and a digest mismatch fails each host Permanent on its own
// read-back.
//
// Shared download: a fetch joins a download of the image that still holds
// byte 0. The download keeps byte 0 for FanoutOptions.JoinWindow (1s) from
// its start: while another cache's Ensure of the image is under way and
// has not reached its GET, up to its whole window (waiting when it is
// full); otherwise only its first 2 MiB, never waiting, so a fetch alone
// never waits and holds at most those 2 MiB and the read-ahead (4 chunks,
// 1 MiB). The
// body streams through a bounded window (8 MiB in 256 KiB chunks) that
// each host reads at its own pace; memory is the window whatever the
// number of hosts. A host that keeps the window full (the others a window
// ahead of it) for DetachAfter (2s) is detached without an error: its next
// read continues on its own download (Range with If-Range from its offset,
// or a full GET skipping the bytes it has when the mirror announced no
// ranges or no validator). A host whose fetch ends leaves the download to
// the others; the last one to leave cancels it. The mirror failing
// mid-body fails every attached host Transient (nothing is published
// anywhere).
//
// Late joiners: for an image with a configured SHA256, a cold fetch that
// has no download to join asks the other caches of its Fanout (same HTTP
// client) whether their pools hold a base published with a marker of that
// digest, and copies one (StorageVolDownload from the peer's host,
// streamed into its own upload, then the usual read-back and marker). Any
// failure of the copy — the peer's link or host, its base gone, bytes that
// do not hash to the digest, no progress for 15 s — falls back to the
// mirror in the same fetch, so a peer's fault never fails a fetch nor
// makes it Permanent (see Fanout for the rules that pick a peer). The copy
// keeps no temporary file anywhere.
//
// Base.Source, the span attribute imagecache.source and the "source" key
// of the "published base" log line say where a base came from (pool,
// mirror, shared, detached, peer); imagecache.peer and the "peer" key name
// the peer's entry.
package imagecache

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
	"github.com/egressproxy/egressproxy/internal/obs"
	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// Image is one configured image.
type Image struct {
	// Key is the image key: same shape as egressproxy.Spec.ImageKey (1–63 of
	// a–z 0–9 . -, alphanumeric ends, no "--"). Required.
	Key string `json:"key,omitempty"`
	// URL is the http(s) URL of the image. Required. It may carry
	// credentials (userinfo, a signed query): they are sent, but never
	// printed — errors, logs, spans and String show RedactURL(URL), and
	// a marshalled Image (JSON, YAML) carries the redacted URL, so a
	// credentialed URL is set in code (from a Secret), not kept in a file.
	URL string `json:"url"`
	// SHA256 is the expected lowercase hex sha256 of the image file. Empty:
	// any digest is accepted and recorded.
	SHA256 string `json:"sha256,omitempty"`
	// Format is "qcow2" (zero value) or "raw". A qcow2 image must start
	// with the qcow2 magic ("QFI\xfb"): any other body (an error or
	// sign-in page served with 200, say) is refused, Permanent, before
	// anything is created in the pool. A raw image may hold any bytes.
	Format string `json:"format,omitempty"`
}

// MarshalJSON writes the image with its URL redacted when the URL carries
// a credential (userinfo or a credential query or fragment parameter, as
// RedactURL defines them; RedactURL's length bound does not apply). Any
// other URL is written as it is, so a file round-trips. A redacted URL
// fails Validate when decoded again, rather than fetching with a wrong
// credential.
func (img Image) MarshalJSON() ([]byte, error) {
	type plain Image // the fields and tags without the methods
	p := plain(img)
	if hasCredentials(img.URL) {
		p.URL = sanitize(redactURL(img.URL))
	}
	return json.Marshal(p)
}

// hasCredentials reports whether rawURL carries anything RedactURL would
// redact.
func hasCredentials(rawURL string) bool {
	u, err := url.Parse(rawURL)
	if err != nil || u.Opaque != "" {
		return redactLoose(rawURL) != rawURL
	}
	if u.User != nil {
		return true
	}
	q, f := u.RawQuery, u.EscapedFragment()
	return redactParams(q) != q || redactParams(f) != f
}

// redactedCredential reports whether rawURL carries a credential that is
// exactly RedactURL's mark: a URL taken from a marshalled config.
func redactedCredential(rawURL string) bool {
	u, err := url.Parse(rawURL)
	if err != nil || u.Opaque != "" {
		return false
	}
	if u.User != nil && (u.User.Username() == redactedMark || u.User.String() == redactedMark) {
		return true
	}
	for _, q := range []string{u.RawQuery, u.EscapedFragment()} {
		for _, p := range strings.FieldsFunc(q, func(r rune) bool { return r == '&' || r == ';' }) {
			if name, v, ok := strings.Cut(p, "="); ok && v == redactedMark && isCredentialParam(name) {
				return true
			}
		}
	}
	return false
}

func (img Image) format() string {
	if img.Format == "" {
		return FormatQCOW2
	}
	return img.Format
}

// Validate checks the image and returns the violations joined (each a
// *errs.FieldError), classed Permanent.
func (img Image) Validate() error {
	var problems []error
	if err := validKey(img.Key); err != nil {
		problems = append(problems, err)
	}
	if img.URL == "" {
		problems = append(problems, &errs.FieldError{Field: "URL", Rule: "is required"})
	} else if !strings.HasPrefix(img.URL, "http://") && !strings.HasPrefix(img.URL, "https://") {
		problems = append(problems, &errs.FieldError{Field: "URL", Value: RedactURL(img.URL), Rule: "must be an http:// or https:// URL"})
	} else if u, err := url.Parse(img.URL); err != nil {
		problems = append(problems, &errs.FieldError{Field: "URL", Value: RedactURL(img.URL), Rule: "must parse as a URL: " + parseProblem(err)})
	} else if u.Host == "" {
		problems = append(problems, &errs.FieldError{Field: "URL", Value: RedactURL(img.URL), Rule: "must name a host"})
	} else if redactedCredential(img.URL) {
		problems = append(problems, &errs.FieldError{Field: "URL", Value: RedactURL(img.URL), Rule: "carries a credential redacted by marshalling; set the URL with its credential in code (e.g. from a Secret)"})
	}
	if img.SHA256 != "" && !validDigest(img.SHA256) {
		problems = append(problems, &errs.FieldError{Field: "SHA256", Value: img.SHA256, Rule: "must be 64 lowercase hex digits"})
	}
	if !validFormat(img.format()) {
		problems = append(problems, &errs.FieldError{Field: "Format", Value: img.Format, Rule: `must be "qcow2" or "raw"`})
	}
	if len(problems) > 0 {
		return errs.WithCode(errs.Permanent, errors.Join(problems...))
	}
	return nil
}

// Config configures a Cache.
type Config struct {
	// Entry is the provider entry name (naming.ValidateName rules).
	// Required.
	Entry string `json:"entry"`
	// Pool is the libvirt storage pool holding the bases. Required.
	Pool string `json:"pool"`
	// TransferBudget bounds one cold fetch (HTTP + upload + verify +
	// publish). Zero: 20m. A claim older than twice this is stale.
	TransferBudget time.Duration `json:"transferBudget,omitempty"`
	// HTTPGrace: the HTTP download's deadline is HTTPGrace before the end
	// of the fetch's TransferBudget (one clock: the budget counts from the
	// start of the fetch, so time spent waiting for another writer's claim
	// comes off the download, not off the grace), so a stalled mirror ends
	// as a clean error before the budget would have to cut the libvirt
	// link. Zero: 1m, or TransferBudget/4 when that is shorter. Must be <
	// TransferBudget.
	HTTPGrace time.Duration `json:"httpGrace,omitempty"`
	// HTTPClient fetches images. Zero: a client of the cache's own with no
	// overall timeout (the deadline comes from the budget), whose idle
	// connections Close closes (a caller's client, or the one a Fanout
	// shares, is left as it is). A collaborator, not data: never
	// marshalled (nor are Progress, Logger and TracerProvider).
	HTTPClient *http.Client `json:"-"`
	// Progress, when set, is called with the transfer progress at most
	// every ProgressInterval (and once at the end of the upload), from the
	// goroutine that feeds the upload: it must not block for long.
	Progress func(Progress) `json:"-"`
	// ProgressInterval is the progress callback and log interval. Zero: 5s.
	ProgressInterval time.Duration `json:"progressInterval,omitempty"`
	// ClaimTimeout: a claim (see the package doc) whose holder has not
	// refreshed it for this long is stale and may be taken over; the
	// holder refreshes it every ClaimTimeout/4 and gives its work up when
	// it could not refresh for ClaimTimeout/2, so a claim is never taken
	// over while its holder works. Every cache sharing a pool should use
	// the same value. Zero: 2m.
	ClaimTimeout time.Duration `json:"claimTimeout,omitempty"`
	// StreamStall is the no-progress timeout of every libvirt stream (the
	// upload and the read-back): no byte moved for this long, from the
	// start of the stream or since the last chunk, means the stream hangs.
	// Its dedicated connection is then discarded and the stream retried
	// once on a fresh one (the upload with a new download of the image).
	// Zero: 1m.
	StreamStall time.Duration `json:"streamStall,omitempty"`
	// Logger receives progress and decision lines. Zero value: discard.
	Logger logr.Logger `json:"-"`
	// TracerProvider makes the fetch/upload/verify spans. Zero: no spans.
	TracerProvider trace.TracerProvider `json:"-"`
	// Fanout, when set, shares the HTTP download of an image among the
	// concurrent cold fetches of every cache given the same Fanout (one
	// per entry, i.e. per host: see Fanout and ProcessFanout), and lets a
	// cache going cold later copy a base another of them published; each
	// host's upload, read-back digest, size check and marker stay its
	// own. A cache with a Fanout and no HTTPClient uses one client shared
	// by all such caches (downloads and copies are shared per client).
	// The cache joins the Fanout in New and leaves it in Close. Nil:
	// every fetch downloads on its own.
	Fanout *Fanout `json:"-"`
}

// Progress reports a transfer.
type Progress struct {
	Volume string
	Bytes  int64   // bytes sent so far
	Total  int64   // Content-Length, -1 when unknown
	Rate   float64 // bytes/s since the transfer started
}

// Base is a published, verified base image.
type Base struct {
	Volume string // volume name
	Path   string // volume path on the host
	Digest string // sha256 hex of the stored bytes
	Format string // "qcow2" or "raw"
	// Source is where Ensure got the base from: SourcePool (already
	// published), SourceMirror (downloaded by this fetch), SourceShared
	// (a download shared through Config.Fanout), SourceDetached (shared,
	// then finished on its own download), SourcePeer (copied from a base
	// another cache of the Fanout had published). Empty from List and
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

	// pool is the pool's handle (name and UUID) once looked up, so that
	// each call on the pool does not pay a lookup's round trip first (a
	// cold fetch made 13 of them). See poolOn.
	poolMu  sync.Mutex
	pool    libvirt.StoragePool
	poolSet bool

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
	img     Image
	// abandoned: every caller left; the fetch is being canceled.
	abandoned bool
}

// New validates cfg (errors name the field, classed Permanent) and returns
// a Cache. It does no I/O.
func New(conn Conn, cfg Config) (*Cache, error) {
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
	if cfg.TransferBudget == 0 {
		cfg.TransferBudget = defaultBudget
	}
	if cfg.HTTPGrace == 0 {
		cfg.HTTPGrace = min(defaultGrace, cfg.TransferBudget/4)
	}
	if cfg.HTTPGrace >= cfg.TransferBudget {
		problems = append(problems, &errs.FieldError{Field: "HTTPGrace", Value: cfg.HTTPGrace.String(), Rule: fmt.Sprintf("must be shorter than TransferBudget (%s)", cfg.TransferBudget)})
	}
	if len(problems) > 0 {
		return nil, errs.WithCode(errs.Permanent, errors.Join(problems...))
	}
	if cfg.StreamStall == 0 {
		cfg.StreamStall = defaultStreamStall
	}
	if cfg.ClaimTimeout == 0 {
		cfg.ClaimTimeout = defaultClaimTimeout
	}
	if cfg.ProgressInterval == 0 {
		cfg.ProgressInterval = defaultInterval
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
		conn:      conn,
		cfg:       cfg,
		log:       log.WithName("imagecache").WithValues("entry", cfg.Entry, "pool", cfg.Pool),
		tracer:    tp.Tracer("github.com/egressproxy/egressproxy/imagecache"),
		flights:   map[string]*flight{},
		instance:  randHex(instanceBytes),
		live:      map[string]bool{},
		stop:      stop,
		cancel:    cancel,
		segment:   segmentSize,
		transport: transport,
	}
	if cfg.Fanout != nil {
		cfg.Fanout.register(c)
	}
	return c, nil
}

// BaseName returns the volume name of img's base in this cache.
func (c *Cache) BaseName(img Image) string { return BaseName(c.cfg.Entry, img.Key, img.format()) }

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
func (c *Cache) Ensure(ctx context.Context, img Image) (_ Base, opErr error) {
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
func (c *Cache) ensure(ctx context.Context, img Image, name string) (Base, error) {
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
		// pool's free space read meanwhile (see startAhead).
		a := c.startAhead(ctx)
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
		a.end()
		if retry {
			continue
		}
		return b, err
	}
}

// look lists the pool and decides. want comes from img (empty for a
// zero Image); ownToken is the token of the claim we hold ("" for none).
func (c *Cache) look(ctx context.Context, img Image, name, ownToken string) (decision, error) {
	d, _, err := c.lookVol(ctx, img, name, ownToken)
	return d, err
}

// lookVol is look that also returns the listing's handle of volume name
// (nil when the pool has none), so that a hit reads the base's path
// without looking the pool and the volume up again (two round trips less
// on every Create of a cached image).
func (c *Cache) lookVol(ctx context.Context, img Image, name, ownToken string) (decision, *libvirt.StorageVol, error) {
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
func (c *Cache) conflict(img Image, name string, d decision) error {
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

// hit marks the Base of a hit as SourcePool.
func hit(b Base, err error) (Base, error) {
	if err == nil {
		b.Source = SourcePool
	}
	return b, err
}

// published returns the Base of a hit.
// vol, when not nil, is the volume's handle from the listing that found
// the hit; otherwise the volume is looked up.
func (c *Cache) published(ctx context.Context, img Image, name, digest string, vol *libvirt.StorageVol) (Base, error) {
	var path string
	getPath := func(l Libvirt, v libvirt.StorageVol) error {
		var err error
		path, err = l.StorageVolGetPath(v)
		return err
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
	return Base{Volume: name, Path: path, Digest: digest, Format: img.format()}, nil
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

var timeNow = time.Now

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
	if err != nil {
		msg := err.Error()
		if safe := clip(redactText(msg, rawURL), maxErrText); safe != msg {
			err = &redactedError{msg: safe, err: err}
		}
	}
	obs.End(span, err)
}

// setVolume adds the volume attribute once an operation knows it.
func setVolume(span trace.Span, volume string) {
	span.SetAttributes(obs.Attrs{Volume: volume}.KeyValues()...)
}
