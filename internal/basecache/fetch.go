package basecache

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/obs"
	"github.com/egressproxy/egressproxy/internal/redact"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

// fetch downloads img into a new volume named name, verifies what libvirt
// stored and publishes it with its marker. The caller holds the only claim
// and has removed any previous base. On any failure the volume is deleted
// (after the transfer connection is closed) and nothing is published.
//
// a, when not nil, is what was started ahead (see startAhead): the first
// attempt uses it.
func (c *Cache) fetch(ctx context.Context, img imagecache.Image, name string, a *ahead) (b Base, err error) {
	start := time.Now()
	ctx, span := c.start(ctx, "imagecache.Fetch", name, attribute.String("url.full", redact.URL(img.URL)))
	defer func() {
		// fetchOnce builds its errors from redacted parts; this is the
		// net for any text that embeds the URL nonetheless.
		err = redact.Err(err, img.URL)
		endSpan(span, err)
		c.meters.fetched(time.Since(start), b, err)
	}()
	peers, local := c.findPeers(ctx, img)
	if local != nil && formatOf(img) == imagecache.FormatRaw {
		// A published base of the digest on this very host: copied
		// inside it, never over the network.
		span.SetAttributes(attribute.String("imagecache.peer", local.c.cfg.Entry))
		b, err = c.cloneLocal(ctx, img, name, local)
		if err == nil {
			span.SetAttributes(attribute.String("imagecache.source", b.Source))
		}
		if err == nil || ctx.Err() != nil {
			return b, err
		}
		c.log.Info("copying the base inside the host failed; fetching it over the network", "volume", name, "peer", local.c.cfg.Entry, "err", redact.Text(err.Error(), img.URL))
	}
	b, from, err := c.fetchOnce(ctx, img, name, a, sourcing{peers: peers})
	switch {
	case err == nil || ctx.Err() != nil:
	case from != nil && from.triedPeer():
		// Whatever went wrong with bytes a peer fed (the peer's bytes
		// not hashing to the digest, a stream cut while no other source
		// was left, …): the peers that fed it are not candidates for a
		// while, and the mirror alone, once more.
		from.peerFault()
		c.log.Info("a fetch a peer fed failed; fetching from the mirror alone", "volume", name, "err", redact.Text(err.Error(), img.URL))
		b, _, err = c.fetchOnce(ctx, img, name, nil, sourcing{mirrorOnly: true})
	case errors.Is(err, errStalled):
		// The stream hung (its connection is discarded and the staged
		// volume deleted by now): once more, on fresh connections.
		c.log.Info("a libvirt stream made no progress; fetching once more on a fresh connection", "volume", name, "err", err.Error())
		b, _, err = c.fetchOnce(ctx, img, name, nil, sourcing{mirrorOnly: true})
	}
	return b, err
}

// fetchOnce is one attempt of fetch: the GET (with a Fanout, through a
// shared download that may read the peers of how) and its checks (open,
// admit), a staged volume (newStage), the upload with the read-back
// beside it (stage.write) and the commit that checks what the host stored
// and creates the marker (stage.commit). from says where its bytes came
// from (nil when the GET failed).
//
// The calls that do not depend on each other overlap: the upload's
// connection is dialled and the free space read ahead (see startAhead,
// when a is not nil), the base's handle from its creation is used for
// every later call on it (no lookups, see doHandle), its physical size is
// asked for while the last range is read back, the read-back's connection
// closes while the marker is created, and the base's path is read
// together with the marker's creation.
func (c *Cache) fetchOnce(ctx context.Context, img imagecache.Image, name string, a *ahead, how sourcing) (_ Base, from origin, err error) {
	in, err := c.open(ctx, img, name, how)
	if err != nil {
		return Base{}, nil, err
	}
	defer c.closeIngest(in)
	avail, err := c.admit(ctx, in, a)
	if err != nil {
		return Base{}, in.from, err
	}
	st, err := c.newStage(ctx, name, in.log)
	if err != nil {
		return Base{}, in.from, err
	}
	defer func() { st.close(ctx, err) }()
	in.log.Info("fetching image", "bytes", in.total)
	n, digest, err := st.write(ctx, in, avail, a.dialed())
	if err != nil {
		return Base{}, in.from, err
	}
	pathOf, err := st.commit(ctx, n, digest)
	if err != nil {
		return Base{}, in.from, err
	}
	src := in.from.source()
	span := trace.SpanFromContext(ctx)
	span.SetAttributes(attribute.String("imagecache.source", src))
	if p := in.from.peer(); p != "" {
		span.SetAttributes(attribute.String("imagecache.peer", p))
	}
	c.notePublished(in, st, n, digest, src)
	path, err := pathOf()
	if err != nil {
		return Base{}, in.from, c.classify(ctx, fmt.Errorf("look up base %s: %w", name, err))
	}
	return Base{Volume: name, Path: path, Digest: digest, Format: formatOf(img), Source: src}, in.from, nil
}

