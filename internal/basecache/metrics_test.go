package basecache

import (
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/obs"
	"github.com/egressproxy/egressproxy/internal/testing/libvirtfake"
	"github.com/egressproxy/egressproxy/internal/testing/metrictest"
)

// The cache's instruments on the fake: what each cold fetch, hit, failed
// check and eviction records, labelled with the entry, the source and the
// check only.

// units are the unit of each of the cache's instruments.
var units = map[string]string{
	obs.MetricImageTransferSize:   "By",
	obs.MetricImageFetchDuration:  "s",
	obs.MetricImageVerifyFailures: "{failure}",
	obs.MetricImageEvictions:      "{base}",
	obs.MetricImageBaseCount:      "{base}",
	obs.MetricImageBaseUsage:      "By",
}

// metered sets cfg's MeterProvider to rd's.
func metered(rd *metrictest.Reader) func(*Config) {
	return func(cfg *Config) { cfg.MeterProvider = rd.MeterProvider() }
}

// series collects rd's series as key → value ("count N" for a
// histogram), after checking each one's scope, unit, kind, buckets and
// attributes: only the entry, a source of the fixed set and a check, and
// error.type.
func series(t *testing.T, rd *metrictest.Reader) map[string]string {
	t.Helper()
	allowed := map[string][]string{
		"egressproxy.image.source": {"mirror", "shared", "peer", "detached", "switched"},
		"egressproxy.image.check":  {"digest", "stored", "marker"},
		"error.type":               {"NotFound", "Permanent", "Transient", "Canceled", "DeadlineExceeded"},
	}
	kinds := map[string]metrictest.Kind{
		obs.MetricImageTransferSize: metrictest.Counter, obs.MetricImageFetchDuration: metrictest.Histogram,
		obs.MetricImageVerifyFailures: metrictest.Counter, obs.MetricImageEvictions: metrictest.Counter,
		obs.MetricImageBaseCount: metrictest.Gauge, obs.MetricImageBaseUsage: metrictest.Gauge,
	}
	out := map[string]string{}
	for _, s := range rd.Collect(t) {
		if s.Scope != meterName || s.Unit != units[s.Name] || s.Kind != kinds[s.Name] {
			t.Errorf("%s: scope %q, unit %q, kind %s; want %q, %q, %s", s.Key(), s.Scope, s.Unit, s.Kind, meterName, units[s.Name], kinds[s.Name])
		}
		if s.Kind == metrictest.Histogram && !slices.Equal(s.Bounds, obs.DurationBuckets()) {
			t.Errorf("%s: buckets %v", s.Key(), s.Bounds)
		}
		if !strings.HasPrefix(s.Attrs["egressproxy.entry"], "e") {
			t.Errorf("%s: no entry", s.Key())
		}
		for k, v := range s.Attrs {
			if k != "egressproxy.entry" && !slices.Contains(allowed[k], v) {
				t.Errorf("%s: attribute %s=%q is not one of the fixed set", s.Key(), k, v)
			}
		}
		out[s.Key()] = s.Text()
	}
	return out
}

// key is the series key of name with the entry and attribute pairs kv.
func key(name, entry string, kv ...string) string {
	a := map[string]string{"egressproxy.entry": entry}
	for i := 0; i+1 < len(kv); i += 2 {
		a[kv[i]] = kv[i+1]
	}
	return metrictest.Key(name, a)
}

func itoa(n int) string { return strconv.Itoa(n) }

