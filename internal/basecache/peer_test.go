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

// Whatever goes wrong with a copy from a peer, the cold host publishes
// within the same Ensure (never a Permanent error from a peer's fault):
// a stream cut or stalled makes the download switch to the mirror from
// where it was (source peer+mirror: what was written is kept), bytes that
// do not hash to the digest make the fetch start again from the mirror
// alone (source mirror). Nothing is left on it but its base and marker,
// and the peer that failed is not asked again right away. A peer whose
// base is evicted while it is copied keeps serving the file it opened:
// the copy is verified and published.
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
		}, "peer+mirror"},
		{"stalled", func(peer *libvirtfake.Host, vol string, _ []byte) func() {
			release := make(chan struct{})
			peer.SetStreamHook("StorageVolDownload", libvirtfake.StallAfter(100<<10, release))
			return func() { close(release) }
		}, "peer+mirror"},
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
			fellBack := b.Source != imagecache.SourcePeer
			if fellBack && srv.gets.Load() != gets+1 {
				t.Fatalf("%d GETs for the fallback, want 1", srv.gets.Load()-gets)
			}
			if !fellBack && srv.gets.Load() != gets {
				t.Fatalf("%d GETs beside a copy from the peer, want 0", srv.gets.Load()-gets)
			}
			if n := hs[0].OpenSessions(); n != 0 {
				t.Fatalf("%d dedicated sessions left open on the peer", n)
			}
			if fellBack {
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
