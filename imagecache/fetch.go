package imagecache

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"net/http"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/provider"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// fetch downloads img into a new volume named name, verifies what libvirt
// stored and publishes it with its marker. The caller holds the only claim
// and has removed any previous base. On any failure the volume is deleted
// (after the transfer connection is closed) and nothing is published.
func (c *Cache) fetch(ctx context.Context, img Image, name string) (_ Base, err error) {
	ctx, span := c.tracer.Start(ctx, "imagecache.fetch", spanAttr(name))
	defer func() { endSpan(span, err) }()
	log := c.log.WithValues("volume", name, "url", img.URL)

	httpCtx, cancelHTTP := context.WithDeadline(ctx, time.Now().Add(c.cfg.TransferBudget-c.cfg.HTTPGrace))
	defer cancelHTTP()
	req, err := http.NewRequestWithContext(httpCtx, http.MethodGet, img.URL, nil)
	if err != nil {
		return Base{}, provider.Errorf(provider.Permanent, "image %q: bad URL: %w", img.Key, err)
	}
	resp, err := c.cfg.HTTPClient.Do(req)
	if err != nil {
		return Base{}, c.classify(ctx, fmt.Errorf("image %q: GET %s: %w", img.Key, img.URL, err))
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		code := provider.Transient
		if resp.StatusCode >= 400 && resp.StatusCode < 500 && resp.StatusCode != http.StatusRequestTimeout && resp.StatusCode != http.StatusTooManyRequests {
			code = provider.Permanent
		}
		return Base{}, provider.Errorf(code, "image %q: GET %s: %s", img.Key, img.URL, resp.Status)
	}
	total := resp.ContentLength
	span.SetAttributes(attribute.Int64("content_length", total))

	if total > 0 {
		avail, err := c.poolAvailable(ctx)
		if err != nil {
			return Base{}, err
		}
		if uint64(total) > avail {
			return Base{}, provider.Errorf(provider.Transient, "image %q is %d bytes but pool %s has only %d bytes free; free space in the pool and retry", img.Key, total, c.cfg.Pool, avail)
		}
	}

	x, err := volXML(name, 0)
	if err != nil {
		return Base{}, provider.WithCode(provider.Permanent, err)
	}
	err = c.do(ctx, func(l *libvirt.Libvirt) error {
		p, err := l.StoragePoolLookupByName(c.cfg.Pool)
		if err != nil {
			return err
		}
		_, err = l.StorageVolCreateXML(p, x, 0)
		return err
	})
	if err != nil {
		return Base{}, c.classify(ctx, fmt.Errorf("create volume %s: %w", name, err))
	}
	published := false
	defer func() {
		if !published {
			// upload and readBack have closed their dedicated connections
			// by now, so libvirtd has let go of the volume.
			log.Info("discarding the unverified volume", "err", errString(err))
			c.deleteQuiet(ctx, name)
		}
	}()

	log.Info("fetching image", "bytes", total)
	start := time.Now()
	n, digest, err := c.upload(ctx, name, resp.Body, total)
	_ = resp.Body.Close()
	if err != nil {
		return Base{}, err
	}
	if total >= 0 && n != total {
		return Base{}, provider.Errorf(provider.Transient, "image %q: the body ended after %d of the %d bytes announced", img.Key, n, total)
	}
	if img.SHA256 != "" && digest != img.SHA256 {
		return Base{}, provider.Errorf(provider.Permanent, "image %q from %s has sha256 %s but sha256 %s is configured; fix the URL or the configured digest (a new digest needs a new key if a base with the old one is in use)", img.Key, img.URL, digest, img.SHA256)
	}
	if err := c.verifyStored(ctx, name, n, digest); err != nil {
		return Base{}, err
	}
	if err := c.createEmpty(ctx, MarkerName(name, digest)); err != nil {
		return Base{}, c.classify(ctx, fmt.Errorf("create marker of %s: %w", name, err))
	}
	published = true
	el := time.Since(start)
	log.Info("published base", "bytes", n, "sha256", digest, "seconds", el.Seconds(), "rate", float64(n)/el.Seconds())
	return c.published(ctx, img, name, digest)
}

// verifyStored checks that the volume's physical size is n and that the
// bytes libvirt reads back from the host hash to digest.
func (c *Cache) verifyStored(ctx context.Context, name string, n int64, digest string) (err error) {
	ctx, span := c.tracer.Start(ctx, "imagecache.verify", spanAttr(name))
	defer func() { endSpan(span, err) }()
	var phys uint64
	err = c.do(ctx, func(l *libvirt.Libvirt) error {
		p, err := l.StoragePoolLookupByName(c.cfg.Pool)
		if err != nil {
			return err
		}
		v, err := l.StorageVolLookupByName(p, name)
		if err != nil {
			return err
		}
		_, _, phys, err = l.StorageVolGetInfoFlags(v, uint32(libvirt.StorageVolGetPhysical))
		return err
	})
	if err != nil {
		return c.classify(ctx, fmt.Errorf("verify %s: %w", name, err))
	}
	if phys != uint64(n) {
		return provider.Errorf(provider.Transient, "verify %s: the volume holds %d bytes on the host but %d were sent (upload lost data; disk full?)", name, phys, n)
	}
	rn, rd, err := c.readBack(ctx, name)
	if err != nil {
		return err
	}
	if rn != n || rd != digest {
		return provider.Errorf(provider.Transient, "verify %s: the host stores %d bytes with sha256 %s but %d bytes with sha256 %s were sent", name, rn, rd, n, digest)
	}
	return nil
}

