package basecache

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/testing/eventually"
	"github.com/egressproxy/egressproxy/internal/testing/libvirtfake"
	"github.com/go-logr/logr/funcr"
)

// The rules of a shared download's sources (source.go): one source for
// every cache going cold for an image at once, never a copy of a host's
// own base over the network, and a switch away from a source that holds
// the readers back that keeps what was written.

// reads counts the StorageVolDownload calls of volume vol on h (a read of
// that base, as opposed to a cache's read-back of its own volume).
func reads(h *libvirtfake.Host, vol string) int {
	n := 0
	for _, c := range h.Log() {
		if c.Method == "StorageVolDownload" && c.Volume == vol {
			n++
		}
	}
	return n
}

// creations counts the StorageVolCreateXML calls of volume vol on h.
func creations(h *libvirtfake.Host, vol string) int {
	n := 0
	for _, c := range h.Log() {
		if c.Method == "StorageVolCreateXML" && c.Volume == vol {
			n++
		}
	}
	return n
}

// cacheOnHost returns a cache of entry on the fake host h (another entry
// of the same libvirtd), in pool (created with 64 MiB unless it is
// fakePool), with Fanout f.
func cacheOnHost(t *testing.T, h *libvirtfake.Host, entry, pool string, f *Fanout, mod func(*Config)) *Cache {
	t.Helper()
	if pool != fakePool {
		if err := h.AddPool(pool, 64<<20); err != nil {
			t.Fatal(err)
		}
	}
	cfg := Config{Entry: entry, Pool: pool, StreamStall: 5 * time.Second, Fanout: f}
	if mod != nil {
		mod(&cfg)
	}
	c, err := New(fakeLink{h}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// rawImage is an image of n bytes that is not a qcow2 file (libvirt sees
// it as raw), and its sha256.
func rawImage(n int) ([]byte, string) {
	b, _ := testImage(n)
	copy(b, "RAW!")
	sum := sha256.Sum256(b)
	return b, hex.EncodeToString(sum[:])
}

// logLines is a logger that keeps every line.
type logLines struct {
	mu    sync.Mutex
	lines []string
}

func (l *logLines) add(prefix, args string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, args)
}

// with returns the lines containing s.
func (l *logLines) with(s string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, x := range l.lines {
		if strings.Contains(x, s) {
			out = append(out, x)
		}
	}
	return out
}

// Four hosts going cold at once beside one host holding the image read
// that host's base once: one stream, fanned out to all four through the
// window (each publishes the digest of its own read-back, source peer),
// and the mirror serves nothing. (A copy per cold host would read it four
// times through that host's link.)
func TestPeerOneSourceForColdCaches(t *testing.T) {
	cs, hs, srv, img, body := peerHosts(t, 5, nil)
	f := cs[0].cfg.Fanout
	peerVol := cs[0].BaseName(img)
	before := reads(hs[0], peerVol)
	// The peer's stream starts once all four read the download: a loaded
	// machine may start some Ensures late.
	hs[0].SetStreamHook("StorageVolDownload", func(c libvirtfake.Call) error {
		if c.Volume == peerVol && c.Done == 0 {
			waitMembers(f, 4)
		}
		return nil
	})
	bases, problems := ensureAll(t, cs[1:], img)
	for i, c := range cs[1:] {
		if problems[i] != nil {
			t.Fatalf("host %d: %v", i+1, problems[i])
		}
		wantPublished(t, c, hs[i+1], img, bases[i], body, img.SHA256)
		if bases[i].Source != imagecache.SourcePeer {
			t.Fatalf("host %d: source %q, want peer", i+1, bases[i].Source)
		}
	}
	if n := reads(hs[0], peerVol) - before; n != 1 {
		t.Fatalf("the peer's base was read %d times for 4 cold hosts, want once", n)
	}
	if g := srv.gets.Load(); g != 1 {
		t.Fatalf("%d GETs in all, want 1 (host 0's)", g)
	}
	if n := hs[0].OpenSessions(); n != 0 {
		t.Fatalf("%d dedicated sessions left open on the peer", n)
	}
}

// The fleet grows while one host already holds the image under another
// entry, and a cache of that very host goes cold too: that host is no
// source (its link carries its own cache's transfer, and its cache could
// not read it), so the four cold caches share one download of the mirror
// and the holder's base is never read. Host 0's cold cache is held in its
// claim until another cold cache's download has started, so that the
// download's choice knows host 0 is going cold.
func TestPeerNotFromAColdHost(t *testing.T) {
	body, sum := testImage(400 << 10)
	f := smallFanout()
	var gate atomic.Bool
	srv := serve(t, body, func(w http.ResponseWriter, r *http.Request) {
		if gate.Load() {
			waitMembers(f, 4)
		}
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		_, _ = w.Write(body)
	})
	cs, hs := fanHosts(t, 4, f, nil)
	img := imagecache.Image{Key: "k", URL: srv.url, SHA256: sum}
	if b, err := cs[0].Ensure(testCtx(t, 30*time.Second), img); err != nil || b.Source != imagecache.SourceMirror {
		t.Fatalf("holder: %+v, %v", b, err)
	}
	gate.Store(true)
	holderVol := cs[0].BaseName(img)
	before := reads(hs[0], holderVol)
	b0 := cacheOnHost(t, hs[0], "b0", fakePool, f, nil)
	claimed := newSignal()
	release := make(chan struct{})
	hs[0].SetHook("StorageVolCreateXML", func(c libvirtfake.Call) error {
		if strings.HasPrefix(c.Volume, "claim-b0--") {
			_ = claimed.seen(c)
			return c.Wait(release)
		}
		return nil
	})
	cold := []*Cache{b0, cs[1], cs[2], cs[3]}
	bases := make([]Base, 4)
	problems := make([]error, 4)
	var wg sync.WaitGroup
	wg.Go(func() { bases[0], problems[0] = b0.Ensure(testCtx(t, 30*time.Second), img) })
	if !claimed.within(10 * time.Second) {
		close(release)
		wg.Wait()
		t.Fatal("host 0's cold cache never took its claim")
	}
	for i := 1; i < 4; i++ {
		wg.Go(func() { bases[i], problems[i] = cold[i].Ensure(testCtx(t, 30*time.Second), img) })
	}
	select {
	case <-srv.first:
	case <-time.After(10 * time.Second):
		t.Error("no cold cache reached the mirror")
	}
	// The shared download has started (a GET after the holder's):
	// host 0's cache may go on and join it.
	eventually.True(t, 10*time.Second, func() bool { return srv.gets.Load() == 2 }, "the shared download's GET")
	close(release)
	wg.Wait()
	hosts := []*libvirtfake.Host{hs[0], hs[1], hs[2], hs[3]}
	for i, c := range cold {
		if problems[i] != nil {
			t.Fatalf("cold cache %d: %v", i, problems[i])
		}
		if b := bases[i]; b.Volume != c.BaseName(img) || b.Digest != sum {
			t.Fatalf("cold cache %d: %+v", i, b)
		}
		if got, _ := hosts[i].Volume(fakePool, bases[i].Volume); string(got.Data) != string(body) {
			t.Fatalf("cold cache %d: its host does not hold the image", i)
		}
	}
	if s := countSources(bases); s[imagecache.SourceMirror] != 1 || s[imagecache.SourceShared] != 3 {
		t.Fatalf("sources %v, want one mirror and three shared", s)
	}
	if n := reads(hs[0], holderVol) - before; n != 0 {
		t.Fatalf("the holder's base on a host going cold was read %d times", n)
	}
	if g := srv.gets.Load(); g != 2 {
		t.Fatalf("%d GETs in all, want 2 (the holder's, the shared one)", g)
	}
}

// A cold cache never copies a base of its own host over the network,
// whether the base is in its pool or another pool of its libvirtd (the
// host's base is its only peer): a raw image is copied inside the host
// (StorageVolCreateXMLFrom) and checked by its read-back, with no GET; a
// qcow2 image, which libvirt would copy through qemu-img convert, comes
// from the mirror; so does a raw image that libvirt sees as qcow2 (its
// copy reads back as other bytes and is not published).
func TestPeerNeverCopiesItsOwnHost(t *testing.T) {
	qcow, qsum := testImage(300 << 10)
	raw, rsum := rawImage(300 << 10)
	for _, tc := range []struct {
		name   string
		body   []byte
		sum    string
		format string
		pool   string
		// clone: the base is copied inside the host (else downloaded).
		clone bool
	}{
		{"qcow2, same pool", qcow, qsum, "", fakePool, false},
		{"raw, same pool", raw, rsum, imagecache.FormatRaw, fakePool, true},
		{"raw, another pool of the host", raw, rsum, imagecache.FormatRaw, "q", true},
		{"raw that libvirt sees as qcow2", qcow, qsum, imagecache.FormatRaw, fakePool, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := serve(t, tc.body, nil)
			f := smallFanout()
			holder, h := newFakeCache(t, func(cfg *Config) { cfg.Entry = "a"; cfg.Fanout = f })
			img := imagecache.Image{Key: "k", URL: srv.url, SHA256: tc.sum, Format: tc.format}
			if _, err := holder.Ensure(testCtx(t, 30*time.Second), img); err != nil {
				t.Fatal(err)
			}
			c := cacheOnHost(t, h, "b", tc.pool, f, nil)
			holderVol := holder.BaseName(img)
			before, gets := reads(h, holderVol), srv.gets.Load()
			b, err := c.Ensure(testCtx(t, 30*time.Second), img)
			if err != nil {
				t.Fatal(err)
			}
			name := c.BaseName(img)
			if got, _ := h.Volume(tc.pool, name); b.Volume != name || b.Digest != tc.sum || string(got.Data) != string(tc.body) {
				t.Fatalf("base %+v; its host holds %d bytes, want the image's %d", b, len(got.Data), len(tc.body))
			}
			if n := reads(h, holderVol) - before; n != 0 {
				t.Fatalf("the host's own base was read over the network %d times", n)
			}
			clones := h.Calls("StorageVolCreateXMLFrom")
			switch {
			case tc.clone && (b.Source != imagecache.SourcePeer || clones != 1 || srv.gets.Load() != gets):
				t.Fatalf("source %q, %d copies inside the host, %d GETs; want peer, 1, 0", b.Source, clones, srv.gets.Load()-gets)
			case !tc.clone && (b.Source != imagecache.SourceMirror || srv.gets.Load() != gets+1):
				t.Fatalf("source %q after %d GETs, want a download from the mirror (1)", b.Source, srv.gets.Load()-gets)
			}
			if tc.format == imagecache.FormatRaw && !tc.clone && clones != 1 {
				t.Fatalf("%d copies inside the host, want the one whose bytes differed", clones)
			}
			if n := h.OpenSessions(); n != 0 {
				t.Fatalf("%d dedicated sessions left open", n)
			}
			for _, v := range h.VolumeNames(tc.pool) {
				if strings.HasPrefix(v, "base-b--") && v != name && v != MarkerName(name, tc.sum) {
					t.Fatalf("left in the pool: %s", v)
				}
			}
		})
	}
}

