package basecache

import (
	"bytes"
	"context"
	"crypto/sha256"
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

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/redact"
	"github.com/go-logr/logr"
)

// FanoutOptions tune a Fanout. Zero fields take the defaults.
type FanoutOptions struct {
	// JoinWindow is how long a shared download keeps its first bytes for
	// fetches of the same image that join it later: while another cache's
	// Ensure of the image is under way and has not reached its GET, up to
	// the whole window (waiting when the window is full), so that fetch
	// joins from byte 0; with nobody on the way, only the first 8 chunks
	// (2 MiB), never waiting, so a fetch alone never waits and holds no
	// more than those and the read-ahead. A fetch that comes after byte 0
	// left downloads on its own (or copies from a peer). Zero: 1s.
	JoinWindow time.Duration
	// Window bounds the bytes a shared download holds in memory, whatever
	// the number of fetches reading it. Zero: 8 MiB.
	Window int64
	// Chunk is the unit the window is allocated and recycled in. Zero:
	// 256 KiB.
	Chunk int
	// DetachAfter: a fetch that keeps the window full (the others are a
	// window ahead of it) for this long is detached from the shared
	// download and continues on its own. Zero: 2s.
	DetachAfter time.Duration
	// SwitchAfter is how long a shared download reads a source (the
	// mirror, a peer) before it weighs switching to another, and how
	// often it weighs again: it switches when the readers waited for the
	// source most of that time (see Fanout). Zero: 3s.
	SwitchAfter time.Duration
	// MirrorOnly: a cold fetch never copies the base from another cache
	// of the Fanout (see Fanout); it joins a shared download or downloads
	// from the mirror. Zero: it copies, for an image with a configured
	// SHA256, when another cache has published it.
	MirrorOnly bool
}

// Fanout shares one HTTP download of an image among concurrent cold
// fetches of caches (of different entries, on different hosts) configured
// with the same *Fanout (Config.Fanout). Only the HTTP body is shared:
// every fetch still uploads, reads back and hashes what its own host
// stored, checks its size and writes its own marker last.
//
// Downloads are shared per (URL, configured SHA256, *http.Client): caches
// with different HTTP clients (other credentials or transports) never
// share. A download streams through a bounded window (FanoutOptions.Window)
// read by every fetch at its own pace; a fetch that stays a whole window
// behind the others for DetachAfter is detached: its next read continues
// on a download of its own from where it was (Range with If-Range when the
// server announced ranges and a validator, else a full GET skipping the
// bytes it has), so a slow or stalled host never slows the others nor
// makes the process buffer the image. A fetch that ends (its context, its
// host failing) leaves without affecting the others; the download goes on
// while any fetch reads it and is canceled when none is left. A body error
// fails every fetch still attached with that error (each fails Transient
// before its marker: nothing is published).
//
// A download reads at most a few chunks ahead of the fetch furthest into
// it, so a fetch alone holds about a megabyte, not the window.
//
// Peers: for an image with a configured SHA256, a cache that goes cold when
// no download of it can be joined asks the other caches of the Fanout
// (with the same HTTP client) whether their pools hold a base published
// with a marker of that digest (one listing each, at once, bounded by
// 2 s). A peer is a source like the mirror: the download it starts reads
// one of them — the mirror's GET, or StorageVolDownload of a peer's base
// on a dedicated connection to the peer's host — and every cache going
// cold for the image meanwhile joins that one download, through the same
// window and detach rules: one stream from one source, never a copy per
// cache through one peer's link. Its Base.Source is imagecache.SourcePeer
// when a peer fed it. What each host publishes is still the digest of what
// it read back from its own volume, which must equal the configured one.
//
// A host never copies from itself over the network: a base of the digest
// in a pool of the cold cache's own libvirtd is copied inside the host
// (StorageVolCreateXMLFrom) for a raw image, then read back and checked
// as any transfer is; a qcow2 base is not, because libvirt copies a volume
// it sees as qcow2 through qemu-img convert, whose bytes differ from the
// image's. Nor is a peer on the host of any cache going cold for the image
// a candidate: that host's link carries its own cache's transfer, and its
// cache would need a second source. A cache of such a host that joins a
// download reading its host makes the download switch to another source.
//
// Choosing: a download starts from the candidate whose link was not
// measured yet (peers first, then the mirror) or has the best recent rate,
// measures it for SwitchAfter, and switches to another candidate not known
// to be slower (resuming at the byte it reached, by Range or at that
// offset, keeping what was written) when its readers waited for the
// source at least two thirds of that time; after the next SwitchAfter it
// goes back if the new source is clearly slower. A source whose stream
// fails is switched away from at once; a peer whose stream failed is not
// a candidate for a minute. Rates are remembered per link — the mirror's
// host, a peer's host — for ten minutes. Bytes that do not hash to the
// digest at the end, or any other failure of a fetch a peer fed, fall back
// to the mirror alone within the same fetch, so a peer's fault never
// fails a fetch nor makes it Permanent. FanoutOptions.MirrorOnly turns
// peers off.
//
// A Fanout is safe for concurrent use and needs no Close: a download's
// goroutine ends with the download, and the last fetch to leave waits for
// it. Caches join it in New and leave it in Close.
type Fanout struct {
	opts FanoutOptions

	mu  sync.Mutex
	dls map[fanKey]*download
	// coming counts, per key, the Ensures of caches of this Fanout that
	// may still join a download of it (see expect).
	coming map[fanKey]*atomic.Int64
	// chunks counts the window chunks ever allocated (tests check that
	// memory is bounded by the window, not the image or the fetches).
	chunks atomic.Int64

	// pmu guards the caches of this Fanout (peers of each other), what it
	// learnt of the links it read (source.go) and the caches fetching
	// each key now. Lock order: mu, then a download's mu, then pmu.
	pmu    sync.Mutex
	caches []*Cache
	links  map[string]*linkStats
	cold   map[fanKey]map[*Cache]int
}