// A cold fetch from the mirror (progress reported on every read, so the
// bytes are counted at many reports) adds the image's bytes under mirror
// and one fetch duration; the base is then present with its size. A hit
// adds nothing. Evict counts one eviction and the base is gone; evicting
// it again counts nothing. The bases' gauges are absent before the first
// listing and after Close.
func TestMetricsMirrorFetchHitEvict(t *testing.T) {
	t.Parallel()
	body, sum := testImage(300 << 10)
	srv := serve(t, body, nil)
	rd := metrictest.New(t)
	c, _ := newFakeCache(t, func(cfg *Config) {
		metered(rd)(cfg)
		cfg.ProgressInterval = time.Nanosecond
	})
	if got := series(t, rd); len(got) != 0 {
		t.Fatalf("series before any call: %v", got)
	}
	img := imagecache.Image{Key: "k", URL: srv.url, SHA256: sum}
	ctx := testCtx(t, 30*time.Second)
	if b, err := c.Ensure(ctx, img); err != nil || b.Source != imagecache.SourceMirror {
		t.Fatalf("Ensure = %+v, %v", b, err)
	}
	want := map[string]string{
		key(obs.MetricImageTransferSize, "e", "egressproxy.image.source", "mirror"):  itoa(len(body)),
		key(obs.MetricImageFetchDuration, "e", "egressproxy.image.source", "mirror"): "count 1",
		key(obs.MetricImageBaseCount, "e"):                                           "1",
		key(obs.MetricImageBaseUsage, "e"):                                           itoa(len(body)),
	}
	if d := cmp.Diff(want, series(t, rd)); d != "" {
		t.Fatalf("after a cold fetch (-want +got):\n%s", d)
	}
	if b, err := c.Ensure(ctx, img); err != nil || b.Source != imagecache.SourcePool {
		t.Fatalf("second Ensure = %+v, %v; want a hit", b, err)
	}
	if d := cmp.Diff(want, series(t, rd)); d != "" {
		t.Fatalf("after a hit (-want +got):\n%s", d)
	}

	// The eviction itself takes the base off the gauges: Evict lists the
	// pool before it deletes anything.
	if err := c.Evict(ctx, img); err != nil {
		t.Fatal(err)
	}
	want[key(obs.MetricImageEvictions, "e")] = "1"
	want[key(obs.MetricImageBaseCount, "e")] = "0"
	want[key(obs.MetricImageBaseUsage, "e")] = "0"
	if d := cmp.Diff(want, series(t, rd)); d != "" {
		t.Fatalf("after Evict (-want +got):\n%s", d)
	}
	if err := c.Evict(ctx, img); err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(want, series(t, rd)); d != "" {
		t.Fatalf("after evicting a base that is gone (-want +got):\n%s", d)
	}

	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	delete(want, key(obs.MetricImageBaseCount, "e"))
	delete(want, key(obs.MetricImageBaseUsage, "e"))
	if d := cmp.Diff(want, series(t, rd)); d != "" {
		t.Fatalf("after Close (-want +got):\n%s", d)
	}
}

// Two caches sharing one download of the mirror: the one that started it
// counts the image's bytes under mirror, the one that joined under shared;
// the mirror served one GET.
func TestMetricsSharedDownload(t *testing.T) {
	t.Parallel()
	body, sum := testImage(400 << 10)
	rd := metrictest.New(t)
	f := smallFanout()
	srv := serve(t, body, func(w http.ResponseWriter, r *http.Request) {
		waitMembers(f, 2)
		w.Header().Set("Content-Length", itoa(len(body)))
		_, _ = w.Write(body)
	})
	cs, _ := fanHosts(t, 2, f, func(_ int, cfg *Config) { metered(rd)(cfg) })
	img := imagecache.Image{Key: "k", URL: srv.url, SHA256: sum}
	bases, problems := ensureAll(t, cs, img)
	want := map[string]string{}
	for i, b := range bases {
		if problems[i] != nil {
			t.Fatalf("host %d: %v", i, problems[i])
		}
		e := cs[i].cfg.Entry
		want[key(obs.MetricImageTransferSize, e, "egressproxy.image.source", b.Source)] = itoa(len(body))
		want[key(obs.MetricImageFetchDuration, e, "egressproxy.image.source", b.Source)] = "count 1"
		want[key(obs.MetricImageBaseCount, e)] = "1"
		want[key(obs.MetricImageBaseUsage, e)] = itoa(len(body))
	}
	if s := countSources(bases); s[imagecache.SourceMirror] != 1 || s[imagecache.SourceShared] != 1 || srv.gets.Load() != 1 {
		t.Fatalf("sources %v after %d GETs; want one mirror and one shared after one", s, srv.gets.Load())
	}
	if d := cmp.Diff(want, series(t, rd)); d != "" {
		t.Fatalf("(-want +got):\n%s", d)
	}
}

