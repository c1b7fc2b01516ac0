package basecache

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/testing/libvirtfake"
	"github.com/go-logr/logr/funcr"
)

// smallFanout has a window of 8 chunks of 32 KiB, so that a test image of
// a few hundred KiB goes through many trims, detaches after 200 ms and
// holds byte 0 for 200 ms (tests that need every host to join gate the
// mirror's answer with waitMembers: under load a host's Ensure may start
// after the others' download has moved on; TestFanoutWaitsForJoinerOnItsWay
// shows the hold for an Ensure under way without a gate).
func smallFanout() *Fanout {
	return NewFanout(FanoutOptions{Window: 256 << 10, Chunk: 32 << 10, DetachAfter: 200 * time.Millisecond, JoinWindow: 200 * time.Millisecond})
}

// fanHosts returns n caches (entries e0…) on n fake hosts, all with Fanout f.
func fanHosts(t *testing.T, n int, f *Fanout, mod func(i int, cfg *Config)) ([]*Cache, []*libvirtfake.Host) {
	t.Helper()
	cs := make([]*Cache, n)
	hs := make([]*libvirtfake.Host, n)
	for i := range n {
		cs[i], hs[i] = newFakeCache(t, func(cfg *Config) {
			cfg.Entry = "e" + strconv.Itoa(i)
			cfg.Fanout = f
			if mod != nil {
				mod(i, cfg)
			}
		})
	}
	return cs, hs
}

// ensureAll runs Ensure of img on every cache at once.
func ensureAll(t *testing.T, cs []*Cache, img imagecache.Image, ctxs ...context.Context) ([]Base, []error) {
	t.Helper()
	bases := make([]Base, len(cs))
	problems := make([]error, len(cs))
	var wg sync.WaitGroup
	for i, c := range cs {
		ctx := testCtx(t, 30*time.Second)
		if i < len(ctxs) {
			ctx = ctxs[i]
		}
		wg.Go(func() { bases[i], problems[i] = c.Ensure(ctx, img) })
	}
	wg.Wait()
	return bases, problems
}

// wantPublished checks that cache i published img's base with digest sum
// on its own host, holding body, and that no session is left open.
func wantPublished(t *testing.T, c *Cache, h *libvirtfake.Host, img imagecache.Image, b Base, body []byte, sum string) {
	t.Helper()
	name := c.BaseName(img)
	if b.Volume != name || b.Digest != sum {
		t.Fatalf("%s: base %+v, want volume %s digest %s", c.cfg.Entry, b, name, sum)
	}
	wantLeft(t, h, name, MarkerName(name, sum))
	if got, _ := h.Volume(fakePool, name); !bytes.Equal(got.Data, body) {
		t.Fatalf("%s: host stores %d bytes, not the image's %d", c.cfg.Entry, len(got.Data), len(body))
	}
}

// waitMembers waits (at most 10 s) until f's download has n members. It
// runs in the mirror's handlers and in libvirt hooks, so it does not fail
// the test: a download that never gets its members fails the test's own
// checks.
func waitMembers(f *Fanout, n int) {
	awaitDownload(f, func(d *download) bool { return len(d.members) >= n })
}

// awaitDownload waits (at most 10 s) until cond, read under the
// download's lock, holds for f's download, looking again each time the
// download announces a change (its changed channel): a member joined,
// read or left, the pump read. false when it did not hold in time, or f
// has no download: callers know it has one (its GET reached the mirror,
// and the Fanout records a download before the GET's caller lets go of
// the Fanout's lock).
func awaitDownload(f *Fanout, cond func(*download) bool) bool {
	f.mu.Lock()
	var d *download
	for _, x := range f.dls {
		d = x
	}
	f.mu.Unlock()
	if d == nil {
		return false
	}
	timeout := time.NewTimer(10 * time.Second)
	defer timeout.Stop()
	for {
		d.mu.Lock()
		ok, changed := cond(d), d.changed
		d.mu.Unlock()
		if ok {
			return true
		}
		select {
		case <-changed:
		case <-timeout.C:
			return false
		}
	}
}

func countSources(bases []Base) map[string]int {
	m := map[string]int{}
	for _, b := range bases {
		m[b.Source]++
	}
	return m
}

