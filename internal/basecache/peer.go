package basecache

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/redact"
)

// Late joiners (see the package doc, "Fan-out"): a cache that
// goes cold for an image with a configured SHA256 after other caches of its
// Fanout published it copies the base from one of them — StorageVolDownload
// from the peer's host, streamed into this host's upload — instead of
// downloading it from the mirror. The copy goes through the same upload,
// read-back, size check and marker as a download: what this host publishes
// is the digest of the bytes read back from its own volume, and it must
// equal the configured digest. Any failure of the copy (the peer's link,
// the peer's base gone, bytes that do not hash to the digest) falls back to
// the mirror within the same fetch: a peer's fault never fails a fetch.

const (
	// peerLookTimeout bounds asking the other caches' pools for a published
	// base (one listing each, at most peerLookers at once): a peer host
	// that does not answer (frozen, its link down) costs a cold fetch at
	// most this long. A listing takes milliseconds, a few round trips with
	// a dial.
	peerLookTimeout = 2 * time.Second
	peerLookers     = 8
	// peerGrace: once one peer answered with a base, the others answering
	// within this long are weighed too (the least busy one is copied from).
	peerGrace = 200 * time.Millisecond
	// peerBackoff: a peer whose copy failed is not asked again for this
	// long.
	peerBackoff = time.Minute
	// peerChunks is how many chunks (go-libvirt's stream packets, up to
	// 256 KiB) a copy from a peer holds between the peer's download and
	// this host's upload.
	peerChunks = 4
	// peerStall is the no-progress bound of the peer's download stream
	// (Config.StreamStall when that is shorter): a stalled peer costs at
	// most this before the fetch falls back to the mirror.
	peerStall = 15 * time.Second
)

// peerStats is what a Fanout remembers of its caches as sources.
type peerStats struct {
	// rate is the bytes/s of the last successful copy from this cache.
	rate float64
	// failed is when a copy from this cache last failed.
	failed time.Time
	// busy counts the copies from this cache in flight.
	busy int
}

// register adds c to f's caches (peers of each other); unregister removes
// it (Close).
func (f *Fanout) register(c *Cache) {
	f.pmu.Lock()
	defer f.pmu.Unlock()
	f.caches = append(f.caches, c)
}

func (f *Fanout) unregister(c *Cache) {
	f.pmu.Lock()
	defer f.pmu.Unlock()
	f.caches = slices.DeleteFunc(f.caches, func(x *Cache) bool { return x == c })
	delete(f.peerStats, c)
}

// peersFor returns the caches c may copy img's base from: every other cache
// of f with the same HTTP client (as for shared downloads: an embedder
// that gives caches clients of their own, e.g. other credentials, keeps
// them apart), but those whose last copy failed less than peerBackoff
// ago, and those whose last copy was slower than the last download of img
// from the mirror (a peer is tried first while either rate is unknown).
func (f *Fanout) peersFor(c *Cache, key fanKey) []*Cache {
	f.pmu.Lock()
	defer f.pmu.Unlock()
	mirror := f.mirrorRate[key]
	var out []*Cache
	for _, p := range f.caches {
		if p == c || p.cfg.HTTPClient != c.cfg.HTTPClient {
			continue
		}
		st := f.peerStats[p]
		if st != nil && !st.failed.IsZero() && time.Since(st.failed) < peerBackoff {
			continue
		}
		if st != nil && st.rate > 0 && mirror > 0 && st.rate < mirror {
			continue
		}
		out = append(out, p)
	}
	return out
}

func (f *Fanout) statsLocked(p *Cache) *peerStats {
	if f.peerStats == nil {
		f.peerStats = map[*Cache]*peerStats{}
	}
	st := f.peerStats[p]
	if st == nil {
		st = &peerStats{}
		f.peerStats[p] = st
	}
	return st
}

// busy returns how many copies from p are in flight.
func (f *Fanout) busy(p *Cache) int {
	f.pmu.Lock()
	defer f.pmu.Unlock()
	if st := f.peerStats[p]; st != nil {
		return st.busy
	}
	return 0
}

// copying counts a copy from p in flight until the returned func runs.
func (f *Fanout) copying(p *Cache) func() {
	f.pmu.Lock()
	f.statsLocked(p).busy++
	f.pmu.Unlock()
	return func() {
		f.pmu.Lock()
		f.statsLocked(p).busy--
		f.pmu.Unlock()
	}
}