// A source that holds the readers back is left for the next candidate,
// from where the download is: the peer's stream stalls 128 KiB into the
// image (its own stall bound is 15 s), and after SwitchAfter the download
// goes on from the mirror with a Range request from that byte. The cold
// host's staged volume is created once and its upload never starts
// again: what was written stays. Its source is peer+mirror, in Base and
// in the published line, and the switch is logged.
func TestSourceSwitchKeepsWritten(t *testing.T) {
	body, sum := testImage(600 << 10)
	rs := serveRanges(t, body, nil, true, nil)
	f := NewFanout(FanoutOptions{Window: 256 << 10, Chunk: 32 << 10, DetachAfter: 200 * time.Millisecond, JoinWindow: 200 * time.Millisecond, SwitchAfter: 100 * time.Millisecond})
	logs := &logLines{}
	cs, hs := fanHosts(t, 2, f, func(i int, cfg *Config) {
		cfg.StreamStall = time.Minute // the peer's stall bound is peerStall
		cfg.Logger = funcr.New(logs.add, funcr.Options{})
	})
	img := imagecache.Image{Key: "k", URL: rs.url, SHA256: sum}
	if _, err := cs[0].Ensure(testCtx(t, 30*time.Second), img); err != nil {
		t.Fatal(err)
	}
	peerVol := cs[0].BaseName(img)
	release := make(chan struct{})
	defer close(release)
	hs[0].SetStreamHook("StorageVolDownload", func(c libvirtfake.Call) error {
		if c.Volume == peerVol && c.Done >= 128<<10 {
			return c.Wait(release)
		}
		return nil
	})
	start := time.Now()
	b, err := cs[1].Ensure(testCtx(t, 30*time.Second), img)
	took := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	wantPublished(t, cs[1], hs[1], img, b, body, sum)
	if b.Source != "peer+mirror" {
		t.Fatalf("source %q, want peer+mirror", b.Source)
	}
	if took > 10*time.Second {
		t.Fatalf("took %v: the download waited for the stalled peer", took)
	}
	rs.mu.Lock()
	ranges := slices.Clone(rs.ranges)
	rs.mu.Unlock()
	if len(ranges) != 2 || ranges[0] != "" || ranges[1] != fmt.Sprintf("bytes=%d-", 128<<10) {
		t.Fatalf("requests to the mirror with Range %q, want the holder's GET and one from byte %d", ranges, 128<<10)
	}
	if n := creations(hs[1], b.Volume); n != 1 {
		t.Fatalf("the cold host's base was created %d times, want once (the upload went on)", n)
	}
	if l := logs.with(`"msg"="switching source"`); len(l) != 1 || !strings.Contains(l[0], `"to"="mirror"`) || !strings.Contains(l[0], `"bytes"=131072`) {
		t.Fatalf("switch lines %q, want one to the mirror at byte 131072", l)
	}
	var published []string
	for _, l := range logs.with(`"msg"="published base"`) {
		if strings.Contains(l, `"entry"="e1"`) {
			published = append(published, l)
		}
	}
	if len(published) != 1 || !strings.Contains(published[0], `"source"="peer+mirror"`) || !strings.Contains(published[0], `"peer"="e0"`) {
		t.Fatalf("published lines %q, want one naming source peer+mirror and peer e0", published)
	}
}