// poolAvailable refreshes the pool (best effort) and returns its free bytes.
func (c *Cache) poolAvailable(ctx context.Context) (uint64, error) {
	var avail uint64
	err := c.do(ctx, func(l *libvirt.Libvirt) error {
		p, err := l.StoragePoolLookupByName(c.cfg.Pool)
		if err != nil {
			return err
		}
		if err := l.StoragePoolRefresh(p, 0); err != nil {
			c.log.V(1).Info("pool refresh failed; using the last known free space", "err", err.Error())
		}
		_, _, _, avail, err = l.StoragePoolGetInfo(p)
		return err
	})
	if err != nil {
		return 0, c.classify(ctx, fmt.Errorf("free space of pool %s: %w", c.cfg.Pool, err))
	}
	return avail, nil
}

// upload streams body into volume name on a dedicated connection, counting
// and hashing on the way. The connection is closed before it returns; it is
// killed at once if ctx ends.
func (c *Cache) upload(ctx context.Context, name string, body io.Reader, total int64) (n int64, digest string, err error) {
	ctx, span := c.tracer.Start(ctx, "imagecache.upload", spanAttr(name))
	defer func() {
		span.SetAttributes(attribute.Int64("bytes", n))
		endSpan(span, err)
	}()
	dc, err := c.conn.Dedicated(ctx)
	if err != nil {
		return 0, "", c.classify(ctx, fmt.Errorf("upload %s: dedicated connection: %w", name, err))
	}
	defer dc.Close()
	stop := context.AfterFunc(ctx, dc.Kill)
	defer stop()

	m := &meter{r: body, h: sha256.New(), total: total, start: time.Now(), last: time.Now(), c: c, volume: name}
	err = func() error {
		p, err := dc.L.StoragePoolLookupByName(c.cfg.Pool)
		if err != nil {
			return err
		}
		v, err := dc.L.StorageVolLookupByName(p, name)
		if err != nil {
			return err
		}
		return dc.L.StorageVolUpload(v, m, 0, 0, 0)
	}()
	m.report(true)
	if m.err != nil {
		return m.n, "", c.classify(ctx, fmt.Errorf("upload %s: reading the image after %d bytes: %w", name, m.n, m.err))
	}
	if err != nil {
		return m.n, "", c.classify(ctx, fmt.Errorf("upload %s after %d bytes: %w", name, m.n, err))
	}
	return m.n, hex.EncodeToString(m.h.Sum(nil)), nil
}

// readBack hashes the bytes libvirt reads from the volume on the host,
// on a dedicated connection (closed before it returns).
func (c *Cache) readBack(ctx context.Context, name string) (int64, string, error) {
	dc, err := c.conn.Dedicated(ctx)
	if err != nil {
		return 0, "", c.classify(ctx, fmt.Errorf("read back %s: dedicated connection: %w", name, err))
	}
	defer dc.Close()
	stop := context.AfterFunc(ctx, dc.Kill)
	defer stop()
	// The writer never fails: go-libvirt must keep draining the stream
	// (a failing writer would leave its router blocked); ctx kills the link.
	w := &hashWriter{h: sha256.New()}
	err = func() error {
		p, err := dc.L.StoragePoolLookupByName(c.cfg.Pool)
		if err != nil {
			return err
		}
		v, err := dc.L.StorageVolLookupByName(p, name)
		if err != nil {
			return err
		}
		return dc.L.StorageVolDownload(v, w, 0, 0, 0)
	}()
	if err != nil {
		return 0, "", c.classify(ctx, fmt.Errorf("read back %s after %d bytes: %w", name, w.n, err))
	}
	return w.n, hex.EncodeToString(w.h.Sum(nil)), nil
}

type hashWriter struct {
	h hash.Hash
	n int64
}

func (w *hashWriter) Write(p []byte) (int, error) {
	w.h.Write(p)
	w.n += int64(len(p))
	return len(p), nil
}

// meter is the upload's source: it counts, hashes and reports progress. Its
// first read error other than io.EOF is kept in err.
type meter struct {
	r      io.Reader
	h      hash.Hash
	n      int64
	total  int64
	err    error
	start  time.Time
	last   time.Time
	c      *Cache
	volume string
}

func (m *meter) Read(p []byte) (int, error) {
	n, err := m.r.Read(p)
	if n > 0 {
		m.h.Write(p[:n])
		m.n += int64(n)
	}
	if err != nil && !errors.Is(err, io.EOF) && m.err == nil {
		m.err = err
	}
	if time.Since(m.last) >= m.c.cfg.ProgressInterval {
		m.report(false)
	}
	return n, err
}

func (m *meter) report(final bool) {
	m.last = time.Now()
	el := m.last.Sub(m.start).Seconds()
	pr := Progress{Volume: m.volume, Bytes: m.n, Total: m.total}
	if el > 0 {
		pr.Rate = float64(m.n) / el
	}
	m.c.log.V(boolInt(final)).Info("upload progress", "volume", m.volume, "bytes", m.n, "total", m.total, "bytesPerSecond", int64(pr.Rate))
	if m.c.cfg.Progress != nil {
		m.c.cfg.Progress(pr)
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

func endSpan(span trace.Span, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