// get is the GET of the image: HTTPClient.Do(req) without a Fanout, else
// through it (a shared download of the mirror or of one of how's peers,
// with other caches' fetches of the same image). The origin says, once
// the body was read, where it came from.
func (c *Cache) get(req *http.Request, img imagecache.Image, how sourcing) (*http.Response, origin, error) {
	if c.cfg.Fanout == nil {
		resp, err := c.cfg.HTTPClient.Do(req)
		return resp, mirrorOrigin{}, err
	}
	resp, body, err := c.cfg.Fanout.get(c, c.fanKey(img), req, how.peers, how.mirrorOnly)
	if err != nil {
		return nil, nil, err
	}
	return resp, body, nil
}

// permanentGET reports why a failed GET cannot succeed when retried: the
// server's TLS certificate is not trusted (unknown authority, another host
// name, expired or otherwise invalid), the redirects loop (net/http gives
// up after 10), or a redirect leads to a scheme net/http does not speak.
func permanentGET(err error) (string, bool) {
	var cv *tls.CertificateVerificationError
	var ua x509.UnknownAuthorityError
	var hn x509.HostnameError
	var ci x509.CertificateInvalidError
	var ue *url.Error
	switch {
	case errors.As(err, &cv), errors.As(err, &ua), errors.As(err, &hn), errors.As(err, &ci):
		return "the server's TLS certificate is not trusted; fix the server's certificate or give Config.HTTPClient a transport that trusts its CA", true
	case errors.As(err, &ue) && ue.Err != nil:
		msg := ue.Err.Error()
		if strings.HasPrefix(msg, "stopped after ") && strings.HasSuffix(msg, " redirects") {
			return "the server redirects in a loop; fix the URL or the server", true
		}
		if strings.HasPrefix(msg, "unsupported protocol scheme") {
			return "a redirect leads to a URL that is not http(s); fix the URL or the server", true
		}
	}
	return "", false
}

const (
	// sniffLen is how many first bytes of the body are checked against
	// the image's format before anything is created in the pool (and
	// shown, escaped, when they do not match).
	sniffLen = 32
	// qcow2Magic starts every qcow2 image.
	qcow2Magic = "QFI\xfb"
)

// sniff checks the first bytes of the body against img's format before
// anything is created in the pool, so that an error or sign-in page served
// with 200 is never uploaded, let alone published: a qcow2 must start with
// the qcow2 magic; a raw image (declared Format "raw") may hold anything.
// A mismatch is Permanent, naming the image, the format and what the body
// starts with. It returns the body to upload, the bytes looked at
// included; what is stored is still proven by the read-back digest.
func (c *Cache) sniff(ctx context.Context, img imagecache.Image, resp *http.Response, u string) (io.ReadCloser, error) {
	br := bufio.NewReaderSize(resp.Body, 64<<10)
	head, err := br.Peek(sniffLen)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, c.classify(ctx, fmt.Errorf("image %q: GET %s: reading the first bytes: %w", img.Key, u, redact.Err(err, img.URL)))
	}
	if len(head) == 0 {
		return nil, errs.Errorf(errs.Transient, "image %q: %s served an empty body", img.Key, u)
	}
	if formatOf(img) == imagecache.FormatQCOW2 && !bytes.HasPrefix(head, []byte(qcow2Magic)) {
		ct := "none"
		if v := resp.Header.Get("Content-Type"); v != "" {
			ct = fmt.Sprintf("%q", serverText(v, img.URL))
		}
		return nil, errs.Errorf(errs.Permanent,
			"image %q from %s is not a qcow2 image: the body starts with %s (Content-Type %s), a qcow2 image with %q; fix the URL (an error or sign-in page?) or, for a raw disk image, declare Format \"raw\"",
			img.Key, u, showBytes(head, img.URL), ct, qcow2Magic)
	}
	return struct {
		io.Reader
		io.Closer
	}{br, resp.Body}, nil
}