type fanKey struct {
	url, sha256 string
	client      *http.Client
}

var (
	processFanout     *Fanout
	processFanoutOnce sync.Once
	// fanoutClient is the HTTP client of caches with a Fanout and no
	// Config.HTTPClient, so that such caches share downloads (a client per
	// cache would make every key different).
	fanoutClient = &http.Client{}
)

// ProcessFanout returns the Fanout of this process (default options), to
// give every cache's Config.Fanout so that all of them share downloads.
func ProcessFanout() *Fanout {
	processFanoutOnce.Do(func() { processFanout = NewFanout(FanoutOptions{}) })
	return processFanout
}

// NewFanout returns a Fanout with opts (zero fields: defaults).
func NewFanout(opts FanoutOptions) *Fanout {
	if opts.JoinWindow <= 0 {
		opts.JoinWindow = time.Second
	}
	if opts.Chunk <= 0 {
		opts.Chunk = 256 << 10
	}
	if opts.Window <= 0 {
		opts.Window = 8 << 20
	}
	if opts.Window < int64(opts.Chunk) {
		opts.Window = int64(opts.Chunk)
	}
	if opts.DetachAfter <= 0 {
		opts.DetachAfter = 2 * time.Second
	}
	if opts.SwitchAfter <= 0 {
		opts.SwitchAfter = 3 * time.Second
	}
	return &Fanout{opts: opts, dls: map[fanKey]*download{}, coming: map[fanKey]*atomic.Int64{}}
}

// comingLocked is key's counter of expected joiners.
func (f *Fanout) comingLocked(key fanKey) *atomic.Int64 {
	n := f.coming[key]
	if n == nil {
		n = new(atomic.Int64)
		f.coming[key] = n
	}
	return n
}

// arrivalKey carries, in the context of an Ensure's flight, the func that
// tells its Fanout the flight has reached its GET (or ended).
type arrivalKey struct{}

// expect notes that a cache's Ensure of key is under way and may reach a
// GET soon: until arrived is called (by Fanout.get once the fetch joined
// or started a download, else when the flight ends; more calls do
// nothing), a download of key whose window fills up before JoinWindow
// keeps byte 0 for it and waits, instead of giving byte 0 up. So a fetch
// alone never waits for joiners that are not coming.
func (f *Fanout) expect(key fanKey) (arrived func()) {
	f.mu.Lock()
	n := f.comingLocked(key)
	n.Add(1)
	f.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			n.Add(-1)
			f.mu.Lock()
			d := f.dls[key]
			f.mu.Unlock()
			if d != nil {
				d.mu.Lock()
				d.broadcastLocked()
				d.mu.Unlock()
			}
		})
	}
}

// readAhead bounds how far the download reads ahead of the fetch that is
// furthest into it: a fetch alone holds a few chunks, not the window (the
// window is for the spread between fetches and for keeping byte 0).
func (f *Fanout) readAhead() int64 { return min(f.opts.Window, 4*int64(f.opts.Chunk)) }

// joinKeep is how much of its first bytes a download keeps for JoinWindow
// when no fetch is known to be on its way (2 MiB by default), for a fetch
// whose Ensure starts a little later.
func (f *Fanout) joinKeep() int64 { return min(f.opts.Window, 8*int64(f.opts.Chunk)) }

// download is one shared download of an image, from one source at a time
// (source.go).
type download struct {
	f      *Fanout
	key    fanKey
	coming *atomic.Int64 // the Fanout's count of expected joiners of key
	client *http.Client
	start  time.Time
	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{} // the pump has returned
	ready  chan struct{} // resp or err is set
	req    *http.Request // the mirror's request, under ctx
	log    logr.Logger   // the starting cache's: source switches
	cands  []*source     // the sources it may read, in the order chosen

	mu   sync.Mutex
	resp *http.Response // the headers; the body is the pump's
	err  error          // the GET failed
	// bufs hold bytes [base, head): every chunk but the last is full.
	bufs    [][]byte
	base    int64
	head    int64
	end     error // io.EOF or the body's error, once it ended
	members map[*member]bool
	changed chan struct{} // closed and replaced on every change
	free    [][]byte
	gone    bool // no more joins
	// fullSince: since when a member keeps the window full (zero: not).
	fullSince time.Time
	// holdOver: byte 0 has left the window; nobody joins any more.
	holdOver bool

	total     int64         // the image's size as the first source announced (-1: unknown)
	validator string        // the mirror's, once it answered: for a Range later
	cur       *source       // the source being read
	body      io.ReadCloser // cur's body while the pump reads it (closed to switch)
	switchTo  *source       // a switch asked for: the pump reopens there at head
	why       string        // the reason of switchTo, for the log
	prev      *source       // the source cur was tried against (decideLocked)
	switches  int
	avoid     []*Cache  // caches reading it: no peer on their hosts
	segs      []segment // which source fed which bytes
	g         gauge     // cur's measurement
}

