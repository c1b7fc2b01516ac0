package basecache

import (
	"bytes"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/testing/libvirtfake"
	"github.com/go-logr/logr/funcr"
	"go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

// peerHosts returns n caches on n fake hosts sharing a Fanout (peers on),
// and an image served by a counting mirror; cache 0 has published it.
func peerHosts(t *testing.T, n int, mod func(i int, cfg *Config)) ([]*Cache, []*libvirtfake.Host, *served, imagecache.Image, []byte) {
	t.Helper()
	body, sum := testImage(400 << 10)
	srv := serve(t, body, nil)
	cs, hs := fanHosts(t, n, smallFanout(), mod)
	img := imagecache.Image{Key: "k", URL: srv.url, SHA256: sum}
	b, err := cs[0].Ensure(testCtx(t, 30*time.Second), img)
	if err != nil || b.Source != imagecache.SourceMirror {
		t.Fatalf("host 0: %+v, %v; want a download from the mirror", b, err)
	}
	if g := srv.gets.Load(); g != 1 {
		t.Fatalf("%d GETs for host 0, want 1", g)
	}
	return cs, hs, srv, img, body
}

// A host going cold after another published the image copies the base from
// that host's volume: no GET, source peer, the span and the log line name
// the peer, and what it publishes is the digest of its own read-back of
// the bytes (the peer's base is read once, from byte 0). The next Ensure
// is a hit.
func TestPeerLateJoinerCopies(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := trace.NewTracerProvider(trace.WithSpanProcessor(rec))
	var mu sync.Mutex
	var lines []string
	log := funcr.New(func(prefix, args string) {
		mu.Lock()
		lines = append(lines, args)
		mu.Unlock()
	}, funcr.Options{})
	cs, hs, srv, img, body := peerHosts(t, 2, func(i int, cfg *Config) {
		if i == 1 {
			cfg.TracerProvider = tp
			cfg.Logger = log
		}
	})
	reads := hs[0].Calls("StorageVolDownload")
	b, err := cs[1].Ensure(testCtx(t, 30*time.Second), img)
	if err != nil {
		t.Fatal(err)
	}
	wantPublished(t, cs[1], hs[1], img, b, body, img.SHA256)
	if b.Source != imagecache.SourcePeer {
		t.Fatalf("source %q, want %q", b.Source, imagecache.SourcePeer)
	}
	if g := srv.gets.Load(); g != 1 {
		t.Fatalf("the mirror served %d GETs in all, want 1 (host 0's)", g)
	}
	if n := hs[0].Calls("StorageVolDownload") - reads; n != 1 {
		t.Fatalf("host 0's base was read %d times, want once", n)
	}
	if n := hs[0].OpenSessions(); n != 0 {
		t.Fatalf("%d dedicated sessions left open on the peer", n)
	}
	var fetchSpan bool
	for _, s := range rec.Ended() {
		if s.Name() != "imagecache.Fetch" {
			continue
		}
		fetchSpan = true
		attrs := map[string]string{}
		for _, a := range s.Attributes() {
			attrs[string(a.Key)] = a.Value.String()
		}
		if attrs["imagecache.source"] != imagecache.SourcePeer || attrs["imagecache.peer"] != cs[0].cfg.Entry {
			t.Fatalf("imagecache.Fetch attributes %v, want source peer and peer %s", attrs, cs[0].cfg.Entry)
		}
	}
	if !fetchSpan {
		t.Fatal("no imagecache.Fetch span")
	}
	mu.Lock()
	var published string
	for _, l := range lines {
		if strings.Contains(l, `"msg"="published base"`) {
			published = l
		}
	}
	mu.Unlock()
	if !strings.Contains(published, `"source"="peer"`) || !strings.Contains(published, `"peer"="`+cs[0].cfg.Entry+`"`) {
		t.Fatalf("published line %q does not name the source and the peer", published)
	}
	if b, err := cs[1].Ensure(testCtx(t, 10*time.Second), img); err != nil || b.Source != imagecache.SourcePool {
		t.Fatalf("second Ensure = %+v, %v; want a hit", b, err)
	}
}

// Whatever goes wrong with a copy from a peer — its stream cut, stalled,
// the bytes it serves not hashing to the digest — the cold host falls back
// to the mirror within the same Ensure and publishes (never a Permanent
// error from a peer's fault); nothing is left on it but its base and
// marker, and the peer that failed is not asked again right away. A peer
// whose base is evicted while it is copied keeps serving the file it
// opened: the copy is verified and published.
func TestPeerFaultFallsBackToMirror(t *testing.T) {
	for _, tc := range []struct {
		name  string
		fault func(peer *libvirtfake.Host, vol string, body []byte) func()
		// source is the cold host's, "" for either peer or mirror.
		source string
	}{
		{"cut", func(peer *libvirtfake.Host, vol string, _ []byte) func() {
			peer.SetStreamHook("StorageVolDownload", libvirtfake.CutAfter(100<<10, libvirtfake.ErrKilled))
			return nil
		}, imagecache.SourceMirror},
		{"stalled", func(peer *libvirtfake.Host, vol string, _ []byte) func() {
			release := make(chan struct{})
			peer.SetStreamHook("StorageVolDownload", libvirtfake.StallAfter(100<<10, release))
			return func() { close(release) }
		}, imagecache.SourceMirror},
		{"other bytes under the marker", func(peer *libvirtfake.Host, vol string, body []byte) func() {
			bad := slices.Clone(body)
			bad[len(bad)/2] ^= 0xff
			if err := peer.SetVolumeData(fakePool, vol, bad); err != nil {
				panic(err)
			}
			return nil
		}, imagecache.SourceMirror},
		{"evicted mid-copy", func(peer *libvirtfake.Host, vol string, _ []byte) func() {
			var once sync.Once
			peer.SetStreamHook("StorageVolDownload", func(c libvirtfake.Call) error {
				if c.Volume == vol && c.Done >= 100<<10 {
					once.Do(func() { // as Evict does: the markers, then the base
						for _, n := range peer.VolumeNames(fakePool) {
							if isMarkerOf(vol, n) || n == vol {
								_ = peer.Shared().StorageVolDelete(libvirt.StorageVol{Pool: fakePool, Name: n}, 0)
							}
						}
					})
				}
				return nil
			})
			return nil
		}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cs, hs, srv, img, body := peerHosts(t, 3, func(i int, cfg *Config) {
				stallFast(cfg)
			})
			peerVol := cs[0].BaseName(img)
			if done := tc.fault(hs[0], peerVol, body); done != nil {
				defer done()
			}
			gets := srv.gets.Load()
			b, err := cs[1].Ensure(testCtx(t, 30*time.Second), img)
			if err != nil {
				t.Fatalf("cold host beside a failing peer: %v", err)
			}
			wantPublished(t, cs[1], hs[1], img, b, body, img.SHA256)
			if tc.source != "" && b.Source != tc.source {
				t.Fatalf("source %q, want %q", b.Source, tc.source)
			}
			if b.Source == imagecache.SourceMirror && srv.gets.Load() != gets+1 {
				t.Fatalf("%d GETs for the fallback, want 1", srv.gets.Load()-gets)
			}
			if b.Source == imagecache.SourcePeer && srv.gets.Load() != gets {
				t.Fatalf("%d GETs beside a copy from the peer, want 0", srv.gets.Load()-gets)
			}
			if n := hs[0].OpenSessions(); n != 0 {
				t.Fatalf("%d dedicated sessions left open on the peer", n)
			}
			if b.Source == imagecache.SourceMirror {
				// The failed peer is left alone for a while: the third
				// host copies from host 1 (the other peer), not host 0.
				reads := hs[0].Calls("StorageVolDownload")
				b, err := cs[2].Ensure(testCtx(t, 30*time.Second), img)
				if err != nil || b.Source != imagecache.SourcePeer {
					t.Fatalf("third host: %+v, %v; want a copy from host 1", b, err)
				}
				if n := hs[0].Calls("StorageVolDownload") - reads; n != 0 {
					t.Fatalf("the failed peer was asked again (%d reads)", n)
				}
			}
		})
	}
}