// noteCopy records the outcome of a copy from p (rate in bytes/s when it
// succeeded).
func (f *Fanout) noteCopy(p *Cache, rate float64, ok bool) {
	f.pmu.Lock()
	defer f.pmu.Unlock()
	if !slices.Contains(f.caches, p) {
		return // closed meanwhile
	}
	st := f.statsLocked(p)
	if ok {
		st.rate, st.failed = rate, time.Time{}
	} else {
		st.failed = time.Now()
	}
}

// noteMirror records the rate (bytes/s) of a download of key from the
// mirror that a cache published.
func (f *Fanout) noteMirror(key fanKey, rate float64) {
	f.pmu.Lock()
	defer f.pmu.Unlock()
	if f.mirrorRate == nil {
		f.mirrorRate = map[fanKey]float64{}
	}
	f.mirrorRate[key] = rate
}

// joinable reports whether a download of key is under way that a fetch
// starting now would join from byte 0.
func (f *Fanout) joinable(key fanKey) bool {
	f.mu.Lock()
	d := f.dls[key]
	f.mu.Unlock()
	if d == nil {
		return false
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return !d.gone && d.base == 0
}

// peerBase is a published base of another cache with the digest wanted.
type peerBase struct {
	c      *Cache // the peer's cache
	volume string
	size   int64 // its physical size on the peer's host
}

// fanKey is the key of img's downloads in c's Fanout.
func (c *Cache) fanKey(img imagecache.Image) fanKey {
	return fanKey{url: img.URL, sha256: img.SHA256, client: c.cfg.HTTPClient}
}

// findPeer returns a published base of img's configured digest on another
// cache of c's Fanout, or nil: when there is no Fanout, peers are off, no
// digest is configured (without one the mirror is the only authority on
// what the image is), a shared download of img can still be joined, or no
// peer has one. Peers are asked at once (bounded); among those answering
// within peerGrace of the first, the one with the fewest copies in flight
// is chosen. A peer that fails to answer is only logged.
func (c *Cache) findPeer(ctx context.Context, img imagecache.Image) *peerBase {
	f := c.cfg.Fanout
	if f == nil || f.opts.MirrorOnly || img.SHA256 == "" || f.joinable(c.fanKey(img)) {
		return nil
	}
	peers := f.peersFor(c, c.fanKey(img))
	if len(peers) == 0 {
		return nil
	}
	lctx, cancel := context.WithTimeout(ctx, peerLookTimeout)
	defer cancel()
	found := make(chan *peerBase, len(peers))
	sem := make(chan struct{}, peerLookers)
	var wg sync.WaitGroup
	for _, p := range peers {
		wg.Go(func() {
			select {
			case sem <- struct{}{}:
				defer func() { <-sem }()
			case <-lctx.Done():
				found <- nil
				return
			}
			pb, err := p.publishedDigest(lctx, img.SHA256)
			if err != nil && lctx.Err() == nil {
				c.log.V(1).Info("could not ask a peer for the image", "peer", p.cfg.Entry, "err", redact.Text(err.Error(), img.URL))
			}
			found <- pb
		})
	}
	defer wg.Wait() // every asker ends (lctx is canceled first) before return
	var best *peerBase
	var grace <-chan time.Time
	for range peers {
		select {
		case pb := <-found:
			if pb == nil {
				continue
			}
			if best == nil {
				best = pb
				t := time.NewTimer(peerGrace)
				defer t.Stop()
				grace = t.C
			} else if f.busy(pb.c) < f.busy(best.c) {
				best = pb
			}
			continue
		case <-grace:
		case <-lctx.Done():
		}
		break
	}
	cancel()
	return best
}

// publishedDigest finds, in c's pool, a base with exactly one well-formed
// marker of digest and no other writer's work in progress (decide's hit,
// the same rule as for c's own bases), and returns it with its size. A
// base of any entry qualifies: its marker says it was read back and
// verified by whoever published it. nil when there is none.
func (c *Cache) publishedDigest(ctx context.Context, digest string) (*peerBase, error) {
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	names, err := c.listNames(ctx)
	if err != nil {
		return nil, err
	}
	for _, n := range names {
		b, d, ok := ParseMarkerName(n)
		if !ok || d != digest || !slices.Contains(names, b) {
			continue
		}
		if dec := decide(c.snapshot(names, b, digest, "")); dec.Action != actHit {
			continue
		}
		var phys uint64
		err := c.doVol(ctx, b, func(l Libvirt, v libvirt.StorageVol) error {
			var err error
			_, _, phys, err = l.StorageVolGetInfoFlags(v, uint32(libvirt.StorageVolGetPhysical))
			return err
		})
		if err != nil {
			return nil, err
		}
		return &peerBase{c: c, volume: b, size: int64(phys)}, nil
	}
	return nil, nil
}

// peerGet is the GET of fetchOnce for a copy from peer pb: a response
// whose body streams pb's base from its host (a dedicated connection of
// the peer's, owned by c). The body ends with io.EOF only when the
// download call returned nil; any error of the peer (its link, its base
// gone) is the body's error.
func (c *Cache) peerGet(req *http.Request, pb *peerBase) (*http.Response, func() string, error) {
	ctx, cancel := context.WithCancel(req.Context())
	b := &peerBody{
		ctx: ctx, cancel: cancel,
		ch: make(chan []byte, peerChunks), free: make(chan []byte, peerChunks+2), done: make(chan struct{}),
		stall: min(c.cfg.StreamStall, peerStall),
	}
	b.touch()
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		defer close(b.done)
		defer close(b.ch)
		b.err = c.copyFrom(ctx, pb, b)
	}()
	resp := &http.Response{
		Status: "200 OK", StatusCode: http.StatusOK, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: http.Header{}, ContentLength: pb.size, Request: req, Body: b,
	}
	return resp, func() string { return imagecache.SourcePeer }, nil
}