// member is one fetch reading a download.
type member struct {
	off      int64
	detached bool
}

// get is HTTPClient.Do(req) through the Fanout for c's fetch of key: it
// joins a download of key when one can be joined, or starts one whose
// sources are peers (published bases on other hosts) and the mirror (see
// candidates); with mirrorOnly it joins only a download that reads the
// mirror alone, and starts one that does. The returned body says, once
// read, where its bytes came from.
func (f *Fanout) get(c *Cache, key fanKey, req *http.Request, peers []*peerBase, mirrorOnly bool) (*http.Response, *fanBody, error) {
	f.mu.Lock()
	d := f.dls[key]
	src := imagecache.SourceShared
	var m *member
	var stale io.Closer
	if d != nil && (!mirrorOnly || len(d.cands) == 1) {
		m, stale = d.join(c)
	}
	if m == nil {
		src = imagecache.SourceMirror
		cands := []*source{mirrorSource(key.url)}
		if !mirrorOnly {
			cands = f.candidates(key, peers)
		}
		d, m = f.startDownload(c, key, req, cands)
		f.dls[key] = d
	}
	f.mu.Unlock()
	if stale != nil {
		_ = stale.Close() // the source on c's host: the pump switches
	}
	if arrived, ok := req.Context().Value(arrivalKey{}).(func()); ok {
		arrived()
	}

	body := &fanBody{d: d, m: m, req: req, src: src}
	body.ctx, body.cancel = context.WithCancel(req.Context())
	select {
	case <-d.ready:
	case <-body.ctx.Done():
		_ = body.Close()
		// Shaped as net/http's error of a GET given up (fetchOnce
		// redacts the URL).
		return nil, nil, &url.Error{Op: "Get", URL: redact.URL(req.URL.String()), Err: req.Context().Err()}
	}
	if d.err != nil {
		_ = body.Close()
		return nil, nil, d.err
	}
	r := d.resp
	resp := &http.Response{
		Status: r.Status, StatusCode: r.StatusCode,
		Proto: r.Proto, ProtoMajor: r.ProtoMajor, ProtoMinor: r.ProtoMinor,
		Header: r.Header.Clone(), ContentLength: r.ContentLength,
		TransferEncoding: r.TransferEncoding, Uncompressed: r.Uncompressed,
		TLS: r.TLS, Request: req, Body: body,
	}
	body.total = r.ContentLength
	body.ranges = strings.EqualFold(strings.TrimSpace(r.Header.Get("Accept-Ranges")), "bytes")
	body.validator = validatorOf(r)
	if body.validator == "" && r.Request != nil {
		// The mirror's own answer without a validator: a full GET after
		// detaching must start with the same bytes. (An answer made up
		// for a peer's base has no Request: its image has a configured
		// digest, which decides.)
		body.prefix = sha256.New()
	}
	return resp, body, nil
}

// startDownload starts a download of key reading cands (the first usable
// one first) with its first member, c's: the member is in before the
// pump starts, so that a body the pump reads to its end (or trims) before
// the caller gets to read is still the caller's.
func (f *Fanout) startDownload(c *Cache, key fanKey, req *http.Request, cands []*source) (*download, *member) {
	ctx, cancel := context.WithCancel(context.WithoutCancel(req.Context()))
	m := &member{}
	d := &download{
		f: f, key: key, client: key.client, start: time.Now(), ctx: ctx, cancel: cancel, coming: f.comingLocked(key),
		done: make(chan struct{}), ready: make(chan struct{}), req: req.Clone(ctx), log: c.log, cands: cands,
		members: map[*member]bool{m: true}, changed: make(chan struct{}), total: -1, avoid: []*Cache{c},
	}
	go d.pump()
	return d, m
}

// validatorOf is what identifies the version of r's resource: its strong
// ETag, else its Last-Modified ("" for neither).
func validatorOf(r *http.Response) string {
	if et := r.Header.Get("ETag"); et != "" && !strings.HasPrefix(et, "W/") {
		return et
	}
	return r.Header.Get("Last-Modified")
}

// join adds c's member reading from byte 0, or returns nil when byte 0 is
// gone or the download ended. A download reading a peer on c's host
// switches to another source (c never copies from its own host over the
// network): the returned closer, to close once the Fanout's lock is let
// go, ends the peer's stream; when there is no other source, c does not
// join.
func (d *download) join(c *Cache) (*member, io.Closer) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.gone || d.base > 0 {
		return nil, nil
	}
	d.avoid = append(d.avoid, c)
	var stale io.Closer
	if s := d.cur; s != nil && s.peer != nil && c.sameHost(s.peer.pool.UUID) && d.switchTo == nil {
		next := d.nextUsableLocked()
		if next == nil {
			d.avoid = d.avoid[:len(d.avoid)-1]
			return nil, nil
		}
		d.switchTo, d.why = next, fmt.Sprintf("a cache of %s's host (%s) joined", s, c.cfg.Entry)
		if d.body != nil {
			stale = d.body
		}
	}
	m := &member{}
	d.members[m] = true
	d.broadcastLocked()
	return m, stale
}