// Four cold hosts fetching one image at once cost the mirror one GET; each
// host publishes the image's digest from its own read-back, under its own
// entry's name. The first is the mirror download, the others shared; a
// second Ensure is a hit.
func TestFanoutFourHostsOneGET(t *testing.T) {
	body, sum := testImage(600 << 10)
	f := NewFanout(FanoutOptions{Window: 256 << 10, Chunk: 32 << 10}) // JoinWindow 1 s
	srv := serve(t, body, func(w http.ResponseWriter, r *http.Request) {
		waitMembers(f, 4)
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		_, _ = w.Write(body)
	})
	cs, hs := fanHosts(t, 4, f, nil)
	img := imagecache.Image{Key: "k", URL: srv.url, SHA256: sum}
	bases, problems := ensureAll(t, cs, img)
	for i := range cs {
		if problems[i] != nil {
			t.Fatalf("host %d: %v", i, problems[i])
		}
		wantPublished(t, cs[i], hs[i], img, bases[i], body, sum)
	}
	if g := srv.gets.Load(); g != 1 {
		t.Fatalf("the mirror served %d GETs for 4 hosts, want 1", g)
	}
	if s := countSources(bases); s[imagecache.SourceMirror] != 1 || s[imagecache.SourceShared] != 3 {
		t.Fatalf("sources %v, want 1 mirror and 3 shared", s)
	}
	if max := f.opts.Window/int64(f.opts.Chunk) + 2; f.chunks.Load() > max {
		t.Fatalf("%d window chunks allocated for a %d-byte image, want at most %d", f.chunks.Load(), len(body), max)
	}
	if b, err := cs[0].Ensure(testCtx(t, 10*time.Second), img); err != nil || b.Source != imagecache.SourcePool {
		t.Fatalf("second Ensure = %+v, %v; want a hit (source pool)", b, err)
	}
	f.mu.Lock()
	left := len(f.dls)
	f.mu.Unlock()
	if left != 0 {
		t.Fatalf("%d downloads left in the Fanout", left)
	}
}

// Without a Fanout (the default) every cache downloads on its own; caches
// sharing a Fanout but not their HTTP client do not share a download.
func TestFanoutOffOrOtherClientDownloadsAlone(t *testing.T) {
	body, sum := testImage(100 << 10)
	img := func(url string) imagecache.Image { return imagecache.Image{Key: "k", URL: url, SHA256: sum} }
	t.Run("no fanout", func(t *testing.T) {
		srv := serve(t, body, nil)
		cs, _ := fanHosts(t, 3, nil, nil)
		bases, problems := ensureAll(t, cs, img(srv.url))
		for i := range cs {
			if problems[i] != nil || bases[i].Source != imagecache.SourceMirror {
				t.Fatalf("host %d: %+v, %v", i, bases[i], problems[i])
			}
		}
		if g := srv.gets.Load(); g != 3 {
			t.Fatalf("%d GETs, want 3", g)
		}
	})
	t.Run("other clients", func(t *testing.T) {
		srv := serve(t, body, nil)
		cs, _ := fanHosts(t, 2, smallFanout(), func(i int, cfg *Config) { cfg.HTTPClient = &http.Client{} })
		_, problems := ensureAll(t, cs, img(srv.url))
		if problems[0] != nil || problems[1] != nil {
			t.Fatal(problems)
		}
		if g := srv.gets.Load(); g != 2 {
			t.Fatalf("%d GETs for two caches with their own clients, want 2", g)
		}
	})
}

// rangeServer serves body with Last-Modified and byte ranges
// (http.ServeContent), recording the Range header of every request; with
// ranges false it ignores Range and announces neither ranges nor a
// validator. When later is set, every request after the first gets later
// instead (a new version of the image, newer Last-Modified).
type rangeServer struct {
	*served
	mu     sync.Mutex
	ranges []string
}

// gate, when set, runs before the first answer.
func serveRanges(t *testing.T, body, later []byte, ranges bool, gate func()) *rangeServer {
	rs := &rangeServer{}
	mod := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	rs.served = serve(t, body, func(w http.ResponseWriter, r *http.Request) {
		rs.mu.Lock()
		rs.ranges = append(rs.ranges, r.Header.Get("Range"))
		b, m := body, mod
		if later != nil && len(rs.ranges) > 1 {
			b, m = later, mod.Add(time.Hour)
		}
		first := len(rs.ranges) == 1
		rs.mu.Unlock()
		if first && gate != nil {
			gate()
		}
		if !ranges {
			w.Header().Set("Content-Length", strconv.Itoa(len(b)))
			_, _ = w.Write(b)
			return
		}
		http.ServeContent(w, r, "img.qcow2", m, bytes.NewReader(b))
	})
	return rs
}

