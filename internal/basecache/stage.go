package basecache

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/redact"
	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

// The stages of a cold fetch, after containerd's content store: the
// source (ingest: the GET and its checks), a staged volume (stage) that
// close discards unless commit published it, the transfer into it with
// the read-back beside it (the verifier), and commit, which checks the
// stored size and digest and creates the marker last.

// ingest is the body of one fetch's GET — from the mirror alone, or
// through a Fanout's shared download of the mirror or a peer's base — once
// its status was checked.
type ingest struct {
	img    imagecache.Image
	url    string // the URL redacted: the only form ever printed
	log    logr.Logger
	resp   *http.Response
	body   io.ReadCloser // resp.Body, sniffed by admit
	total  int64         // Content-Length, -1 when unknown
	from   origin        // where the bytes came from, once read
	cancel context.CancelFunc
}

// origin says where an ingest's bytes came from, once they were read.
type origin interface {
	source() string  // Base.Source
	peer() string    // the entry of the peer that fed them, "" for none
	triedPeer() bool // a peer was opened for them
	peerFault()      // the fetch they fed failed: the peers opened are not candidates for a while
	// bytesBy splits the first n bytes by the source that fed them.
	bytesBy(n int64) sourceBytes
}

// mirrorOrigin is the origin of a download without a Fanout.
type mirrorOrigin struct{}

func (mirrorOrigin) source() string  { return imagecache.SourceMirror }
func (mirrorOrigin) peer() string    { return "" }
func (mirrorOrigin) triedPeer() bool { return false }
func (mirrorOrigin) peerFault()      {}

func (mirrorOrigin) bytesBy(n int64) (by sourceBytes) {
	by[srcMirror] = n
	return by
}

// sourcing is what a fetch may read: peers (other hosts' published bases)
// beside the mirror, or the mirror alone.
type sourcing struct {
	peers      []*peerBase
	mirrorOnly bool
}

// open starts the GET of img (with a Fanout, through a shared download
// whose sources may include the peers of how) under the HTTP deadline
// (httpDeadline) and checks its status. Its errors are classed: Permanent
// for what a retry cannot change (a bad URL, an HTTP 4xx, an untrusted
// certificate, a redirect loop).
func (c *Cache) open(ctx context.Context, img imagecache.Image, name string, how sourcing) (_ *ingest, err error) {
	in := &ingest{img: img, url: redact.URL(img.URL)}
	in.log = c.log.WithValues("volume", name, "url", in.url)
	httpDeadline, err := c.httpDeadline(ctx)
	if err != nil {
		return nil, c.classify(ctx, fmt.Errorf("image %q: %w", img.Key, err))
	}
	httpCtx, cancel := context.WithDeadline(ctx, httpDeadline)
	req, err := http.NewRequestWithContext(httpCtx, http.MethodGet, img.URL, nil)
	if err != nil {
		cancel()
		return nil, errs.Errorf(errs.Permanent, "image %q: bad URL %s: %s", img.Key, in.url, redact.ParseProblem(err))
	}
	in.cancel = cancel
	defer func() {
		if err != nil {
			c.closeIngest(in)
		}
	}()
	resp, from, err := c.get(req, img, how)
	if err != nil {
		return nil, c.getError(ctx, img, in.url, err)
	}
	in.resp, in.from, in.total = resp, from, resp.ContentLength
	if resp.StatusCode != http.StatusOK {
		return nil, statusError(img, in.url, resp)
	}
	trace.SpanFromContext(ctx).SetAttributes(attribute.Int64("imagecache.content_length", in.total))
	return in, nil
}

// closeIngest closes the body and ends the HTTP deadline.
func (c *Cache) closeIngest(in *ingest) {
	if in.resp != nil {
		_ = in.resp.Body.Close()
	}
	in.cancel()
}

// getError classes a failed GET. net/http's *url.Error names the URL (the
// last one, after redirects): it is redacted in place.
func (c *Cache) getError(ctx context.Context, img imagecache.Image, u string, err error) error {
	err = fmt.Errorf("image %q: GET %s: %w", img.Key, u, redact.Err(err, img.URL))
	if why, ok := permanentGET(err); ok && ctx.Err() == nil {
		return errs.WithCode(errs.Permanent, fmt.Errorf("%w: %s", err, why))
	}
	return c.classify(ctx, err)
}

// statusError is the error of a GET answered with a status other than 200:
// Permanent for a 4xx but 408 and 429, else Transient.
func statusError(img imagecache.Image, u string, resp *http.Response) error {
	code := errs.Transient
	if s := resp.StatusCode; s >= 400 && s < 500 && s != http.StatusRequestTimeout && s != http.StatusTooManyRequests {
		code = errs.Permanent
	}
	return errs.Errorf(code, "image %q: GET %s: %s", img.Key, u, serverText(resp.Status, img.URL))
}

// admit checks, before anything is created in the pool, that the pool has
// room for the image — before the body's first bytes arrive when the
// response announced its size — and that the body starts as the image's
// format says (sniff). It returns the pool's free bytes; a, when not nil,
// is the free space read ahead.
func (c *Cache) admit(ctx context.Context, in *ingest, a *ahead) (avail uint64, err error) {
	if in.total > 0 {
		if avail, err = c.available(ctx, a); err != nil {
			return 0, err
		}
		if uint64(in.total) > avail {
			return 0, errs.Errorf(errs.Transient, "image %q is %d bytes but pool %s has only %d bytes free; free space in the pool and retry", in.img.Key, in.total, c.cfg.Pool, avail)
		}
	}
	if in.body, err = c.sniff(ctx, in.img, in.resp, in.url); err != nil {
		return 0, err
	}
	if in.total <= 0 {
		return c.available(ctx, a)
	}
	return avail, nil
}