func (d *download) broadcastLocked() {
	close(d.changed)
	d.changed = make(chan struct{})
}

// leave removes m; the last member to leave a running download cancels it
// and waits for its goroutine.
func (d *download) leave(m *member) {
	d.mu.Lock()
	delete(d.members, m)
	last := len(d.members) == 0 && !d.gone
	if last {
		d.gone = true
	}
	d.broadcastLocked()
	d.mu.Unlock()
	if last {
		d.cancel()
		<-d.done
	}
}

// pump reads the download's sources into the window until the image
// ended or every member left: the first usable candidate, then, when a
// source fails or a switch is asked for (decideLocked, join), the next
// one from the head on.
func (d *download) pump() {
	defer close(d.done)
	defer d.drop()
	if len(d.cands) > 1 {
		defer d.watch()()
	}
	for {
		src := d.nextSource()
		if src == nil {
			d.fail(errors.New("no source of the image is left"))
			return
		}
		body, err := d.open(src)
		if err == nil {
			err = d.fill(src, body)
			_ = body.Close()
			if err == nil {
				return
			}
		}
		if !d.again(src, err) {
			d.fail(err)
			return
		}
	}
}

// nextSource is the source to read next: the first usable candidate at
// the start, else the one a switch asked for (another usable one when it
// is not usable any more). It logs a switch.
func (d *download) nextSource() *source {
	d.mu.Lock()
	defer d.mu.Unlock()
	src := d.switchTo
	if d.cur == nil {
		src = d.cands[0]
	}
	if src != nil && !d.usableLocked(src) {
		src = d.nextUsableLocked()
	}
	if src == nil {
		return nil
	}
	if d.cur != nil {
		d.switches++
		d.log.Info("switching source", "from", d.cur.String(), "to", src.String(), "bytes", d.head, "reason", d.why)
	}
	d.cur, d.switchTo, d.why = src, nil, ""
	src.opened++
	d.g = gauge{waiting: d.g.waiting}
	return src
}

// open starts reading src at the download's head. The first source's
// answer is the download's response: the mirror's to the GET, or for a
// peer one made up of its base's size (200, Content-Length). A later one
// continues where the download is: a Range request to the mirror
// (openMirrorAt), a peer's stream from that offset.
func (d *download) open(src *source) (io.ReadCloser, error) {
	d.mu.Lock()
	first, off, total := d.resp == nil, d.head, d.total
	d.mu.Unlock()
	if src.peer != nil {
		if total >= 0 && src.peer.size != total {
			return nil, fmt.Errorf("%s's base holds %d bytes, the image %d", src, src.peer.size, total)
		}
		body := src.peer.c.stream(d.ctx, d.f, src, off)
		if first {
			d.respond(&http.Response{
				Status: "200 OK", StatusCode: http.StatusOK, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
				Header: http.Header{}, ContentLength: src.peer.size,
			})
		}
		return body, nil
	}
	if first {
		resp, err := d.client.Do(d.req)
		if err != nil {
			return nil, err
		}
		d.respond(resp)
		return resp.Body, nil
	}
	return d.openMirrorAt(d.ctx, off, total)
}

// respond makes resp the download's response.
func (d *download) respond(resp *http.Response) {
	d.mu.Lock()
	d.resp, d.total = resp, resp.ContentLength
	if resp.Request != nil {
		d.validator = validatorOf(resp)
	}
	d.mu.Unlock()
	close(d.ready)
}

// openMirrorAt GETs the image from the mirror from off on under ctx,
// after another source fed [0, off): a Range request (If-Range with the
// mirror's validator when it answered one before) answered 206 from off,
// or a 200 whose first off bytes are skipped; either of the image's total
// size when it is known. The image has a configured digest (a peer was a
// source), which decides whether the two sources served the same bytes.
func (d *download) openMirrorAt(ctx context.Context, off, total int64) (io.ReadCloser, error) {
	r := d.req.Clone(ctx)
	d.mu.Lock()
	validator := d.validator
	d.mu.Unlock()
	if off > 0 {
		r.Header.Set("Range", fmt.Sprintf("bytes=%d-", off))
		if validator != "" {
			r.Header.Set("If-Range", validator)
		}
	}
	resp, err := d.client.Do(r)
	if err != nil {
		return nil, err
	}
	if resp.Request != nil && validator == "" {
		d.mu.Lock()
		d.validator = validatorOf(resp)
		d.mu.Unlock()
	}
	switch {
	case off > 0 && resp.StatusCode == http.StatusPartialContent:
		cr := resp.Header.Get("Content-Range")
		want := fmt.Sprintf("bytes %d-", off)
		if !strings.HasPrefix(cr, want) || (total >= 0 && !strings.HasSuffix(cr, fmt.Sprintf("/%d", total))) {
			_ = resp.Body.Close()
			return nil, fmt.Errorf("the mirror answered the range from %d with Content-Range %q", off, serverText(cr, d.key.url))
		}
		return resp.Body, nil
	case resp.StatusCode == http.StatusOK:
		if total >= 0 && resp.ContentLength >= 0 && resp.ContentLength != total {
			_ = resp.Body.Close()
			return nil, fmt.Errorf("the mirror serves %d bytes, the image has %d", resp.ContentLength, total)
		}
		if _, err := io.CopyN(io.Discard, resp.Body, off); err != nil {
			_ = resp.Body.Close()
			return nil, fmt.Errorf("skipping the %d bytes already read: %w", off, err)
		}
		return resp.Body, nil
	}
	_ = resp.Body.Close()
	return nil, fmt.Errorf("GET from byte %d: %s", off, serverText(resp.Status, d.key.url))
}