// A source that keeps up with its readers is kept: the cold host's upload
// is held while the download measures its peer, which then waits for the
// reader, not the reader for it. No request goes to the mirror.
func TestSourceKeptWhileReadersAreBehind(t *testing.T) {
	body, sum := testImage(600 << 10)
	srv := serve(t, body, nil)
	f := NewFanout(FanoutOptions{Window: 256 << 10, Chunk: 32 << 10, DetachAfter: time.Minute, JoinWindow: 200 * time.Millisecond, SwitchAfter: 100 * time.Millisecond})
	cs, hs := fanHosts(t, 2, f, func(i int, cfg *Config) { cfg.StreamStall = time.Minute })
	img := imagecache.Image{Key: "k", URL: srv.url, SHA256: sum}
	if _, err := cs[0].Ensure(testCtx(t, 30*time.Second), img); err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	hs[1].SetStreamHook("StorageVolUpload", func(c libvirtfake.Call) error {
		if c.Done >= 64<<10 {
			return c.Wait(release)
		}
		return nil
	})
	var b Base
	var err error
	done := make(chan struct{})
	go func() {
		defer close(done)
		b, err = cs[1].Ensure(testCtx(t, 30*time.Second), img)
	}()
	pool, _ := cs[0].poolHandle()
	link := peerSource(&peerBase{pool: pool}).link
	mirror := mirrorSource(img.URL).link
	// Measured twice with the reader held: the peer once, then the peer
	// again (or the mirror, had the download switched to it).
	eventually.True(t, 10*time.Second, func() bool { return f.knownRate(link) > 0 }, "a measurement of the peer")
	f.pmu.Lock()
	at := f.links[link].at
	f.pmu.Unlock()
	eventually.True(t, 10*time.Second, func() bool {
		f.pmu.Lock()
		defer f.pmu.Unlock()
		return f.links[link].at.After(at) || f.links[mirror] != nil
	}, "a second measurement")
	close(release)
	<-done
	if err != nil {
		t.Fatal(err)
	}
	wantPublished(t, cs[1], hs[1], img, b, body, sum)
	if b.Source != imagecache.SourcePeer || srv.gets.Load() != 1 {
		t.Fatalf("source %q after %d GETs in all; want peer and 1 (the holder's)", b.Source, srv.gets.Load())
	}
}