// A peer is used only for an image with a configured digest whose base the
// peer has published with a marker of that digest; with peers off, for a
// cache with another HTTP client, a closed peer, or a base without its
// marker or with another digest's, the cold host downloads from the mirror.
func TestPeerOnlyWhenPublished(t *testing.T) {
	for _, tc := range []struct {
		name  string
		mod   func(i int, cfg *Config)
		setup func(t *testing.T, cs []*Cache, hs []*libvirtfake.Host, img *imagecache.Image)
	}{
		{"no digest configured", nil, func(t *testing.T, cs []*Cache, hs []*libvirtfake.Host, img *imagecache.Image) { img.SHA256 = "" }},
		{"peers off", func(i int, cfg *Config) {
			if i == 1 {
				cfg.Fanout = NewFanout(FanoutOptions{MirrorOnly: true})
			}
		}, nil},
		{"another HTTP client", func(i int, cfg *Config) {
			if i == 1 {
				cfg.HTTPClient = &http.Client{}
			}
		}, nil},
		{"peer closed", nil, func(t *testing.T, cs []*Cache, hs []*libvirtfake.Host, img *imagecache.Image) {
			if err := cs[0].Close(); err != nil {
				t.Fatal(err)
			}
		}},
		{"marker missing", nil, func(t *testing.T, cs []*Cache, hs []*libvirtfake.Host, img *imagecache.Image) {
			name := cs[0].BaseName(*img)
			if err := hs[0].Shared().StorageVolDelete(libvirt.StorageVol{Pool: fakePool, Name: MarkerName(name, img.SHA256)}, 0); err != nil {
				t.Fatal(err)
			}
		}},
		{"a second marker (ambiguous)", nil, func(t *testing.T, cs []*Cache, hs []*libvirtfake.Host, img *imagecache.Image) {
			if err := hs[0].PutVolume(fakePool, libvirtfake.Volume{Name: MarkerName(cs[0].BaseName(*img), strings.Repeat("cd", 32))}); err != nil {
				t.Fatal(err)
			}
		}},
		{"marker of another digest", nil, func(t *testing.T, cs []*Cache, hs []*libvirtfake.Host, img *imagecache.Image) {
			name := cs[0].BaseName(*img)
			other := strings.Repeat("ab", 32)
			if err := hs[0].Shared().StorageVolDelete(libvirt.StorageVol{Pool: fakePool, Name: MarkerName(name, img.SHA256)}, 0); err != nil {
				t.Fatal(err)
			}
			if err := hs[0].PutVolume(fakePool, libvirtfake.Volume{Name: MarkerName(name, other)}); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cs, hs, srv, img, body := peerHosts(t, 2, tc.mod)
			if tc.setup != nil {
				tc.setup(t, cs, hs, &img)
			}
			reads := hs[0].Calls("StorageVolDownload")
			b, err := cs[1].Ensure(testCtx(t, 30*time.Second), img)
			if err != nil {
				t.Fatal(err)
			}
			if b.Source != imagecache.SourceMirror || srv.gets.Load() != 2 {
				t.Fatalf("source %q after %d GETs in all; want a download from the mirror (2 GETs)", b.Source, srv.gets.Load())
			}
			if n := hs[0].Calls("StorageVolDownload") - reads; n != 0 {
				t.Fatalf("host 0's volumes were read %d times", n)
			}
			if got, _ := hs[1].Volume(fakePool, b.Volume); !bytes.Equal(got.Data, body) {
				t.Fatal("host 1 does not hold the image")
			}
		})
	}
}