// showBytes prints the first bytes of a body for an error: quoted (valid
// UTF-8, every control or invalid byte escaped), the secrets of rawURL
// removed, "…" after them when the body goes on.
func showBytes(head []byte, rawURL string) string {
	s := string(head)
	for _, sec := range redact.Secrets(rawURL) {
		s = strings.ReplaceAll(s, sec, redact.Mark)
	}
	q := fmt.Sprintf("%q", s)
	if len(head) >= sniffLen {
		q += "…"
	}
	return q
}

// httpDeadline is the deadline of the HTTP download: the flight's own
// deadline (ctx carries the TransferBudget, counted from the start of the
// flight) minus HTTPGrace, so time spent before the GET — waiting for
// another writer's claim, removing debris, a first attempt whose stream
// stalled — comes off the download, never off the grace left for upload,
// verification and publishing. One clock: the flight's. Without a deadline
// on ctx (fetch called outside a flight) the budget starts now. When less
// than HTTPGrace is left, nothing should be downloaded at all.
func (c *Cache) httpDeadline(ctx context.Context) (time.Time, error) {
	end, ok := ctx.Deadline()
	if !ok {
		end = time.Now().Add(c.cfg.TransferBudget)
	}
	d := end.Add(-c.cfg.HTTPGrace)
	if left := time.Until(end); !d.After(time.Now()) {
		return time.Time{}, fmt.Errorf("only %s of the transfer budget %s is left, not more than HTTPGrace %s; not downloading (retry)", left.Round(time.Millisecond), c.cfg.TransferBudget, c.cfg.HTTPGrace)
	}
	return d, nil
}

// judgeStored checks, once n bytes with sha256 digest were uploaded, that
// the volume's physical size on the host is n (first: a short file says
// more than a failed read of it), then that the read-back succeeded and
// found the same bytes.
//
// physical answers the volume's size (physicalAhead).
func (c *Cache) judgeStored(ctx context.Context, name string, n int64, digest string, physical func() (uint64, error), back readResult) error {
	phys, err := physical()
	if err != nil {
		return c.classify(ctx, fmt.Errorf("verify %s: %w", name, err))
	}
	if phys != uint64(n) {
		c.meters.verifyFailed(checkStored, "")
		return errs.Errorf(errs.Transient, "verify %s: the volume holds %d bytes on the host but %d were sent (upload lost data; disk full?)", name, phys, n)
	}
	if back.err != nil {
		return back.err
	}
	if back.n != n || back.digest != digest {
		c.meters.verifyFailed(checkStored, "")
		return errs.Errorf(errs.Transient, "verify %s: the host stores %d bytes with sha256 %s but %d bytes with sha256 %s were sent", name, back.n, back.digest, n, digest)
	}
	return nil
}

// poolAvailable refreshes the pool (best effort) and returns its free bytes.
func (c *Cache) poolAvailable(ctx context.Context) (uint64, error) {
	var avail uint64
	err := c.doPool(ctx, func(l Libvirt, p libvirt.StoragePool) error {
		if err := l.StoragePoolRefresh(p, 0); err != nil {
			c.log.V(1).Info("pool refresh failed; using the last known free space", "err", err.Error())
		}
		var err error
		_, _, _, avail, err = l.StoragePoolGetInfo(p)
		return err
	})
	if err != nil {
		return 0, c.classify(ctx, fmt.Errorf("free space of pool %s: %w", c.cfg.Pool, err))
	}
	return avail, nil
}