// A host whose upload stalls keeps the window full: after DetachAfter it
// is detached and the other three finish while it is still stalled; once
// it moves again it finishes on a download of its own from where it was —
// a Range request when the mirror serves ranges, else a full GET whose
// first bytes are skipped — and publishes the right digest too. When the
// image changed on the mirror meanwhile (a new Last-Modified, or other
// first bytes without a validator), the detached host fails Transient
// instead of splicing two versions, and the others are not affected.
func TestFanoutStalledHostDetached(t *testing.T) {
	for _, tc := range []struct {
		ranges, changed bool
	}{{true, false}, {false, false}, {true, true}, {false, true}} {
		ranges := tc.ranges
		t.Run(fmt.Sprintf("ranges=%v,changed=%v", tc.ranges, tc.changed), func(t *testing.T) {
			body, sum := testImage(1 << 20)
			var later []byte
			if tc.changed {
				later = slices.Clone(body)
				later[100] ^= 1 // within what the stalled host has read
			}
			f := smallFanout()
			srv := serveRanges(t, body, later, ranges, func() { waitMembers(f, 4) })
			cs, hs := fanHosts(t, 4, f, func(i int, cfg *Config) {
				cfg.StreamStall = time.Minute // the stall is ours
			})
			release := make(chan struct{})
			stalled := make(chan struct{})
			var once sync.Once
			hs[3].SetStreamHook("StorageVolUpload", func(call libvirtfake.Call) error {
				if call.Done >= 64<<10 {
					once.Do(func() { close(stalled) })
					return call.Wait(release)
				}
				return nil
			})
			img := imagecache.Image{Key: "k", URL: srv.url, SHA256: sum}
			bases := make([]Base, 4)
			problems := make([]error, 4)
			var wg, others sync.WaitGroup
			start := time.Now()
			for i, c := range cs {
				wg.Add(1)
				if i < 3 {
					others.Add(1)
				}
				go func() {
					defer wg.Done()
					bases[i], problems[i] = c.Ensure(testCtx(t, 30*time.Second), img)
					if i < 3 {
						others.Done()
					}
				}()
			}
			othersDone := make(chan struct{})
			go func() { others.Wait(); close(othersDone) }()
			select {
			case <-othersDone:
			case <-time.After(15 * time.Second):
				close(release) // let everything end before failing
				wg.Wait()
				t.Fatal("the other hosts did not finish beside a stalled host within 15 s")
			}
			took := time.Since(start)
			select {
			case <-stalled:
			default:
				t.Fatal("host 3 never stalled")
			}
			for i := range 3 {
				if problems[i] != nil {
					t.Fatalf("host %d: %v", i, problems[i])
				}
				wantPublished(t, cs[i], hs[i], img, bases[i], body, sum)
			}
			// JoinWindow (1 s) + DetachAfter (200 ms) + the transfer; the
			// stalled host would hold them forever without detaching.
			if took > 10*time.Second {
				t.Fatalf("the others took %v beside a stalled host", took)
			}
			close(release)
			wg.Wait()
			if tc.changed {
				wantClass(t, problems[3], errs.Transient, "the image changed on the mirror")
				wantLeft(t, hs[3])
				return
			}
			if problems[3] != nil {
				t.Fatalf("stalled host: %v", problems[3])
			}
			wantPublished(t, cs[3], hs[3], img, bases[3], body, sum)
			if bases[3].Source != imagecache.SourceDetached {
				t.Fatalf("stalled host's source %q, want %q", bases[3].Source, imagecache.SourceDetached)
			}
			srv.mu.Lock()
			got := slices.Clone(srv.ranges)
			srv.mu.Unlock()
			if len(got) != 2 || got[0] != "" {
				t.Fatalf("Range headers of the requests: %q, want the shared GET and one resume", got)
			}
			if ranges {
				off, ok := strings.CutPrefix(got[1], "bytes=")
				n, err := strconv.Atoi(strings.TrimSuffix(off, "-"))
				if !ok || err != nil || n <= 0 || n >= len(body) {
					t.Fatalf("resume asked for %q, want bytes=<offset>- with 0 < offset < %d", got[1], len(body))
				}
			} else if got[1] != "" {
				t.Fatalf("resume sent Range %q to a server without ranges", got[1])
			}
		})
	}
}