// fill reads body (src's) into the window until it ends (nil: the image
// is complete), fails, a switch is asked for (errSwitch) or every member
// left (the download's context error).
func (d *download) fill(src *source, body io.ReadCloser) error {
	d.mu.Lock()
	d.body = body
	d.mu.Unlock()
	for {
		buf, err := d.room()
		if err != nil {
			return err
		}
		d.mu.Lock()
		if d.switchTo != nil {
			d.body = nil
			d.mu.Unlock()
			return errSwitch
		}
		d.g.reading = true
		d.g.account(time.Now())
		d.mu.Unlock()
		n, rerr := body.Read(buf)
		now := time.Now()
		d.mu.Lock()
		d.g.reading = false
		d.g.account(now)
		if n > 0 {
			d.wroteLocked(src, n, now)
		}
		if errors.Is(rerr, io.EOF) {
			d.noteEndLocked(now)
			d.end, d.gone, d.body = io.EOF, true, nil
			d.broadcastLocked()
			d.mu.Unlock()
			return nil
		}
		if rerr != nil {
			d.body = nil
			if d.switchTo != nil {
				rerr = errSwitch
			}
			d.mu.Unlock()
			return rerr
		}
		d.broadcastLocked()
		d.mu.Unlock()
	}
}

// errSwitch ends fill when a switch was asked for.
var errSwitch = errors.New("switching source")

// wroteLocked adds the n bytes src gave to the window, the segments and
// the measurement.
func (d *download) wroteLocked(src *source, n int, now time.Time) {
	last := len(d.bufs) - 1
	d.bufs[last] = d.bufs[last][:len(d.bufs[last])+n]
	if k := len(d.segs); k == 0 || d.segs[k-1].src != src {
		d.segs = append(d.segs, segment{from: d.head, src: src})
	}
	d.head += int64(n)
	if d.g.since.IsZero() {
		d.g.since, d.g.mark, d.g.starved = now, now, 0
	}
	d.g.bytes += int64(n)
}

// noteEndLocked records the rate of the source that read the end, when it
// was read long enough since it was last measured to mean something.
func (d *download) noteEndLocked(now time.Time) {
	g := &d.g
	if d.cur == nil || g.since.IsZero() {
		return
	}
	g.account(now)
	el := now.Sub(g.since)
	if el <= 0 || (d.cur.rate > 0 && el < d.f.opts.SwitchAfter/2) {
		return
	}
	d.f.noteRate(d.cur.link, float64(g.bytes)/el.Seconds(), 3*g.starved >= 2*el)
}

// again decides, after src's body ended with err, whether the download
// goes on from another source: the one a switch asked for, or, when src
// failed (noted for its link when it is a peer's), the next usable
// candidate.
func (d *download) again(src *source, err error) bool {
	if d.ctx.Err() != nil {
		return false
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.switchTo != nil {
		return true
	}
	src.failed = true
	if src.peer != nil {
		d.f.noteFailed(src.link)
	}
	next := d.nextUsableLocked()
	if next == nil {
		return false
	}
	d.switchTo, d.why = next, fmt.Sprintf("%s failed: %s", src, redact.Text(err.Error(), d.key.url))
	return true
}

// fail ends the download with err: before its response, every fetch gets
// err from its GET; after it, err is the body's error.
func (d *download) fail(err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.resp == nil && d.err == nil {
		d.err = err
		close(d.ready)
	}
	if d.end == nil {
		d.end = err
	}
	d.gone = true
	d.broadcastLocked()
}

// watch weighs switching sources every SwitchAfter/4 (look) until the
// returned func stops it, and waits for it.
func (d *download) watch() (stop func()) {
	quit, ended := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(ended)
		t := time.NewTicker(max(d.f.opts.SwitchAfter/4, time.Millisecond))
		defer t.Stop()
		for {
			select {
			case <-quit:
				return
			case <-d.ctx.Done():
				return
			case now := <-t.C:
				d.look(now)
			}
		}
	}()
	return func() { close(quit); <-ended }
}

// look asks for a switch when decideLocked finds one: the current body is
// closed, which ends the pump's Read.
func (d *download) look(now time.Time) {
	d.mu.Lock()
	next, why := d.decideLocked(now)
	var body io.Closer
	if next != nil {
		d.switchTo, d.why, body = next, why, d.body
	}
	d.mu.Unlock()
	if body != nil {
		_ = body.Close()
	}
}