// Which peers a cache may copy from: not itself, not one with another HTTP
// client, not one whose copy failed within peerBackoff, not one whose last
// copy was slower than the last download of the image from the mirror.
func TestPeersFor(t *testing.T) {
	f := smallFanout()
	cs, _ := fanHosts(t, 4, f, func(i int, cfg *Config) {
		if i == 3 {
			cfg.HTTPClient = &http.Client{}
		}
	})
	key := cs[0].fanKey(imagecache.Image{URL: "http://m/i", SHA256: strings.Repeat("0", 64)})
	names := func() []string {
		var out []string
		for _, p := range f.peersFor(cs[0], key) {
			out = append(out, p.cfg.Entry)
		}
		return out
	}
	if got := names(); !slices.Equal(got, []string{"e1", "e2"}) {
		t.Fatalf("peers %q, want e1 e2", got)
	}
	f.noteMirror(key, 100e6)
	f.noteCopy(cs[1], 50e6, true) // slower than the mirror
	f.noteCopy(cs[2], 200e6, true)
	if got := names(); !slices.Equal(got, []string{"e2"}) {
		t.Fatalf("peers %q, want e2 (e1 is slower than the mirror)", got)
	}
	f.noteCopy(cs[2], 0, false)
	if got := names(); len(got) != 0 {
		t.Fatalf("peers %q, want none (e2 just failed)", got)
	}
	f.pmu.Lock()
	f.peerStats[cs[2]].failed = time.Now().Add(-peerBackoff - time.Second)
	f.pmu.Unlock()
	if got := names(); !slices.Equal(got, []string{"e2"}) {
		t.Fatalf("peers %q, want e2 again after peerBackoff", got)
	}
}