// The mirror dropping the connection mid-body fails every host attached to
// the download Transient, with nothing published anywhere; a retry shares
// one download again and succeeds. A digest mismatch fails every host
// Permanent, and a failed GET (404) is shared too: every host Permanent
// after one request.
func TestFanoutMirrorFailures(t *testing.T) {
	body, sum := testImage(600 << 10)
	var cut atomic.Bool
	cut.Store(true)
	// Peers off: once the hosts have published the image, a copy of the
	// configured digest from one of them would (rightly) win over the
	// wrong bytes the mirror serves below.
	f := NewFanout(FanoutOptions{Window: 256 << 10, Chunk: 32 << 10, DetachAfter: 200 * time.Millisecond, JoinWindow: 200 * time.Millisecond, MirrorOnly: true})
	srv := serve(t, body, func(w http.ResponseWriter, r *http.Request) {
		waitMembers(f, 4) // every host reads the download (a loaded machine starts some late)
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		if !cut.Load() {
			_, _ = w.Write(body)
			return
		}
		_, _ = w.Write(body[:200<<10])
		w.(http.Flusher).Flush()
		panic(http.ErrAbortHandler)
	})
	cs, hs := fanHosts(t, 4, f, nil)
	img := imagecache.Image{Key: "k", URL: srv.url, SHA256: sum}
	_, problems := ensureAll(t, cs, img)
	for i := range cs {
		wantClass(t, problems[i], errs.Transient, "")
		wantLeft(t, hs[i])
	}
	if g := srv.gets.Load(); g != 1 {
		t.Fatalf("%d GETs, want 1", g)
	}
	cut.Store(false)
	bases, problems := ensureAll(t, cs, img)
	for i := range cs {
		if problems[i] != nil {
			t.Fatalf("retry, host %d: %v", i, problems[i])
		}
		wantPublished(t, cs[i], hs[i], img, bases[i], body, sum)
	}
	if g := srv.gets.Load(); g != 2 {
		t.Fatalf("%d GETs after the retry, want 2", g)
	}

	// Bytes other than the configured digest: every host Permanent on its
	// own read-back digest, nothing published, one GET.
	other, _ := testImage(300 << 10)
	wrong := serve(t, other, func(w http.ResponseWriter, r *http.Request) {
		waitMembers(f, 4) // answer once every host waits for the download
		_, _ = w.Write(other)
	})
	_, problems = ensureAll(t, cs, imagecache.Image{Key: "wrong", URL: wrong.url, SHA256: sum})
	for i := range cs {
		wantClass(t, problems[i], errs.Permanent, "sha256 "+sum+" is configured")
		wantLeft(t, hs[i], cs[i].BaseName(img), MarkerName(cs[i].BaseName(img), sum))
	}
	if g := wrong.gets.Load(); g != 1 {
		t.Fatalf("%d GETs of a wrong image by 4 hosts, want 1", g)
	}

	missing := serve(t, nil, func(w http.ResponseWriter, r *http.Request) {
		waitMembers(f, 4)
		http.NotFound(w, r)
	})
	_, problems = ensureAll(t, cs, imagecache.Image{Key: "gone", URL: missing.url})
	for i := range cs {
		wantClass(t, problems[i], errs.Permanent, "404")
	}
	if g := missing.gets.Load(); g != 1 {
		t.Fatalf("%d GETs of a missing image by 4 hosts, want 1", g)
	}
}