// A late host copies the base a peer published: its bytes count under
// peer. When the peer's stream is cut, the download finishes from the
// mirror: the bytes are split between peer and mirror (adding up to the
// image) and the fetch's source is switched. When the peer's bytes do not
// hash to the digest, that is a digest failure of a peer's bytes, and the
// fetch from the mirror alone that follows counts the image again under
// mirror.
func TestMetricsPeer(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		fault func(peer *libvirtfake.Host, vol string, body []byte)
		check func(t *testing.T, e string, n int, got map[string]string)
	}{
		{"copy", nil, func(t *testing.T, e string, n int, got map[string]string) {
			want := map[string]string{
				key(obs.MetricImageTransferSize, e, "egressproxy.image.source", "peer"):  itoa(n),
				key(obs.MetricImageFetchDuration, e, "egressproxy.image.source", "peer"): "count 1",
			}
			if d := cmp.Diff(want, got); d != "" {
				t.Errorf("(-want +got):\n%s", d)
			}
		}},
		{"cut", func(peer *libvirtfake.Host, _ string, _ []byte) {
			peer.SetStreamHook("StorageVolDownload", libvirtfake.CutAfter(100<<10, libvirtfake.ErrKilled))
		}, func(t *testing.T, e string, n int, got map[string]string) {
			fromPeer, _ := strconv.Atoi(got[key(obs.MetricImageTransferSize, e, "egressproxy.image.source", "peer")])
			fromMirror, _ := strconv.Atoi(got[key(obs.MetricImageTransferSize, e, "egressproxy.image.source", "mirror")])
			if fromPeer <= 0 || fromMirror <= 0 || fromPeer+fromMirror != n {
				t.Errorf("%d bytes from the peer and %d from the mirror; want both, adding up to %d", fromPeer, fromMirror, n)
			}
			if c := got[key(obs.MetricImageFetchDuration, e, "egressproxy.image.source", "switched")]; c != "count 1" {
				t.Errorf("switched fetch durations: %q, want count 1; series %v", c, got)
			}
			if len(got) != 3 {
				t.Errorf("series %v, want only those three", got)
			}
		}},
		{"other bytes under the marker", func(peer *libvirtfake.Host, vol string, body []byte) {
			bad := slices.Clone(body)
			bad[len(bad)/2] ^= 0xff
			if err := peer.SetVolumeData(fakePool, vol, bad); err != nil {
				panic(err)
			}
		}, func(t *testing.T, e string, n int, got map[string]string) {
			want := map[string]string{
				key(obs.MetricImageTransferSize, e, "egressproxy.image.source", "peer"):                                        itoa(n),
				key(obs.MetricImageTransferSize, e, "egressproxy.image.source", "mirror"):                                      itoa(n),
				key(obs.MetricImageVerifyFailures, e, "egressproxy.image.check", "digest", "egressproxy.image.source", "peer"): "1",
				key(obs.MetricImageFetchDuration, e, "egressproxy.image.source", "mirror"):                                     "count 1",
			}
			if d := cmp.Diff(want, got); d != "" {
				t.Errorf("(-want +got):\n%s", d)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			rd := metrictest.New(t)
			cs, hs, _, img, body := peerHosts(t, 2, func(i int, cfg *Config) {
				stallFast(cfg)
				if i == 1 {
					metered(rd)(cfg)
				}
			})
			if tc.fault != nil {
				tc.fault(hs[0], cs[0].BaseName(img), body)
			}
			b, err := cs[1].Ensure(testCtx(t, 30*time.Second), img)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("source %s", b.Source)
			e := cs[1].cfg.Entry
			got := series(t, rd)
			if got[key(obs.MetricImageBaseCount, e)] != "1" || got[key(obs.MetricImageBaseUsage, e)] != itoa(len(body)) {
				t.Errorf("bases: %v", got)
			}
			delete(got, key(obs.MetricImageBaseCount, e))
			delete(got, key(obs.MetricImageBaseUsage, e))
			tc.check(t, e, len(body), got)
		})
	}
}