// upload streams body into volume name on a dedicated connection, counting
// and hashing on the way, one segment (c.segment bytes, StorageVolUpload at
// its offset) per stream call; each segment's end is committed to w for
// the read-back once the next stream has been set up. The connection is
// ahead's when not nil (dialled ahead, see dialAhead), else opened now;
// it is killed at once if ctx ends, closed before upload returns an
// error, and returned open after a successful upload, for the caller to
// offer to the read-back (see committed) or close. vol is the volume's
// handle (nil: looked up on the connection, see doHandle).
//
// Two guards keep libvirt from losing bytes silently (the libvirt session's stream
// guard keeps go-libvirt's router from deadlocking on the packets libvirtd
// sends after a failed stream): the source never announces the end of a
// segment before libvirt has written every byte of it (the volume's size
// on the host is polled until it matches; a size that stops short is an
// error the source reports itself), and bytes beyond the pool's free space
// are refused by the source before libvirt runs out of disk. If a call
// still makes no progress for Config.StreamStall, its connection is killed
// and the error wraps errStalled (fetch then tries once more); see
// runStream. A segment libvirt refuses as in use before its first byte
// (a read-back being set up) is tried again. t, when not nil, counts the
// bytes sent by source at each progress report and at the end.
func (c *Cache) upload(ctx context.Context, name string, vol *libvirt.StorageVol, ahead *dialing, body io.ReadCloser, total int64, free uint64, w *committed, t *tally) (n int64, digest string, dc Dedicated, err error) {
	ctx, span := c.start(ctx, "imagecache.Upload", name)
	defer func() {
		span.SetAttributes(attribute.Int64("imagecache.upload.bytes", n))
		endSpan(span, err)
	}()
	conn, err := c.dedicated(ctx, ahead)
	if err != nil {
		return 0, "", nil, c.classify(ctx, fmt.Errorf("upload %s: dedicated connection: %w", name, err))
	}
	defer func() {
		if err != nil {
			_ = conn.Close()
		}
	}()
	now := time.Now()
	src := &segments{r: body, w: w}
	m := &meter{r: src, h: sha256.New(), total: total, start: now, last: now, c: c, volume: name, free: free, stall: c.cfg.StreamStall, tally: t}
	// The drain must stop as soon as the call returned (e.g. with libvirt's
	// error), or upload would wait for the Read holding m.mu.
	dctx, stopDrain := context.WithCancel(ctx)
	defer stopDrain()
	m.drain = func() error {
		err := c.drained(dctx, name, vol, m.n)
		if err != nil && dctx.Err() != nil && ctx.Err() == nil {
			return errDrainStopped
		}
		return err
	}
	err = c.uploadSegments(ctx, conn, name, vol, src, m, total)
	stopDrain()
	_ = body.Close() // unblocks a Read of an abandoned call
	m.mu.Lock()
	defer m.mu.Unlock()
	m.report(true)
	if err := uploadCause(name, m.n, m.fail, err); err != nil {
		return m.n, "", nil, c.classify(ctx, err)
	}
	return m.n, hex.EncodeToString(m.h.Sum(nil)), conn, nil
}

// uploadSegments uploads src one segment per StorageVolUpload, at the
// segment's offset, until the body ends, the meter failed or a call did;
// each segment's end is committed for the read-back once the next
// segment's stream has been set up (segments). A segment libvirt refuses
// as in use before its first byte is tried again (againInUse). vol is the
// volume's handle (nil: looked up on dc once).
func (c *Cache) uploadSegments(ctx context.Context, dc Dedicated, name string, vol *libvirt.StorageVol, src *segments, m *meter, total int64) error {
	var handle libvirt.StorageVol
	looked := vol != nil
	if looked {
		handle = *vol
	}
	lookup := func(l Libvirt) (libvirt.StorageVol, error) {
		if !looked {
			v, err := c.lookupVol(l, name)
			if err != nil {
				return v, err
			}
			handle, looked = v, true
		}
		return handle, nil
	}
	for retries := 0; ; {
		off, err := c.uploadSegment(ctx, dc, name, src, m, lookup)
		m.mu.Lock()
		read, eof, failed := src.read, src.eof, m.fail.err != nil
		end := m.n
		m.mu.Unlock()
		if err != nil && !failed && read == 0 && inUse(err) {
			if c.againInUse(ctx, &retries, name, off, err) {
				continue
			}
			// Another stream kept the volume busy: a later fetch may
			// succeed (libvirt's table calls the refusal Permanent).
			err = errs.WithCode(errs.Transient, err)
		}
		if err != nil || failed || eof || (total > 0 && end >= total) {
			return err
		}
		retries = 0
		m.mu.Lock()
		src.pending = end
		m.mu.Unlock()
	}
}