// checkLength checks the n bytes the upload sent against the response's
// length.
func (in *ingest) checkLength(n int64) error {
	if n == 0 {
		return errs.Errorf(errs.Transient, "image %q: %s served an empty body", in.img.Key, in.url)
	}
	if in.total >= 0 && n != in.total {
		return errs.Errorf(errs.Transient, "image %q: the body ended after %d of the %d bytes announced", in.img.Key, n, in.total)
	}
	return nil
}

// checkDigest checks the sha256 digest of what the upload sent against the
// configured one.
func (in *ingest) checkDigest(digest string) error {
	if want := in.img.SHA256; want != "" && digest != want {
		return errs.Errorf(errs.Permanent, "image %q from %s has sha256 %s but sha256 %s is configured; fix the URL or the configured digest (a new digest needs a new key if a base with the old one is in use)", in.img.Key, in.url, digest, want)
	}
	return nil
}

// stage is the volume a cold fetch fills: created empty, written by
// write, published by commit; close deletes it unless it was committed.
type stage struct {
	c    *Cache
	name string
	vol  libvirt.StorageVol // the handle its creation answered
	log  logr.Logger

	start    time.Time     // write began
	uploaded time.Duration // the upload took, from start
	back     readResult    // the read-back's findings
	// physical answers the volume's size, asked for once the upload is
	// over (nil before).
	physical  func() (uint64, error)
	committed bool
}

// newStage creates the empty volume name.
func (c *Cache) newStage(ctx context.Context, name string, log logr.Logger) (*stage, error) {
	x, err := volXML(name, 0)
	if err != nil {
		return nil, errs.WithCode(errs.Permanent, err)
	}
	vol, err := c.createVol(ctx, x)
	if err != nil {
		return nil, c.classify(ctx, fmt.Errorf("create volume %s: %w", name, err))
	}
	return &stage{c: c, name: name, vol: vol, log: log}, nil
}

// write transfers in's body into the volume — the upload, with the
// read-back of what the host stored beside it (transfer) — checks what was
// sent (checkLength, checkDigest) before the last segment is read back,
// and closes the body. avail is the pool's free space; dial, when not nil,
// the upload's connection being opened ahead.
func (s *stage) write(ctx context.Context, in *ingest, avail uint64, dial *dialing) (n int64, digest string, err error) {
	s.start = time.Now()
	n, digest, s.back, err = s.c.transfer(ctx, s.vol, dial, in.body, in.total, avail, s.c.meters.tally(in.from), func(n int64, digest string) error {
		s.uploaded = time.Since(s.start)
		if err := in.checkLength(n); err != nil {
			return err
		}
		if err := in.checkDigest(digest); err != nil {
			s.c.meters.verifyFailed(checkDigest, in.from.source())
			return err
		}
		// Every upload stream has been confirmed: the size on the host
		// is final, so it is asked for while the last range is read back.
		s.physical = s.c.physicalAhead(ctx, s.vol)
		return nil
	})
	_ = in.resp.Body.Close()
	return n, digest, err
}

// commit checks what the host stored against what write sent — the
// volume's physical size, then the read-back's count and digest
// (judgeStored) — and publishes the base by creating its marker, last. It
// returns what waits for the base's path, read together with the
// marker's creation.
func (s *stage) commit(ctx context.Context, n int64, digest string) (path func() (string, error), err error) {
	err = s.c.judgeStored(ctx, s.name, n, digest, s.physical, s.back)
	if s.back.span != nil {
		endSpan(s.back.span, err)
	}
	if err != nil {
		return nil, err
	}
	// The path does not depend on the marker: read together (one round
	// trip), used once the marker is there.
	path = s.c.pathAhead(ctx, s.vol)
	if err := s.c.createEmpty(ctx, MarkerName(s.name, digest)); err != nil {
		_, _ = path()
		return nil, s.c.classify(ctx, fmt.Errorf("create marker of %s: %w", s.name, err))
	}
	s.committed = true
	s.c.meters.published(s.name, digest, n)
	return path, nil
}

// close waits for what the stage left in the background (the read-back's
// connection closing, the size asked for) and, unless it was committed,
// deletes the volume: the transfer's dedicated connections are closed by
// then, so libvirtd has let go of it. err is the fetch's, for the log.
func (s *stage) close(ctx context.Context, err error) {
	if s.back.closed != nil {
		<-s.back.closed
	}
	if s.physical != nil {
		_, _ = s.physical() // ends with ctx at the latest
	}
	if !s.committed {
		s.log.Info("discarding the unverified volume", "err", errString(err))
		s.c.deleteQuietHandle(ctx, s.name, &s.vol)
	}
}

// notePublished logs the published base: where its bytes came from
// (source, which names every source in order when the shared download
// switched; the peer that fed them), how long it took and how fast.
func (c *Cache) notePublished(in *ingest, s *stage, n int64, digest, src string) {
	el := time.Since(s.start)
	log := in.log
	if p := in.from.peer(); p != "" {
		log = log.WithValues("peer", p)
	}
	log.Info("published base", "source", src, "bytes", n, "sha256", digest, "elapsed", el, "bytesPerSecond", int64(float64(n)/el.Seconds()),
		"upload", s.uploaded, "uploadBytesPerSecond", int64(float64(n)/s.uploaded.Seconds()),
		// The read-back overlaps the upload: verify is what it added
		// after the upload.
		"verify", el-s.uploaded)
}