// The host that started the download (its GET) gives up mid-stream: the
// download goes on for the others (the leader is the download, not a
// host), they publish, and the mirror served one GET.
func TestFanoutWaiterCanceled(t *testing.T) {
	body, sum := testImage(600 << 10)
	f := smallFanout()
	srv := serve(t, body, func(w http.ResponseWriter, r *http.Request) {
		waitMembers(f, 4)
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		_, _ = w.Write(body)
	})
	cs, hs := fanHosts(t, 4, f, nil)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	hs[0].SetStreamHook("StorageVolUpload", func(call libvirtfake.Call) error {
		if call.Done >= 64<<10 {
			// Leave once the others have joined (alone, the leader's
			// leaving would cancel the download: nobody needs it).
			waitMembers(f, 4)
			cancel()
			return call.Wait(nil) // until the fetch is canceled
		}
		return nil
	})
	img := imagecache.Image{Key: "k", URL: srv.url, SHA256: sum}
	errc := make(chan error, 1)
	go func() {
		_, err := cs[0].Ensure(ctx, img)
		errc <- err
	}()
	select { // host 0 leads
	case <-srv.first:
	case <-time.After(10 * time.Second):
		t.Fatal("host 0 never reached the mirror")
	}
	bases, problems := ensureAll(t, cs[1:], img)
	wantClass(t, <-errc, errs.Canceled, "")
	for i := range 3 {
		if problems[i] != nil {
			t.Fatalf("host %d: %v", i+1, problems[i])
		}
		wantPublished(t, cs[i+1], hs[i+1], img, bases[i], body, sum)
		if bases[i].Source != imagecache.SourceShared {
			t.Fatalf("host %d: source %q, want shared", i+1, bases[i].Source)
		}
	}
	if err := cs[0].Close(); err != nil { // waits for the abandoned fetch
		t.Fatal(err)
	}
	wantLeft(t, hs[0])
	if g := srv.gets.Load(); g != 1 {
		t.Fatalf("%d GETs, want 1", g)
	}
}

// A 64 MiB image read by 4 fetches through one download allocates a
// window's worth of chunks, not the image (nor 4 images): the chunk count
// is exact, TotalAlloc a coarse check that nothing else buffers.
func TestFanoutMemoryBounded(t *testing.T) {
	const size = 64 << 20
	block, _ := testImage(1 << 20)
	h := sha256.New()
	for range size / len(block) {
		h.Write(block)
	}
	sum := hex.EncodeToString(h.Sum(nil))
	// The body waits until every reader has its response, so that all
	// four join at byte 0 however the machine schedules them; a reader
	// kept from reading (a busy machine) is not detached within the test.
	release := make(chan struct{})
	srv := serve(t, nil, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(size))
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		for range size / len(block) {
			if _, err := w.Write(block); err != nil {
				return
			}
		}
	})
	f := NewFanout(FanoutOptions{DetachAfter: time.Minute})
	client := &http.Client{}
	var joined sync.WaitGroup
	joined.Add(4)
	go func() { joined.Wait(); close(release) }()
	key := fanKey{url: srv.url, client: client}
	c, _ := newFakeCache(t, nil) // the fetches' cache: only its logger is used
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	sums := make([]string, 4)
	problems := make([]error, 4)
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Go(func() {
			req, err := http.NewRequestWithContext(testCtx(t, time.Minute), http.MethodGet, srv.url, nil)
			if err != nil {
				problems[i] = err
				return
			}
			resp, _, err := f.get(c, key, req, nil, false)
			joined.Done()
			if err != nil {
				problems[i] = err
				return
			}
			defer resp.Body.Close()
			h := sha256.New()
			buf := make([]byte, (i+1)*16<<10)
			if _, err := io.CopyBuffer(h, resp.Body, buf); err != nil {
				problems[i] = err
				return
			}
			sums[i] = hex.EncodeToString(h.Sum(nil))
		})
	}
	wg.Wait()
	runtime.ReadMemStats(&after)
	for i := range 4 {
		if problems[i] != nil || sums[i] != sum {
			t.Fatalf("reader %d: sha256 %s, %v; want %s", i, sums[i], problems[i], sum)
		}
	}
	if g := srv.gets.Load(); g != 1 {
		t.Fatalf("%d GETs, want 1", g)
	}
	if max := f.opts.Window/int64(f.opts.Chunk) + 2; f.chunks.Load() > max {
		t.Fatalf("%d chunks of %d bytes allocated, want at most %d (the window)", f.chunks.Load(), f.opts.Chunk, max)
	}
	if d := after.TotalAlloc - before.TotalAlloc; d > 32<<20 {
		t.Fatalf("4 readers of a 64 MiB download allocated %d MiB, want < 32 MiB", d>>20)
	}
	t.Logf("allocated %d KiB in total, %d window chunks, for 4 readers of %d MiB", (after.TotalAlloc-before.TotalAlloc)>>10, f.chunks.Load(), size>>20)
}