// uploadSegment streams the next segment of src, from the meter's count
// on, in one StorageVolUpload at that offset on dc, and returns the
// offset. handle gives the volume's handle on dc's session.
func (c *Cache) uploadSegment(ctx context.Context, dc Dedicated, name string, src *segments, m *meter, handle func(Libvirt) (libvirt.StorageVol, error)) (int64, error) {
	m.mu.Lock()
	off := m.n
	src.left, src.read = c.segment, 0
	m.mu.Unlock()
	m.callDone.Store(false)
	m.touch()
	err := c.runStream(ctx, dc, "upload "+name, m.stalled, func() error {
		defer m.callDone.Store(true)
		v, err := handle(dc.Libvirt())
		if err != nil {
			return err
		}
		return dc.Libvirt().StorageVolUpload(v, m, uint64(off), 0, 0)
	})
	m.callDone.Store(true) // also when runStream gave up on the call
	return off, err
}

// againInUse reports whether a segment libvirt refused as in use (err)
// before its first byte is to be tried again: up to inUseRetries times
// in a row, after a pause that grows with each.
func (c *Cache) againInUse(ctx context.Context, retries *int, name string, off int64, err error) bool {
	if *retries >= inUseRetries || ctx.Err() != nil {
		return false
	}
	*retries++
	c.log.V(1).Info("libvirt refused an upload segment as in use; trying again", "volume", name, "bytes", off, "err", err.Error())
	return sleep(ctx, time.Duration(*retries)*5*time.Millisecond) == nil
}

// Where the meter's first error came from.
const (
	fromSource  = iota + 1 // reading the HTTP body
	fromLibvirt            // the drain: asking libvirt what it has written
	fromGuard              // our own refusal (more bytes than the pool has free)
)

// meterFailure is the meter's first error and where it came from.
type meterFailure struct {
	err  error
	from int
	// late: recorded after the upload call had returned, so it is a
	// consequence of the call's end (upload closes the body to unblock
	// the call's last Read), not its cause.
	late bool
}

// uploadCause says why an upload failed, or nil when it did not: the
// failure of the side that failed first. A libvirt failure (the call's
// error, or the drain's question to libvirt failing) is never reported as
// a failure reading the image: the call's error wins over a body error
// that only followed it, and a drain that was stopped because the call
// failed leaves the call's error.
func uploadCause(name string, n int64, f meterFailure, callErr error) error {
	switch {
	case f.err == nil || (f.late && callErr != nil) || (callErr != nil && errors.Is(f.err, errDrainStopped)):
		if callErr != nil {
			return fmt.Errorf("upload %s after %d bytes: %w", name, n, callErr)
		}
		return nil
	case f.from == fromLibvirt:
		return fmt.Errorf("upload %s after %d bytes: libvirt failed: %w", name, n, f.err)
	case f.from == fromGuard:
		return fmt.Errorf("upload %s after %d bytes: %w", name, n, f.err)
	}
	return fmt.Errorf("upload %s: reading the image after %d bytes: %w", name, n, f.err)
}

// Stream guard timings.
const (
	// streamWait bounds how long runStream waits for a stream call to
	// return once its link was killed. Killing the link always ends the
	// call (the libvirt session's stream guard keeps go-libvirt's router from
	// deadlocking), so this is a bound for logs, not an expected wait; the
	// goroutine is owned by the cache either way and Close waits for it.
	streamWait = 10 * time.Second
	// drainPoll: how often the volume size is polled before the end of
	// the source is announced.
	drainPoll = 20 * time.Millisecond
	// drainStall is Cache.drainStall's value: a volume size that stays
	// short of the bytes sent for this long means libvirt failed to write
	// them (e.g. disk full; its error would only surface, or be lost,
	// when the stream is finished).
	drainStall = 10 * time.Second
)