// drop removes d from its Fanout (no more joins).
func (d *download) drop() {
	d.f.mu.Lock()
	if d.f.dls[d.key] == d {
		delete(d.f.dls, d.key)
	}
	d.f.mu.Unlock()
}

// room waits until the window has room and returns the space to read the
// next bytes into. It detaches the members that keep the window full for
// DetachAfter while another member is ahead of them.
func (d *download) room() ([]byte, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for {
		if err := d.ctx.Err(); err != nil {
			return nil, err
		}
		now := time.Now()
		w := d.windowLocked(now)
		if d.head-w.tail < d.f.opts.Window && d.head-w.maxOff < d.f.readAhead() {
			d.fullSince = time.Time{}
			return d.spaceLocked(), nil
		}
		wait, detached := d.fullLocked(w, now)
		if detached {
			continue
		}
		d.sleepLocked(wait)
	}
}

// window is where a download's members are at one instant, and what it
// keeps.
type window struct {
	minOff, maxOff int64 // the offsets of the members furthest behind and ahead
	hold           bool  // byte 0 is kept for joiners
	tail           int64 // the first byte kept
}

// windowLocked reads the window at now and recycles the chunks before its
// tail.
func (d *download) windowLocked(now time.Time) window {
	w := window{minOff: d.head}
	for m := range d.members {
		w.minOff, w.maxOff = min(w.minOff, m.off), max(w.maxOff, m.off)
	}
	if len(d.members) == 0 {
		w.maxOff = 0 // nobody reads yet: read ahead of byte 0 only
	}
	// Byte 0 is kept for joiners for JoinWindow: up to the whole window
	// (waiting when it is full) while one is on its way (an Ensure of the
	// image under way that has not reached its GET), else only up to
	// joinKeep bytes, never waiting: a fetch alone keeps at most joinKeep
	// behind it, for a fetch that has not started yet.
	w.hold = !d.holdOver && now.Sub(d.start) < d.f.opts.JoinWindow
	if w.hold && d.head >= d.f.joinKeep() && d.coming.Load() == 0 {
		w.hold = false
	}
	w.tail = w.minOff
	if w.hold {
		w.tail = 0
	}
	d.trimLocked(w.tail)
	if d.base > 0 {
		d.holdOver = true // byte 0 is gone: no more joins
	}
	return w
}

// spaceLocked returns the space the next bytes are read into: the rest of
// the last chunk, else a new chunk (a recycled one when there is one).
func (d *download) spaceLocked() []byte {
	if n := len(d.bufs); n > 0 && len(d.bufs[n-1]) < cap(d.bufs[n-1]) {
		b := d.bufs[n-1]
		return b[len(b):cap(b)]
	}
	var b []byte
	if k := len(d.free); k > 0 {
		b, d.free = d.free[k-1][:0], d.free[:k-1]
	} else {
		b = make([]byte, 0, d.f.opts.Chunk)
		d.f.chunks.Add(1)
	}
	d.bufs = append(d.bufs, b)
	return b[:cap(b)][:d.f.opts.Chunk]
}

// fullLocked decides what a full window w waits for: when a member is a
// window behind another, the end of DetachAfter since it became so, after
// which the members furthest behind are detached (detached: look again at
// once); when byte 0 is kept for a joiner on its way, the joiner (its
// arrival, or its flight ending, wakes room) or at most the end of
// JoinWindow; else the next change (wait 0).
func (d *download) fullLocked(w window, now time.Time) (wait time.Duration, detached bool) {
	o := d.f.opts
	switch {
	case d.head-w.minOff >= o.Window && w.maxOff > w.minOff:
		if d.fullSince.IsZero() {
			d.fullSince = now
		}
		if now.Sub(d.fullSince) < o.DetachAfter {
			return d.fullSince.Add(o.DetachAfter).Sub(now), false
		}
		for m := range d.members {
			if m.off == w.minOff {
				m.detached = true
				delete(d.members, m)
			}
		}
		d.fullSince = time.Time{}
		d.broadcastLocked()
		return 0, true
	case w.hold && d.head >= o.Window:
		d.fullSince = time.Time{}
		return d.start.Add(o.JoinWindow).Sub(now), false
	}
	d.fullSince = time.Time{}
	return 0, false
}

// sleepLocked waits, with d.mu released, for the next change, for wait
// when it is positive, or for the download's end.
func (d *download) sleepLocked(wait time.Duration) {
	ch := d.changed
	d.mu.Unlock()
	defer d.mu.Lock()
	var tc <-chan time.Time
	if wait > 0 {
		t := time.NewTimer(wait)
		defer t.Stop()
		tc = t.C
	}
	select {
	case <-ch:
	case <-tc:
	case <-d.ctx.Done():
	}
}

// trimLocked recycles the chunks wholly before tail.
func (d *download) trimLocked(tail int64) {
	chunk := int64(d.f.opts.Chunk)
	for len(d.bufs) > 1 && d.base+chunk <= tail {
		d.free = append(d.free, d.bufs[0])
		d.bufs[0] = nil
		d.bufs = d.bufs[1:]
		d.base += chunk
	}
}