// A cache of the host a download reads joins it (it went cold after the
// download chose its source): the download switches to the mirror from
// where it is, and both caches publish; the host's base is read by that
// one stream only.
func TestSourceSwitchesWhenItsHostJoins(t *testing.T) {
	body, sum := testImage(600 << 10)
	srv := serve(t, body, nil)
	// Neither a measurement nor the peer's stall bound ends the held
	// stream: only the join does.
	f := NewFanout(FanoutOptions{Window: 256 << 10, Chunk: 32 << 10, DetachAfter: time.Minute, JoinWindow: 5 * time.Second, SwitchAfter: time.Minute})
	long := func(cfg *Config) { cfg.StreamStall = time.Minute }
	cs, hs := fanHosts(t, 2, f, func(_ int, cfg *Config) { long(cfg) })
	img := imagecache.Image{Key: "k", URL: srv.url, SHA256: sum}
	if _, err := cs[0].Ensure(testCtx(t, 30*time.Second), img); err != nil {
		t.Fatal(err)
	}
	peerVol := cs[0].BaseName(img)
	held := newSignal()
	hs[0].SetStreamHook("StorageVolDownload", func(c libvirtfake.Call) error {
		if c.Volume == peerVol && c.Done >= 64<<10 {
			_ = held.seen(c)
			return c.Wait(nil) // until the switch kills the stream
		}
		return nil
	})
	b0 := cacheOnHost(t, hs[0], "b0", fakePool, f, long)
	var wg sync.WaitGroup
	var b1, bb Base
	var e1, eb error
	start := time.Now()
	wg.Go(func() { b1, e1 = cs[1].Ensure(testCtx(t, 20*time.Second), img) })
	if !held.within(10 * time.Second) {
		t.Fatal("the cold host did not read the peer")
	}
	wg.Go(func() { bb, eb = b0.Ensure(testCtx(t, 20*time.Second), img) })
	wg.Wait()
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("took %v: the download stayed on the peer", took)
	}
	if e1 != nil || eb != nil {
		t.Fatalf("cold hosts: %v, %v", e1, eb)
	}
	wantPublished(t, cs[1], hs[1], img, b1, body, sum)
	if got, _ := hs[0].Volume(fakePool, bb.Volume); bb.Digest != sum || string(got.Data) != string(body) {
		t.Fatalf("host 0's cold cache: %+v", bb)
	}
	if b1.Source != "peer+mirror" || bb.Source != "peer+mirror" {
		t.Fatalf("sources %q and %q, want peer+mirror for both", b1.Source, bb.Source)
	}
	if n := reads(hs[0], peerVol); n != 2 { // the holder's read-back, the one stream
		t.Fatalf("host 0's base read %d times, want 2", n)
	}
	if g := srv.gets.Load(); g != 2 {
		t.Fatalf("%d GETs in all, want 2 (the holder's, the switch)", g)
	}
}