func TestProcessFanoutIsOne(t *testing.T) {
	a, b := ProcessFanout(), ProcessFanout()
	if a == nil || a != b {
		t.Fatal("ProcessFanout is not one instance")
	}
}

// One host's disk fills up mid-upload (libvirt fails its stream): that
// host fails Transient with nothing left in its pool; the others publish
// from the one download.
func TestFanoutHostDiskFull(t *testing.T) {
	body, sum := testImage(600 << 10)
	f := smallFanout()
	srv := serve(t, body, func(w http.ResponseWriter, r *http.Request) {
		waitMembers(f, 4)
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		_, _ = w.Write(body)
	})
	cs, hs := fanHosts(t, 4, f, nil)
	hs[2].SetStreamHook("StorageVolUpload", libvirtfake.CutAfter(128<<10, libvirt.Error{Code: uint32(libvirt.ErrSystemError), Message: "cannot write: No space left on device"}))
	img := imagecache.Image{Key: "k", URL: srv.url, SHA256: sum}
	bases, problems := ensureAll(t, cs, img)
	wantClass(t, problems[2], errs.Transient, "No space left on device")
	wantLeft(t, hs[2])
	for _, i := range []int{0, 1, 3} {
		if problems[i] != nil {
			t.Fatalf("host %d: %v", i, problems[i])
		}
		wantPublished(t, cs[i], hs[i], img, bases[i], body, sum)
	}
	if g := srv.gets.Load(); g != 1 {
		t.Fatalf("%d GETs, want 1", g)
	}
}

// A detached host whose own GET fails reports it without the URL's
// credentials, in its error and in every log line; the other host is not
// affected.
func TestFanoutDetachedFailureRedacted(t *testing.T) {
	body, sum := testImage(1 << 20)
	f := smallFanout()
	var n atomic.Int64
	srv := serve(t, body, func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) > 1 { // the resume: the connection drops before an answer
			c, _, err := w.(http.Hijacker).Hijack()
			if err == nil {
				_ = c.Close()
			}
			return
		}
		waitMembers(f, 2)
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		_, _ = w.Write(body)
	})
	const secret = "s3cr3tpass"
	url := strings.Replace(srv.url, "http://", "http://user:"+secret+"@", 1) + "?token=" + secret
	var mu sync.Mutex
	var lines []string
	log := funcr.New(func(prefix, args string) {
		mu.Lock()
		lines = append(lines, args)
		mu.Unlock()
	}, funcr.Options{Verbosity: 9})
	cs, hs := fanHosts(t, 2, f, func(i int, cfg *Config) {
		cfg.Logger = log
		cfg.StreamStall = time.Minute
	})
	release := make(chan struct{})
	hs[1].SetStreamHook("StorageVolUpload", func(call libvirtfake.Call) error {
		if call.Done >= 64<<10 {
			return call.Wait(release)
		}
		return nil
	})
	img := imagecache.Image{Key: "k", URL: url, SHA256: sum}
	var b0 Base
	var e0, e1 error
	var wg sync.WaitGroup
	done0 := make(chan struct{})
	wg.Go(func() { b0, e0 = cs[0].Ensure(testCtx(t, 30*time.Second), img); close(done0) })
	wg.Go(func() { _, e1 = cs[1].Ensure(testCtx(t, 30*time.Second), img) })
	select { // host 0 finishes while host 1 is stalled (detached)
	case <-done0:
	case <-time.After(15 * time.Second):
		t.Error("host 0 did not finish beside a stalled host")
	}
	close(release)
	wg.Wait()
	if e0 != nil {
		t.Fatal(e0)
	}
	wantPublished(t, cs[0], hs[0], img, b0, body, sum)
	wantClass(t, e1, errs.Transient, "detached from the shared download")
	wantLeft(t, hs[1])
	mu.Lock()
	defer mu.Unlock()
	for _, s := range append(lines, e1.Error()) {
		if strings.Contains(s, secret) {
			t.Fatalf("a secret printed: %s", s)
		}
	}
}