// Concurrent cold hosts beside several peers spread their copies over them
// (the least busy peer first): two cold hosts, two peers, one copy each.
func TestPeerCopiesSpread(t *testing.T) {
	cs, hs, srv, img, body := peerHosts(t, 4, nil)
	if b, err := cs[1].Ensure(testCtx(t, 30*time.Second), img); err != nil || b.Source != imagecache.SourcePeer {
		t.Fatalf("host 1: %+v, %v", b, err)
	}
	// Forget the rates measured so far (on fakes, whether the copy from
	// host 0 beat the mirror is luck): both peers are to be asked.
	f := cs[0].cfg.Fanout
	f.pmu.Lock()
	f.mirrorRate, f.peerStats = nil, nil
	f.pmu.Unlock()
	release := make(chan struct{})
	// copying[i]: a copy from peer i has started (and is held).
	copying := []*signal{newSignal(), newSignal()}
	for i, h := range hs[:2] {
		h.SetStreamHook("StorageVolDownload", func(c libvirtfake.Call) error {
			if strings.HasPrefix(c.Volume, basePrefix) && c.Done == 0 {
				_ = copying[i].seen(c)
				return c.Wait(release)
			}
			return nil
		})
	}
	r0, r1 := hs[0].Calls("StorageVolDownload"), hs[1].Calls("StorageVolDownload")
	var wg sync.WaitGroup
	bases := make([]Base, 2)
	errs := make([]error, 2)
	wg.Go(func() { bases[0], errs[0] = cs[2].Ensure(testCtx(t, 30*time.Second), img) })
	// The first copy holds one peer busy.
	select {
	case <-copying[0].ch:
	case <-copying[1].ch:
	case <-time.After(10 * time.Second):
		t.Error("the first cold host copied from no peer")
	}
	wg.Go(func() { bases[1], errs[1] = cs[3].Ensure(testCtx(t, 30*time.Second), img) })
	// The second copy starts on the other peer, the least busy one.
	if !copying[0].within(10*time.Second) || !copying[1].within(10*time.Second) {
		t.Error("the two cold hosts did not copy from one peer each")
	}
	close(release)
	wg.Wait()
	for i := range 2 {
		if errs[i] != nil || bases[i].Source != imagecache.SourcePeer {
			t.Fatalf("host %d: %+v, %v", i+2, bases[i], errs[i])
		}
		wantPublished(t, cs[i+2], hs[i+2], img, bases[i], body, img.SHA256)
	}
	// Each peer's base read once (the read-backs of the cold hosts'
	// own volumes are on their own hosts).
	if d0, d1 := hs[0].Calls("StorageVolDownload")-r0, hs[1].Calls("StorageVolDownload")-r1; d0 != 1 || d1 != 1 {
		t.Fatalf("peer reads %d and %d, want one each", d0, d1)
	}
	if g := srv.gets.Load(); g != 1 {
		t.Fatalf("%d GETs in all, want 1", g)
	}
}

// A peer whose host does not answer (its listing blocks) costs a cold
// fetch at most peerLookTimeout: the cold host then downloads from the
// mirror.
func TestPeerNotAnswering(t *testing.T) {
	cs, hs, srv, img, body := peerHosts(t, 3, nil)
	release := make(chan struct{})
	t.Cleanup(func() { close(release) }) // before the hosts close (LIFO)
	hs[0].SetHook("StoragePoolListAllVolumes", libvirtfake.Block(release))
	start := time.Now()
	b, err := cs[1].Ensure(testCtx(t, 30*time.Second), img)
	took := time.Since(start)
	if err != nil || b.Source != imagecache.SourceMirror {
		t.Fatalf("cold host beside a peer that does not answer: %+v, %v; want a download", b, err)
	}
	wantPublished(t, cs[1], hs[1], img, b, body, img.SHA256)
	if srv.gets.Load() != 2 {
		t.Fatalf("%d GETs in all, want 2", srv.gets.Load())
	}
	if took < peerLookTimeout || took > peerLookTimeout+3*time.Second {
		t.Fatalf("took %v, want about peerLookTimeout (%v) more than a download", took, peerLookTimeout)
	}
}