var (
	// errStalled is the cause when a stream makes no progress.
	errStalled = errors.New("libvirt stream made no progress")
	// errDrainStopped: the upload call returned while the source waited
	// for libvirt to catch up.
	errDrainStopped = errors.New("upload ended while waiting for libvirt to write")
)

// runStream runs a stream call of dc in a goroutine owned by the cache and
// waits for it. When ctx ends or stalled reports true (no progress for
// Config.StreamStall, first byte included), the dedicated link is killed,
// which ends the call, and runStream waits for it to return (bounded by
// streamWait; Close waits for it in any case). A stall is returned
// wrapping errStalled so the caller can retry once on a fresh connection.
func (c *Cache) runStream(ctx context.Context, dc Dedicated, op string, stalled func() bool, call func() error) error {
	done := make(chan error, 1)
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		done <- call()
	}()
	tick := time.NewTicker(min(time.Second, c.cfg.StreamStall/4))
	defer tick.Stop()
	var cause error
loop:
	for {
		select {
		case err := <-done:
			return err
		case <-ctx.Done():
			cause = ctx.Err()
			break loop
		case <-tick.C:
			if stalled != nil && stalled() {
				cause = fmt.Errorf("%w for %v", errStalled, c.cfg.StreamStall)
				break loop
			}
		}
	}
	dc.Kill()
	t := time.NewTimer(streamWait)
	defer t.Stop()
	select {
	case err := <-done:
		if err == nil {
			return cause
		}
		return fmt.Errorf("%w (%w)", err, cause)
	case <-t.C:
		c.log.Error(cause, "libvirt stream call did not return after its link was killed; Close waits for it", "op", op)
		return fmt.Errorf("%s: did not return after its link was killed: %w", op, cause)
	}
}

// drained waits until the volume's size on the host reaches n, i.e.
// libvirt has written everything sent so far. A size that stops growing for
// c.drainStall is an error.
//
// vol is the volume's handle (nil: looked up; see doHandle).
func (c *Cache) drained(ctx context.Context, name string, vol *libvirt.StorageVol, n int64) error {
	var last uint64
	lastChange := time.Now()
	// Polled soon at first (the end of a segment usually needs a few
	// milliseconds), then every drainPoll.
	poll := min(time.Millisecond, drainPoll)
	for {
		phys, err := c.physicalHandle(ctx, name, vol)
		if err != nil {
			return fmt.Errorf("waiting for libvirt to write %d bytes: %w", n, err)
		}
		if phys >= uint64(n) {
			return nil
		}
		if phys != last {
			last, lastChange = phys, time.Now()
		} else if time.Since(lastChange) > c.drainStall {
			return fmt.Errorf("libvirt wrote only %d of %d bytes: %w", phys, n, errStalled)
		}
		if err := sleep(ctx, poll); err != nil {
			return err
		}
		poll = min(2*poll, drainPoll)
	}
}

// readBack hashes the bytes libvirt reads from the volume on the host,
// on a dedicated connection (closed before it returns).
func (c *Cache) readBack(ctx context.Context, name string) (int64, string, error) {
	dc, err := c.conn.Dedicated(ctx)
	if err != nil {
		return 0, "", c.classify(ctx, fmt.Errorf("read back %s: dedicated connection: %w", name, err))
	}
	defer dc.Close()
	h := sha256.New()
	var vol libvirt.StorageVol
	n, err := c.readRange(ctx, dc, name, &vol, h, 0, 0)
	if err != nil {
		return 0, "", err
	}
	return n, hex.EncodeToString(h.Sum(nil)), nil
}

type hashWriter struct {
	mu        sync.Mutex // the call may still write while runStream gives up
	h         hash.Hash  // nil once the caller is done with it
	n         int64
	stall     time.Duration
	lastWrite atomic.Int64 // unix nanos
}

func (w *hashWriter) touch() { w.lastWrite.Store(time.Now().UnixNano()) }

// stalled: libvirt sent nothing for the stall timeout.
func (w *hashWriter) stalled() bool {
	return time.Since(time.Unix(0, w.lastWrite.Load())) > w.stall
}