// copyAtLocked copies bytes from offset off (base <= off < head) into p.
func (d *download) copyAtLocked(p []byte, off int64) int {
	chunk := int64(d.f.opts.Chunk)
	i, j := (off-d.base)/chunk, (off-d.base)%chunk
	return copy(p, d.bufs[i][j:])
}

// fanBody is one fetch's body of a shared download.
type fanBody struct {
	d      *download
	m      *member
	req    *http.Request
	ctx    context.Context // req's, ended by Close too
	cancel context.CancelFunc
	src    string

	total     int64
	ranges    bool
	validator string // the shared response's ETag (strong) or Last-Modified
	// prefix hashes the bytes read from the shared download when the
	// response had no validator: a full GET after detaching must start
	// with the same bytes (else the image changed on the mirror).
	prefix hash.Hash

	mu         sync.Mutex
	own        io.ReadCloser // after detaching
	ownPeer    string        // the peer own reads, "" for the mirror
	detachedAt int64         // the offset own starts at
	closed     bool
}

var errBodyClosed = errors.New("http: read on closed response body")

// source is Base.Source for this fetch, once its bytes were read: detached
// when it finished on a download of its own; else the kind of the one
// source that fed the download up to where it read (mirror or shared for
// the mirror, as it started the download or joined it; peer for a peer's
// base), or, when the download switched, the kinds in order joined by
// "+" ("peer+mirror").
func (b *fanBody) source() string {
	b.mu.Lock()
	own := b.own
	b.mu.Unlock()
	if own != nil {
		return imagecache.SourceDetached
	}
	kinds, _ := b.sources()
	switch {
	case len(kinds) > 1:
		return switchedName(kinds)
	case len(kinds) == 1 && kinds[0] == imagecache.SourcePeer:
		return imagecache.SourcePeer
	}
	return b.src
}

// sources are the kinds of the sources that fed what this fetch read from
// the download, and the first peer among them.
func (b *fanBody) sources() ([]string, string) {
	d := b.d
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.sourcesLocked(b.m.off)
}

// bytesBy splits this fetch's first n bytes by the source that fed them:
// up to where it was detached (all of them when it was not), the
// download's sources — a peer's bytes as peer, the mirror's as mirror when
// this fetch started the download, else as shared — and after that, its
// own stream's, as detached.
func (b *fanBody) bytesBy(n int64) (by sourceBytes) {
	b.mu.Lock()
	shared := n
	if b.own != nil {
		shared = min(n, b.detachedAt)
	}
	b.mu.Unlock()
	by[srcDetached] = n - shared
	mirror := srcShared
	if b.src == imagecache.SourceMirror {
		mirror = srcMirror
	}
	d := b.d
	d.mu.Lock()
	defer d.mu.Unlock()
	// Every byte read from the download is in a segment; should one not
	// be, it counts as the mirror's, so that the split adds up to n.
	rest := shared
	for i, sg := range d.segs {
		if sg.from >= shared {
			break
		}
		end := shared
		if i+1 < len(d.segs) {
			end = min(end, d.segs[i+1].from)
		}
		k := mirror
		if sg.src.peer != nil {
			k = srcPeer
		}
		by[k] += end - sg.from
		rest -= end - sg.from
	}
	by[mirror] += rest
	return by
}

// peer is the entry of the peer that fed this fetch ("" for none).
func (b *fanBody) peer() string {
	b.mu.Lock()
	own := b.ownPeer
	b.mu.Unlock()
	if _, p := b.sources(); p != "" {
		return p
	}
	return own
}

// peerFault notes, for the Fanout, every peer opened for this fetch as
// failed (see Fanout.noteFailed).
func (b *fanBody) peerFault() {
	b.mu.Lock()
	own := b.ownPeer
	b.mu.Unlock()
	d := b.d
	d.mu.Lock()
	var links []string
	for _, s := range d.cands {
		if s.peer != nil && (s.opened > 0 || s.peer.c.cfg.Entry == own) {
			links = append(links, s.link)
		}
	}
	d.mu.Unlock()
	for _, l := range links {
		d.f.noteFailed(l)
	}
}

// triedPeer reports whether a peer was opened for this fetch (the
// download's source, or its own stream after detaching).
func (b *fanBody) triedPeer() bool {
	b.mu.Lock()
	own := b.ownPeer
	b.mu.Unlock()
	if own != "" {
		return true
	}
	d := b.d
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, s := range d.cands {
		if s.peer != nil && s.opened > 0 {
			return true
		}
	}
	return false
}

func (b *fanBody) Read(p []byte) (int, error) {
	b.mu.Lock()
	own, closed := b.own, b.closed
	b.mu.Unlock()
	if closed {
		return 0, errBodyClosed
	}
	if own != nil {
		return own.Read(p)
	}
	d := b.d
	for {
		d.mu.Lock()
		if b.m.detached {
			off := b.m.off
			d.mu.Unlock()
			return b.resume(p, off)
		}
		if b.m.off < d.head {
			n := d.copyAtLocked(p, b.m.off)
			b.m.off += int64(n)
			d.broadcastLocked()
			d.mu.Unlock()
			if b.prefix != nil {
				b.prefix.Write(p[:n])
			}
			return n, nil
		}
		if d.end != nil {
			err := d.end
			d.mu.Unlock()
			if errors.Is(err, context.Canceled) && b.ctx.Err() != nil {
				err = b.ctx.Err()
			}
			return 0, err
		}
		// At the head: waiting for the source (gauge).
		ch := d.changed
		d.g.waiting++
		d.g.account(time.Now())
		d.mu.Unlock()
		select {
		case <-ch:
		case <-b.ctx.Done():
		}
		d.mu.Lock()
		d.g.waiting--
		d.g.account(time.Now())
		d.mu.Unlock()
		if err := b.ctx.Err(); err != nil {
			b.mu.Lock()
			closed := b.closed
			b.mu.Unlock()
			if closed {
				return 0, errBodyClosed
			}
			return 0, err
		}
	}
}