// A raw image whose base another entry of the same host published is
// copied inside the host: its bytes count under peer.
func TestMetricsCopyInsideTheHost(t *testing.T) {
	t.Parallel()
	body, sum := rawImage(200 << 10)
	srv := serve(t, body, nil)
	h := libvirtfake.New()
	h.SetChunkSize(fakeChunk)
	if err := h.AddPool(fakePool, 64<<20); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	rd := metrictest.New(t)
	f := smallFanout()
	a := cacheOnHost(t, h, "ea", fakePool, f, nil)
	b := cacheOnHost(t, h, "eb", fakePool, f, metered(rd))
	img := imagecache.Image{Key: "k", URL: srv.url, SHA256: sum, Format: imagecache.FormatRaw}
	ctx := testCtx(t, 30*time.Second)
	if _, err := a.Ensure(ctx, img); err != nil {
		t.Fatal(err)
	}
	if got, err := b.Ensure(ctx, img); err != nil || got.Source != imagecache.SourcePeer || srv.gets.Load() != 1 {
		t.Fatalf("Ensure beside a base on the host = %+v, %v after %d GETs; want a copy", got, err, srv.gets.Load())
	}
	want := map[string]string{
		key(obs.MetricImageTransferSize, "eb", "egressproxy.image.source", "peer"):  itoa(len(body)),
		key(obs.MetricImageFetchDuration, "eb", "egressproxy.image.source", "peer"): "count 1",
		key(obs.MetricImageBaseCount, "eb"):                                         "1",
		key(obs.MetricImageBaseUsage, "eb"):                                         itoa(len(body)),
	}
	if d := cmp.Diff(want, series(t, rd)); d != "" {
		t.Fatalf("(-want +got):\n%s", d)
	}
}

// A host whose upload stalls is detached from the shared download: what
// it read before counts under the source it read (mirror or shared, as it
// started the download or joined it), what it read on its own from the
// offset it resumed at (its Range request) under detached.
func TestMetricsDetached(t *testing.T) {
	t.Parallel()
	body, sum := testImage(1 << 20)
	rd := metrictest.New(t)
	f := smallFanout()
	srv := serveRanges(t, body, nil, true, func() { waitMembers(f, 2) })
	cs, hs := fanHosts(t, 2, f, func(i int, cfg *Config) {
		cfg.StreamStall = time.Minute // the stall is ours
		if i == 1 {
			metered(rd)(cfg)
		}
	})
	release := make(chan struct{})
	var once sync.Once
	hs[1].SetStreamHook("StorageVolUpload", func(call libvirtfake.Call) error {
		if call.Done >= 64<<10 {
			return call.Wait(release)
		}
		return nil
	})
	img := imagecache.Image{Key: "k", URL: srv.url, SHA256: sum}
	var other atomic.Value
	var wg sync.WaitGroup
	wg.Go(func() {
		_, err := cs[0].Ensure(testCtx(t, 30*time.Second), img)
		other.Store(errString(err))
		once.Do(func() { close(release) }) // host 0 is done: host 1 moves again
	})
	b, err := cs[1].Ensure(testCtx(t, 30*time.Second), img)
	wg.Wait()
	if err != nil || b.Source != imagecache.SourceDetached || other.Load() != "" {
		t.Fatalf("stalled host: %+v, %v (the other: %q); want a detached fetch", b, err, other.Load())
	}
	srv.mu.Lock()
	ranges := slices.Clone(srv.ranges)
	srv.mu.Unlock()
	off, err := strconv.Atoi(strings.TrimSuffix(strings.TrimPrefix(ranges[len(ranges)-1], "bytes="), "-"))
	if len(ranges) != 2 || err != nil || off <= 0 {
		t.Fatalf("Range headers %q: want the shared GET and one resume", ranges)
	}
	got := series(t, rd)
	before := got[key(obs.MetricImageTransferSize, "e1", "egressproxy.image.source", "mirror")] + got[key(obs.MetricImageTransferSize, "e1", "egressproxy.image.source", "shared")]
	if before != itoa(off) || got[key(obs.MetricImageTransferSize, "e1", "egressproxy.image.source", "detached")] != itoa(len(body)-off) {
		t.Fatalf("resumed at %d of %d bytes; series %v", off, len(body), got)
	}
	if got[key(obs.MetricImageFetchDuration, "e1", "egressproxy.image.source", "detached")] != "count 1" {
		t.Fatalf("fetch durations: %v", got)
	}
}