// copyFrom streams pb's base into w on a dedicated connection of the
// peer's (closed before it returns).
func (c *Cache) copyFrom(ctx context.Context, pb *peerBase, w *peerBody) error {
	p := pb.c
	dc, err := p.conn.Dedicated(ctx)
	if err != nil {
		return fmt.Errorf("copy from peer %s: dedicated connection: %w", p.cfg.Entry, err)
	}
	defer dc.Close()
	err = c.runStream(ctx, dc, "copy from peer "+p.cfg.Entry, w.stalled, func() error {
		v, err := p.lookupVol(dc.Libvirt(), pb.volume)
		if err != nil {
			return err
		}
		return dc.Libvirt().StorageVolDownload(v, w, 0, 0, 0)
	})
	if err != nil {
		return fmt.Errorf("copy from peer %s (%s) after %d bytes: %w", p.cfg.Entry, pb.volume, w.n.Load(), err)
	}
	return nil
}

// peerBody is the body of a copy from a peer: the download call writes
// into it (Write never fails, so go-libvirt keeps draining the stream;
// ctx and stalls kill the link), the upload reads from it, through a few
// buffered chunks.
type peerBody struct {
	ctx    context.Context
	cancel context.CancelFunc
	ch     chan []byte // chunks written, not read yet
	free   chan []byte // chunks read, for Write to reuse
	done   chan struct{}
	err    error  // the download's; read after done
	cur    []byte // the rest of the chunk Read is in
	buf    []byte // that chunk whole, to give back to free

	n         atomic.Int64
	stall     time.Duration
	inWrite   atomic.Bool
	lastWrite atomic.Int64 // unix nanos

	closeOnce sync.Once
}

func (b *peerBody) touch() { b.lastWrite.Store(time.Now().UnixNano()) }

// stalled: the peer sent nothing for the stall bound (a Write waiting for
// this host's upload to take its bytes is not the peer stalling).
func (b *peerBody) stalled() bool {
	return !b.inWrite.Load() && time.Since(time.Unix(0, b.lastWrite.Load())) > b.stall
}

func (b *peerBody) Write(p []byte) (int, error) {
	b.inWrite.Store(true)
	defer func() { b.touch(); b.inWrite.Store(false) }()
	if len(p) == 0 {
		return 0, nil
	}
	var c []byte
	select {
	case c = <-b.free:
	default:
	}
	if cap(c) < len(p) {
		c = make([]byte, len(p))
	}
	c = c[:len(p)]
	copy(c, p)
	select {
	case b.ch <- c:
		b.n.Add(int64(len(p)))
	case <-b.ctx.Done(): // nobody reads any more: drop (the link is being killed)
	}
	return len(p), nil
}

func (b *peerBody) Read(p []byte) (int, error) {
	if len(b.cur) == 0 {
		if b.buf != nil {
			select {
			case b.free <- b.buf:
			default:
			}
			b.buf = nil
		}
		select {
		case chunk, ok := <-b.ch:
			if !ok {
				if b.err != nil {
					return 0, b.err
				}
				return 0, io.EOF
			}
			b.cur, b.buf = chunk, chunk
		case <-b.ctx.Done():
			return 0, errors.Join(errBodyClosed, b.ctx.Err())
		}
	}
	n := copy(p, b.cur)
	b.cur = b.cur[n:]
	return n, nil
}

// Close ends the copy (killing the peer's download if it still runs) and
// waits for it.
func (b *peerBody) Close() error {
	b.closeOnce.Do(func() {
		b.cancel()
		<-b.done
	})
	return nil
}
