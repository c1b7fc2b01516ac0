package basecache

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/redact"
)

// Peers (see the package doc, "Fan-out", and Fanout): a cache going cold
// for an image with a configured SHA256 asks the other caches of its
// Fanout for a published base of that digest. A base on another host is
// a candidate source of the shared download (source.go): StorageVolDownload
// from the peer's host, streamed into every reader's upload. A base on the
// cache's own host is never read over the network (clone.go). Whatever
// the source, each host uploads, reads back and checks its own volume
// against the configured digest before it publishes.

const (
	// peerLookTimeout bounds asking the other caches' pools for a published
	// base (one listing each, at most peerLookers at once): a peer host
	// that does not answer (frozen, its link down) costs a cold fetch at
	// most this long. A listing takes milliseconds, a few round trips with
	// a dial.
	peerLookTimeout = 2 * time.Second
	peerLookers     = 8
	// peerGrace: once one peer answered with a base, the others answering
	// within this long are candidates too.
	peerGrace = 200 * time.Millisecond
	// peerBackoff: a peer whose stream failed is not a candidate for this
	// long.
	peerBackoff = time.Minute
	// peerChunks is how many chunks (go-libvirt's stream packets, up to
	// 256 KiB) a stream from a peer holds between the peer's download and
	// its reader.
	peerChunks = 4
	// peerStall is the no-progress bound of a peer's download stream
	// (the peer's Config.StreamStall when that is shorter): a stalled peer
	// costs at most this before the download leaves it.
	peerStall = 15 * time.Second
)

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
}

// others returns the caches c may copy a base from: every other cache of
// f with the same HTTP client (as for shared downloads: an embedder that
// gives caches clients of their own, e.g. other credentials, keeps them
// apart).
func (f *Fanout) others(c *Cache) []*Cache {
	f.pmu.Lock()
	defer f.pmu.Unlock()
	var out []*Cache
	for _, p := range f.caches {
		if p != c && p.cfg.HTTPClient == c.cfg.HTTPClient {
			out = append(out, p)
		}
	}
	return out
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
	size   int64               // its physical size on the peer's host
	pool   libvirt.StoragePool // the peer's pool: its host's identity
}

// fanKey is the key of img's downloads in c's Fanout.
func (c *Cache) fanKey(img imagecache.Image) fanKey {
	return fanKey{url: img.URL, sha256: img.SHA256, client: c.cfg.HTTPClient}
}

// goingCold notes, for c's Fanout, that c fetches img until the returned
// func runs (see Fanout.goingCold).
func (c *Cache) goingCold(img imagecache.Image) func() {
	if f := c.cfg.Fanout; f != nil {
		return f.goingCold(c, c.fanKey(img))
	}
	return func() {}
}

// poolHandle is the handle of c's pool once it was looked up.
func (c *Cache) poolHandle() (libvirt.StoragePool, bool) {
	c.poolMu.Lock()
	defer c.poolMu.Unlock()
	return c.pool, c.poolSet
}

// sameHost reports whether the pool with UUID pool is on c's libvirtd:
// c's own pool, or one its libvirtd listed the last time c looked for
// peers (listHost). Libvirt gives every pool a UUID of its own, so two
// libvirtds never share one.
func (c *Cache) sameHost(pool libvirt.UUID) bool {
	if p, ok := c.poolHandle(); ok && p.UUID == pool {
		return true
	}
	c.hostMu.Lock()
	defer c.hostMu.Unlock()
	return c.hostPools[pool]
}

// listHost learns the UUIDs of every pool of c's libvirtd (for sameHost).
func (c *Cache) listHost(ctx context.Context) error {
	var pools []libvirt.StoragePool
	err := c.do(ctx, func(l Libvirt) error {
		var err error
		pools, _, err = l.ConnectListAllStoragePools(1, 0)
		return err
	})
	if err != nil {
		return err
	}
	m := make(map[libvirt.UUID]bool, len(pools))
	for _, p := range pools {
		m[p.UUID] = true
	}
	c.hostMu.Lock()
	c.hostPools = m
	c.hostMu.Unlock()
	return nil
}

func uuidString(u libvirt.UUID) string { return hex.EncodeToString(u[:]) }