// Failed checks: bytes from the mirror with another digest than the
// configured one (digest; the failed fetch is measured with its class and
// its bytes still count), a volume the host stored short (stored), a
// published base whose bytes no longer match its marker (marker).
func TestMetricsVerifyFailures(t *testing.T) {
	t.Parallel()
	body, sum := testImage(100 << 10)
	t.Run("digest", func(t *testing.T) {
		t.Parallel()
		srv := serve(t, body, nil)
		rd := metrictest.New(t)
		c, _ := newFakeCache(t, metered(rd))
		_, err := c.Ensure(testCtx(t, 30*time.Second), imagecache.Image{Key: "k", URL: srv.url, SHA256: strings.Repeat("ab", 32)})
		wantClass(t, err, errs.Permanent, "is configured")
		want := map[string]string{
			key(obs.MetricImageTransferSize, "e", "egressproxy.image.source", "mirror"):                                        itoa(len(body)),
			key(obs.MetricImageVerifyFailures, "e", "egressproxy.image.check", "digest", "egressproxy.image.source", "mirror"): "1",
			key(obs.MetricImageFetchDuration, "e", "error.type", "Permanent"):                                                  "count 1",
			key(obs.MetricImageBaseCount, "e"):                                                                                 "0",
			key(obs.MetricImageBaseUsage, "e"):                                                                                 "0",
		}
		if d := cmp.Diff(want, series(t, rd)); d != "" {
			t.Fatalf("(-want +got):\n%s", d)
		}
	})
	t.Run("stored", func(t *testing.T) {
		t.Parallel()
		srv := serve(t, body, nil)
		rd := metrictest.New(t)
		c, h := newFakeCache(t, metered(rd))
		var uploaded atomic.Bool
		h.SetStreamHook("StorageVolUpload", func(call libvirtfake.Call) error {
			if call.Done == int64(len(body)) {
				uploaded.Store(true)
			}
			return nil
		})
		var infos atomic.Int64
		h.SetHook("StorageVolGetInfoFlags", func(call libvirtfake.Call) error {
			// The drain's query, then the check before the read-back.
			if uploaded.Load() && infos.Add(1) == 2 {
				return h.SetVolumeData(call.Pool, call.Volume, body[:1000])
			}
			return nil
		})
		_, err := c.Ensure(testCtx(t, 30*time.Second), imagecache.Image{Key: "k", URL: srv.url})
		wantClass(t, err, errs.Transient, "holds 1000 bytes on the host")
		got := series(t, rd)
		if got[key(obs.MetricImageVerifyFailures, "e", "egressproxy.image.check", "stored")] != "1" ||
			got[key(obs.MetricImageFetchDuration, "e", "error.type", "Transient")] != "count 1" {
			t.Fatalf("series %v", got)
		}
	})
	t.Run("marker", func(t *testing.T) {
		t.Parallel()
		srv := serve(t, body, nil)
		rd := metrictest.New(t)
		c, h := newFakeCache(t, metered(rd))
		img := imagecache.Image{Key: "k", URL: srv.url, SHA256: sum}
		ctx := testCtx(t, 30*time.Second)
		b, err := c.Ensure(ctx, img)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Verify(ctx, img); err != nil {
			t.Fatal(err)
		}
		bad := slices.Clone(body)
		bad[7] ^= 1
		if err := h.SetVolumeData(fakePool, b.Volume, bad); err != nil {
			t.Fatal(err)
		}
		_, err = c.Verify(ctx, img)
		wantClass(t, err, errs.Permanent, "its marker says")
		want := map[string]string{
			key(obs.MetricImageTransferSize, "e", "egressproxy.image.source", "mirror"):  itoa(len(body)),
			key(obs.MetricImageFetchDuration, "e", "egressproxy.image.source", "mirror"): "count 1",
			key(obs.MetricImageVerifyFailures, "e", "egressproxy.image.check", "marker"): "1",
			key(obs.MetricImageBaseCount, "e"):                                           "1",
			key(obs.MetricImageBaseUsage, "e"):                                           itoa(len(body)),
		}
		if d := cmp.Diff(want, series(t, rd)); d != "" {
			t.Fatalf("(-want +got):\n%s", d)
		}
	})
}