// What a download starts from: sources not measured yet first (peers
// before the mirror), then by the rate remembered for their link — per
// link, whatever the image; never a peer whose stream failed lately, a
// peer on the host of a cache going cold for the image, or a second base
// on one host.
func TestCandidates(t *testing.T) {
	f := smallFanout()
	cs, _ := fanHosts(t, 3, f, nil)
	ctx := testCtx(t, 10*time.Second)
	var pbs []*peerBase
	for _, c := range cs {
		if _, err := c.listVols(ctx); err != nil { // learns its pool's handle
			t.Fatal(err)
		}
		pool, _ := c.poolHandle()
		pbs = append(pbs, &peerBase{c: c, volume: "v", size: 1, pool: pool})
	}
	twin := &peerBase{c: cs[1], volume: "w", size: 1, pool: pbs[1].pool} // another base on host 1
	key := fanKey{url: "http://mirror.example/a.qcow2", sha256: strings.Repeat("0", 64), client: cs[0].cfg.HTTPClient}
	names := func(key fanKey, peers ...*peerBase) string {
		var out []string
		for _, s := range f.candidates(key, peers) {
			out = append(out, s.String())
		}
		return strings.Join(out, " ")
	}
	if got := names(key, pbs[1], twin, pbs[2]); got != "peer e1 peer e2 mirror" {
		t.Fatalf("candidates %q, want the peers (one per host), then the mirror", got)
	}
	mirror := mirrorSource(key.url).link
	f.noteRate(mirror, 100e6, true)
	f.noteRate(peerSource(pbs[1]).link, 50e6, true)
	if got := names(key, pbs[1], pbs[2]); got != "peer e2 mirror peer e1" {
		t.Fatalf("candidates %q, want e2 (not measured), the mirror (100 MB/s), e1 (50 MB/s)", got)
	}
	other := fanKey{url: "http://mirror.example/b.qcow2", sha256: strings.Repeat("1", 64), client: key.client}
	f.noteRate(peerSource(pbs[2]).link, 200e6, true)
	if got := names(other, pbs[1], pbs[2]); got != "peer e2 mirror peer e1" {
		t.Fatalf("another image: candidates %q, want the links' rates (e2 200 MB/s first)", got)
	}
	if f.noteRate(mirror, 10e6, false); f.knownRate(mirror) != 100e6 {
		t.Fatalf("a rate the readers held back lowered the link's to %.0f", f.knownRate(mirror))
	}
	f.noteFailed(peerSource(pbs[2]).link)
	if got := names(key, pbs[1], pbs[2]); got != "mirror peer e1" {
		t.Fatalf("candidates %q, want e2 left out after its stream failed", got)
	}
	done := f.goingCold(cs[1], key)
	if got := names(key, pbs[1]); got != "mirror" {
		t.Fatalf("candidates %q, want e1 left out while a cache of its host goes cold", got)
	}
	if got := names(other, pbs[1]); got != "mirror peer e1" {
		t.Fatalf("another image: candidates %q, want e1 (its host is cold for the first image only)", got)
	}
	done()
	if got := names(key, pbs[1]); got != "mirror peer e1" {
		t.Fatalf("candidates %q, want e1 back", got)
	}
	f.pmu.Lock()
	f.links[peerSource(pbs[2]).link].failed = time.Now().Add(-peerBackoff - time.Second)
	f.links[mirror].at = time.Now().Add(-rateMemory - time.Second)
	f.pmu.Unlock()
	if got := names(key, pbs[1], pbs[2]); got != "mirror peer e2 peer e1" {
		t.Fatalf("candidates %q, want the mirror first (its rate forgotten), then e2 (200) and e1 (50)", got)
	}
}