// findPeers returns the published bases of img's configured digest on
// other caches of c's Fanout: those on other hosts (network), and one on
// c's own host (local, nil for none). It returns nothing when there is no
// Fanout, peers are off, no digest is configured (without one the mirror
// is the only authority on what the image is) or a shared download of img
// can still be joined. Peers are asked at once (askPeers), beside a
// listing of c's own libvirtd's pools, which tells its host's bases.
func (c *Cache) findPeers(ctx context.Context, img imagecache.Image) (network []*peerBase, local *peerBase) {
	f := c.cfg.Fanout
	if f == nil || f.opts.MirrorOnly || img.SHA256 == "" || f.joinable(c.fanKey(img)) {
		return nil, nil
	}
	peers := f.others(c)
	if len(peers) == 0 {
		return nil, nil
	}
	lctx, cancel := context.WithTimeout(ctx, peerLookTimeout)
	defer cancel()
	listed := make(chan error, 1)
	go func() { listed <- c.listHost(lctx) }()
	all := c.askPeers(lctx, peers, img)
	if err := <-listed; err != nil && lctx.Err() == nil {
		c.log.V(1).Info("could not list the pools of its own host", "err", err.Error())
	}
	for _, pb := range all {
		switch {
		case !c.sameHost(pb.pool.UUID):
			network = append(network, pb)
		case local == nil:
			local = pb
		}
	}
	return network, local
}

// askPeers asks peers at once (at most peerLookers at a time, bounded by
// lctx) for a published base of img's digest and returns those answering
// within peerGrace of the first. A peer that fails to answer is only
// logged.
func (c *Cache) askPeers(lctx context.Context, peers []*Cache, img imagecache.Image) []*peerBase {
	lctx, cancel := context.WithCancel(lctx)
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
	var all []*peerBase
	var grace <-chan time.Time
	for range peers {
		select {
		case pb := <-found:
			if pb != nil {
				all = append(all, pb)
				if grace == nil {
					t := time.NewTimer(peerGrace)
					defer t.Stop()
					grace = t.C
				}
			}
			continue
		case <-grace:
		case <-lctx.Done():
		}
		break
	}
	cancel()
	return all
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
	pool, ok := c.poolHandle()
	if !ok {
		return nil, nil
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
		c.meters.sized(b, int64(phys))
		return &peerBase{c: c, volume: b, size: int64(phys), pool: pool}, nil
	}
	return nil, nil
}

// stream is a body of s's base (a base of c's, the peer's) from offset
// off: a dedicated connection of c's streams it (StorageVolDownload) until
// ctx ends, c closes, or the body is closed. The body ends with io.EOF only
// when the download call returned nil; any error of the peer (its link,
// its base gone) is the body's error. It counts as a stream of s's link
// in f while it runs.
func (c *Cache) stream(ctx context.Context, f *Fanout, s *source, off int64) *peerBody {
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(c.stop, cancel)
	b := &peerBody{
		ctx: ctx, cancel: cancel,
		ch: make(chan []byte, peerChunks), free: make(chan []byte, peerChunks+2), done: make(chan struct{}),
		stall: min(c.cfg.StreamStall, peerStall),
	}
	b.touch()
	idle := f.streaming(s.link)
	go func() {
		defer close(b.done)
		defer close(b.ch)
		defer idle()
		defer stop()
		b.err = c.copyFrom(ctx, s.peer, off, b)
	}()
	return b
}

// copyFrom streams pb's base (one of c's) from off into w on a dedicated
// connection of c's (closed before it returns).
func (c *Cache) copyFrom(ctx context.Context, pb *peerBase, off int64, w *peerBody) error {
	dc, err := c.conn.Dedicated(ctx)
	if err != nil {
		return fmt.Errorf("copy from peer %s: dedicated connection: %w", c.cfg.Entry, err)
	}
	defer dc.Close()
	err = c.runStream(ctx, dc, "copy from peer "+c.cfg.Entry, w.stalled, func() error {
		v, err := c.lookupVol(dc.Libvirt(), pb.volume)
		if err != nil {
			return err
		}
		return dc.Libvirt().StorageVolDownload(v, w, uint64(off), 0, 0)
	})
	if err != nil {
		return fmt.Errorf("copy from peer %s (%s) after %d bytes: %w", c.cfg.Entry, pb.volume, off+w.n.Load(), err)
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