// A cache that finds a published base (another process published it)
// counts it with its first listing and reads its size once, with its
// first hit, in the same call as the path; List learns sizes too. Without
// a MeterProvider a hit makes no call for it.
func TestMetricsFoundBases(t *testing.T) {
	t.Parallel()
	body, sum := testImage(100 << 10)
	srv := serve(t, body, nil)
	first, h := newFakeCache(t, nil)
	img := imagecache.Image{Key: "k", URL: srv.url, SHA256: sum}
	other := imagecache.Image{Key: "other", URL: srv.url, SHA256: sum}
	ctx := testCtx(t, 30*time.Second)
	for _, im := range []imagecache.Image{img, other} {
		if _, err := first.Ensure(ctx, im); err != nil {
			t.Fatal(err)
		}
	}
	hitCalls := func(c *Cache) int {
		h.ResetCalls()
		if b, err := c.Ensure(ctx, img); err != nil || b.Source != imagecache.SourcePool {
			t.Fatalf("Ensure = %+v, %v; want a hit", b, err)
		}
		return h.Calls("StorageVolGetInfoFlags")
	}
	if n := hitCalls(first); n != 0 {
		t.Fatalf("a hit without metrics read %d sizes", n)
	}

	rd := metrictest.New(t)
	c := cacheOnHost(t, h, fakeEntry, fakePool, nil, metered(rd))
	if n := hitCalls(c); n != 1 {
		t.Fatalf("the first hit on a found base read %d sizes, want 1", n)
	}
	want := map[string]string{
		key(obs.MetricImageBaseCount, "e"): "2",
		key(obs.MetricImageBaseUsage, "e"): itoa(len(body)), // the other base's size is not known yet
	}
	if d := cmp.Diff(want, series(t, rd)); d != "" {
		t.Fatalf("after a hit (-want +got):\n%s", d)
	}
	if n := hitCalls(c); n != 0 {
		t.Fatalf("the second hit read %d sizes, want 0", n)
	}
	if _, err := c.List(ctx); err != nil {
		t.Fatal(err)
	}
	want[key(obs.MetricImageBaseUsage, "e")] = itoa(2 * len(body))
	if d := cmp.Diff(want, series(t, rd)); d != "" {
		t.Fatalf("after List (-want +got):\n%s", d)
	}
}

// A listing that began before a publish or an eviction and ends after it
// does not undo it; the next listing is the truth again.
func TestInventoryListingRaces(t *testing.T) {
	t.Parallel()
	const base = "base-e--k.qcow2"
	digest := strings.Repeat("ab", 32)
	marker := MarkerName(base, digest)
	v := inventory{entry: "e"}
	totals := func() [2]int64 {
		c, u, _ := v.totals()
		return [2]int64{c, u}
	}

	g := v.begin()
	v.published(base, digest, 10)
	v.listed(g, []string{base}) // listed before the marker was created
	if got := totals(); got != [2]int64{1, 10} {
		t.Fatalf("a listing older than the publish: %v, want 1 base of 10 bytes", got)
	}
	v.listed(v.begin(), nil) // removed behind the cache's back
	if got := totals(); got != [2]int64{0, 0} {
		t.Fatalf("a listing without it: %v", got)
	}

	v.listed(v.begin(), []string{base, marker})
	g = v.begin()
	v.unpublished(base)
	v.listed(g, []string{base, marker}) // listed before Evict removed it
	if got := totals(); got != [2]int64{0, 0} {
		t.Fatalf("a listing older than the eviction: %v, want none", got)
	}
	v.listed(v.begin(), []string{base, marker, MarkerName("base-other--k.qcow2", digest), "base-other--k.qcow2"})
	if got := totals(); got != [2]int64{1, 0} {
		t.Fatalf("a later listing finding it (and another entry's base): %v, want 1 of unknown size", got)
	}
	v.listed(v.begin(), []string{base, marker, MarkerName(base, strings.Repeat("cd", 32))})
	if got := totals(); got != [2]int64{0, 0} {
		t.Fatalf("two markers: %v, want none published", got)
	}
}

// Without a MeterProvider the cache has no instruments: every hook is a
// nil check that allocates nothing (the read of a found base's size on a
// hit is TestMetricsFoundBases's).
func TestMetricsNone(t *testing.T) {
	c, _ := newFakeCache(t, nil)
	if c.meters != nil {
		t.Fatalf("meters %+v without a MeterProvider", c.meters)
	}
	m := c.meters
	allocs := testing.AllocsPerRun(100, func() {
		m.listing()(nil)
		m.tally(mirrorOrigin{}).add(1 << 20)
		m.transferred(srcPeer, 1)
		m.fetched(time.Second, Base{Source: imagecache.SourceMirror}, nil)
		m.verifyFailed(checkDigest, imagecache.SourceMirror)
		m.evicted("base-e--k.qcow2", true)
		m.published("base-e--k.qcow2", "d", 1)
		m.sized("base-e--k.qcow2", 1)
		_ = m.needsSize("base-e--k.qcow2")
		m.close()
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per run of the hooks without a MeterProvider", allocs)
	}
}