// resume opens this fetch's own download from off and reads from it.
func (b *fanBody) resume(p []byte, off int64) (int, error) {
	own, err := b.open(off)
	if err != nil {
		// net/http's errors name the URL: redacted here, since the
		// upload's errors are logged before fetch's own redaction.
		return 0, fmt.Errorf("detached from the shared download after %d bytes: %w", off, redact.Err(err, b.d.key.url))
	}
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		_ = own.Close()
		return 0, errBodyClosed
	}
	b.own, b.detachedAt = own, off
	b.mu.Unlock()
	b.d.leave(b.m) // already detached: only wakes the others
	return own.Read(p)
}

// open continues this fetch from off on a stream of its own, from the
// source the download reads now. From a peer: its base from off. From the
// mirror: a Range request with If-Range when the shared response
// announced byte ranges and a validator, else a full GET whose first off
// bytes are skipped — or, when the download's response was made up for a
// peer's base (the image has a configured digest, which decides), as the
// download itself continues on the mirror (openMirrorAt).
func (b *fanBody) open(off int64) (io.ReadCloser, error) {
	d := b.d
	d.mu.Lock()
	src := d.cur
	d.mu.Unlock()
	if src != nil && src.peer != nil {
		b.mu.Lock()
		b.ownPeer = src.peer.c.cfg.Entry
		b.mu.Unlock()
		return src.peer.c.stream(b.ctx, d.f, src, off), nil
	}
	if b.validator == "" && b.prefix == nil {
		return d.openMirrorAt(b.ctx, off, b.total)
	}
	r := b.req.Clone(b.ctx)
	ranged := off > 0 && b.ranges && b.validator != ""
	if ranged {
		r.Header.Set("Range", fmt.Sprintf("bytes=%d-", off))
		r.Header.Set("If-Range", b.validator)
	}
	resp, err := b.d.client.Do(r)
	if err != nil {
		return nil, err
	}
	switch {
	case ranged && resp.StatusCode == http.StatusPartialContent:
		if cr := resp.Header.Get("Content-Range"); !strings.HasPrefix(cr, fmt.Sprintf("bytes %d-", off)) {
			_ = resp.Body.Close()
			return nil, fmt.Errorf("the server answered the range from %d with Content-Range %q", off, serverText(cr, b.d.key.url))
		}
		return resp.Body, nil
	case resp.StatusCode == http.StatusOK:
		// The whole image again (no ranges, or If-Range found another
		// version): only the same version may continue what was read.
		if err := b.sameImage(resp, off); err != nil {
			_ = resp.Body.Close()
			return nil, err
		}
		return resp.Body, nil
	}
	_ = resp.Body.Close()
	return nil, fmt.Errorf("GET: %s", serverText(resp.Status, b.d.key.url))
}

// sameImage checks that resp (a 200 after detaching) serves the image the
// shared download served, and consumes its first off bytes: the same
// validator, or without one the same first bytes (hashed); the same
// length either way. Otherwise the image changed on the mirror during the
// fetch, and continuing would splice two versions.
func (b *fanBody) sameImage(resp *http.Response, off int64) error {
	if b.total >= 0 && resp.ContentLength >= 0 && resp.ContentLength != b.total {
		return fmt.Errorf("the image changed on the mirror during the fetch: %d bytes now, %d before", resp.ContentLength, b.total)
	}
	if b.validator != "" {
		if v := validatorOf(resp); v != b.validator {
			return fmt.Errorf("the image changed on the mirror during the fetch: validator %q now, %q before", serverText(v, b.d.key.url), serverText(b.validator, b.d.key.url))
		}
		if _, err := io.CopyN(io.Discard, resp.Body, off); err != nil {
			return fmt.Errorf("skipping the %d bytes already read: %w", off, err)
		}
		return nil
	}
	h := sha256.New()
	if _, err := io.CopyN(h, resp.Body, off); err != nil {
		return fmt.Errorf("skipping the %d bytes already read: %w", off, err)
	}
	if !bytes.Equal(h.Sum(nil), b.prefix.Sum(nil)) {
		return fmt.Errorf("the image changed on the mirror during the fetch: its first %d bytes differ", off)
	}
	return nil
}

// Close leaves the shared download (the others go on) and unblocks a Read
// in progress.
func (b *fanBody) Close() error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	b.closed = true
	own := b.own
	b.mu.Unlock()
	b.cancel()
	if own != nil {
		_ = own.Close()
	}
	b.d.leave(b.m)
	return nil
}