func (w *hashWriter) Write(p []byte) (int, error) {
	defer w.touch()
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.h != nil {
		w.h.Write(p)
	}
	w.n += int64(len(p))
	return len(p), nil
}

// meter is the upload's source: it counts, hashes and reports progress,
// refuses bytes beyond the pool's free space, and before it returns io.EOF
// waits (drain) until libvirt has written everything. Its first read error
// other than io.EOF is kept in fail, with where it came from.
type meter struct {
	mu     sync.Mutex // the call may still read while runStream gives up
	r      io.Reader
	h      hash.Hash
	n      int64
	total  int64
	free   uint64 // 0: no limit
	fail   meterFailure
	start  time.Time
	last   time.Time
	c      *Cache
	volume string
	drain  func() error
	stall  time.Duration
	// tally counts the bytes sent by source at each report (nil: no
	// metrics): nothing is added to each Read.
	tally *tally

	callDone atomic.Bool // the upload call has returned
	inRead   atomic.Bool
	lastRead atomic.Int64 // unix nanos of the last Read return
}

func (m *meter) touch() { m.lastRead.Store(time.Now().UnixNano()) }

// stalled: no Read running and none for the stall timeout (libvirt
// stopped consuming, or the call never started reading).
func (m *meter) stalled() bool {
	return !m.inRead.Load() && time.Since(time.Unix(0, m.lastRead.Load())) > m.stall
}

func (m *meter) Read(p []byte) (int, error) {
	m.inRead.Store(true)
	defer func() { m.touch(); m.inRead.Store(false) }()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.fail.err != nil {
		return 0, m.fail.err
	}
	n, err := m.r.Read(p)
	from := fromSource
	if n > 0 {
		m.h.Write(p[:n])
		m.n += int64(n)
	}
	if n > 0 && errors.Is(err, io.EOF) {
		err = nil // send these bytes first; the next Read drains and ends
	}
	if m.free > 0 && uint64(m.n) > m.free {
		err, from = fmt.Errorf("the image is larger than the %d bytes free in pool %s", m.free, m.c.cfg.Pool), fromGuard
	}
	if errors.Is(err, io.EOF) && m.drain != nil {
		if derr := m.drain(); derr != nil {
			err, from = derr, fromLibvirt
		}
	}
	if err != nil && !errors.Is(err, io.EOF) && m.fail.err == nil {
		m.fail = meterFailure{err: err, from: from, late: m.callDone.Load()}
	}
	if time.Since(m.last) >= m.c.cfg.ProgressInterval {
		m.report(false)
	}
	return n, err
}

func (m *meter) report(final bool) {
	m.tally.add(m.n)
	m.last = time.Now()
	el := m.last.Sub(m.start).Seconds()
	pr := imagecache.Progress{Volume: m.volume, Bytes: m.n, Total: m.total}
	if el > 0 {
		pr.Rate = float64(m.n) / el
	}
	m.c.log.Info("upload progress", "final", final, "volume", m.volume, "bytes", m.n, "total", m.total, "bytesPerSecond", int64(pr.Rate))
	if m.c.cfg.Progress != nil {
		m.c.cfg.Progress(pr)
	}
}

// endSpan ends span (see internal/obs), with err redacted.
func endSpan(span trace.Span, err error) {
	obs.End(span, redact.Err(err, ""))
}

// serverText is text a server chose (a status line), fit for an error:
// redacted, without control characters, bounded.
func serverText(s, rawURL string) string {
	return redact.Clip(redact.Sanitize(redact.Text(s, rawURL)), 120)
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// physicalHandle returns the volume's size on the host (the file size for
// a dir pool) as libvirt reports it now; vol is its handle when known
// (nil: looked up; see doHandle).
func (c *Cache) physicalHandle(ctx context.Context, name string, vol *libvirt.StorageVol) (uint64, error) {
	var phys uint64
	err := c.doHandle(ctx, name, vol, func(l Libvirt, v libvirt.StorageVol) error {
		var err error
		_, _, phys, err = l.StorageVolGetInfoFlags(v, uint32(libvirt.StorageVolGetPhysical))
		return err
	})
	if err != nil {
		return 0, err // fn may still be running: never read what it writes
	}
	return phys, nil
}