// A fetch alone on a fast mirror never waits for joiners, nor keeps the
// window: with JoinWindow 5 s and a 1 MiB window that a 2 MiB image
// overflows at once, it ends long before JoinWindow, and the download
// allocated no more than joinKeep (what it keeps of byte 0 for fetches not
// yet started) and the read-ahead, not the window.
func TestFanoutAloneNeverWaits(t *testing.T) {
	body, sum := testImage(2 << 20)
	srv := serve(t, body, nil)
	f := NewFanout(FanoutOptions{Window: 1 << 20, Chunk: 32 << 10, JoinWindow: 5 * time.Second})
	cs, hs := fanHosts(t, 3, f, nil)
	img := imagecache.Image{Key: "k", URL: srv.url, SHA256: sum}
	start := time.Now()
	b, err := cs[0].Ensure(testCtx(t, 30*time.Second), img)
	if err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > 2500*time.Millisecond {
		t.Fatalf("a fetch alone took %v with JoinWindow 5s: it waited for joiners nobody sent", took)
	}
	wantPublished(t, cs[0], hs[0], img, b, body, sum)
	chunk := int64(f.opts.Chunk)
	if max := (f.joinKeep()+f.readAhead())/chunk + 2; f.chunks.Load() > max {
		t.Fatalf("a fetch alone allocated %d chunks, want at most %d (joinKeep + read-ahead; the window is %d)", f.chunks.Load(), max, f.opts.Window/chunk)
	}
}

// A download keeps byte 0 for a fetch whose Ensure is under way: host 1's
// Ensure is held in its first pool listing while host 0's download fills
// its window (and would move on without anyone coming); once released,
// host 1 joins from byte 0 — one GET for both — and host 0 waited less
// than JoinWindow for it.
func TestFanoutWaitsForJoinerOnItsWay(t *testing.T) {
	body, sum := testImage(1 << 20)
	srv := serve(t, body, nil)
	f := NewFanout(FanoutOptions{Window: 128 << 10, Chunk: 32 << 10, JoinWindow: 5 * time.Second, MirrorOnly: true})
	cs, hs := fanHosts(t, 2, f, nil)
	release := make(chan struct{})
	listing := newSignal()
	hs[1].SetHook("StoragePoolListAllVolumes", func(call libvirtfake.Call) error {
		_ = listing.seen(call)
		return call.Wait(release)
	})
	img := imagecache.Image{Key: "k", URL: srv.url, SHA256: sum}
	var wg sync.WaitGroup
	bases := make([]Base, 2)
	problems := make([]error, 2)
	start := time.Now()
	var took0 time.Duration
	wg.Go(func() { bases[1], problems[1] = cs[1].Ensure(testCtx(t, 30*time.Second), img) })
	if !listing.within(10 * time.Second) {
		close(release)
		wg.Wait()
		t.Fatal("host 1's Ensure did not list the pool")
	}
	wg.Go(func() {
		bases[0], problems[0] = cs[0].Ensure(testCtx(t, 30*time.Second), img)
		took0 = time.Since(start)
	})
	// Host 0 is stuck at a full window: the download holds a window's
	// bytes from byte 0 and host 0 has read all of them.
	select {
	case <-srv.first:
	case <-time.After(10 * time.Second):
		t.Error("host 0 never reached the mirror")
	}
	stuck := awaitDownload(f, func(d *download) bool {
		if d.head < f.opts.Window {
			return false
		}
		for m := range d.members {
			if m.off < d.head {
				return false
			}
		}
		return true
	})
	if !stuck {
		t.Error("host 0's download never stopped at a full window")
	}
	close(release)
	wg.Wait()
	for i := range 2 {
		if problems[i] != nil {
			t.Fatalf("host %d: %v", i, problems[i])
		}
		wantPublished(t, cs[i], hs[i], img, bases[i], body, sum)
	}
	if g := srv.gets.Load(); g != 1 {
		t.Fatalf("%d GETs, want 1: the download did not keep byte 0 for the fetch on its way", g)
	}
	if s := countSources(bases); s[imagecache.SourceMirror] != 1 || s[imagecache.SourceShared] != 1 {
		t.Fatalf("sources %v, want a mirror and a shared", s)
	}
	if took0 > 4*time.Second {
		t.Fatalf("host 0 took %v: it waited to the end of JoinWindow", took0)
	}
}
