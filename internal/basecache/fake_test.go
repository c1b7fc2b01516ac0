package basecache

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"net/http"
	"net/http/httptest"
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
	"github.com/egressproxy/egressproxy/internal/libvirtconn"
	"github.com/egressproxy/egressproxy/internal/testing/eventually"
	"github.com/egressproxy/egressproxy/internal/testing/libvirtfake"
	"github.com/egressproxy/egressproxy/sshconn"
	"go.uber.org/goleak"
	"libvirt.org/go/libvirtxml"
)

// fakeLink is a Conn onto an in-memory libvirtd.
type fakeLink struct{ h *libvirtfake.Host }

func (f fakeLink) Do(ctx context.Context, fn func(Libvirt) error) error {
	return f.h.Do(ctx, func(s *libvirtfake.Session) error { return fn(s) })
}

func (f fakeLink) Dedicated(ctx context.Context) (Dedicated, error) {
	s, err := f.h.Dedicated(ctx)
	if err != nil {
		return nil, err
	}
	return fakeDedicated{s}, nil
}

type fakeDedicated struct{ s *libvirtfake.Session }

func (d fakeDedicated) Libvirt() Libvirt { return d.s }
func (d fakeDedicated) Close() error     { return d.s.Close() }
func (d fakeDedicated) Kill()            { d.s.Kill() }

// stallFast is the StreamStall of tests that stall a stream on purpose.
func stallFast(cfg *Config) { cfg.StreamStall = 300 * time.Millisecond }

const (
	fakePool  = "p"
	fakeEntry = "e"
	fakeChunk = 16 << 10
)

// testImage is a qcow2-looking body of n bytes (deterministic) and its
// sha256.
func testImage(n int) ([]byte, string) {
	b := make([]byte, n)
	r := mrand.New(mrand.NewPCG(1, uint64(n)))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	copy(b, qcow2Magic)
	sum := sha256.Sum256(b)
	return b, hex.EncodeToString(sum[:])
}

// served is an httptest server of one image.
type served struct {
	url  string
	gets atomic.Int64
	// first is closed when the first GET arrives.
	first     chan struct{}
	firstOnce sync.Once
}

// serve serves body at /img.qcow2; handler, when set, replaces the plain
// answer (gets is counted either way).
func serve(t *testing.T, body []byte, handler http.HandlerFunc) *served {
	t.Helper()
	s := &served{first: make(chan struct{})}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.gets.Add(1)
		s.firstOnce.Do(func() { close(s.first) })
		if handler != nil {
			handler(w, r)
			return
		}
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		_, _ = w.Write(body)
	}))
	t.Cleanup(srv.Close)
	s.url = srv.URL + "/img.qcow2"
	return s
}

// newFakeCache returns a cache on a fresh fake host with pool p of 64 MiB.
func newFakeCache(t *testing.T, mod func(*Config)) (*Cache, *libvirtfake.Host) {
	t.Helper()
	h := libvirtfake.New()
	h.SetChunkSize(fakeChunk)
	if err := h.AddPool(fakePool, 64<<20); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	// StreamStall: long enough that a loaded machine never stalls a stream
	// by accident; tests of stalls set stallFast.
	cfg := Config{Entry: fakeEntry, Pool: fakePool, StreamStall: 5 * time.Second}
	if mod != nil {
		mod(&cfg)
	}
	c, err := New(fakeLink{h}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c, h
}

func testCtx(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// wantVolumes fails unless the pool holds exactly want.
func wantVolumes(t *testing.T, h *libvirtfake.Host, want ...string) {
	t.Helper()
	got := h.VolumeNames(fakePool)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("pool holds %q, want %q", got, want)
	}
}

// wantLeft checks what a finished fetch left: exactly the volumes want in
// the pool, and no dedicated session open.
func wantLeft(t *testing.T, h *libvirtfake.Host, want ...string) {
	t.Helper()
	wantVolumes(t, h, want...)
	if n := h.OpenSessions(); n != 0 {
		t.Fatalf("%d dedicated sessions left open", n)
	}
}

func wantClass(t *testing.T, err error, code errs.ErrorCode, text string) {
	t.Helper()
	if errs.Code(err) != code || !strings.Contains(fmt.Sprint(err), text) {
		t.Fatalf("err = %v (%v), want %v containing %q", err, errs.Code(err), code, text)
	}
}

func domainXML(name string, disks ...libvirtxml.DomainDisk) string {
	d := libvirtxml.Domain{Type: "kvm", Name: name, Devices: &libvirtxml.DomainDeviceList{Disks: disks}}
	x, err := d.Marshal()
	if err != nil {
		panic(err)
	}
	return x
}

func fileDisk(dev, path string) libvirtxml.DomainDisk {
	return libvirtxml.DomainDisk{
		Device: "disk",
		Driver: &libvirtxml.DomainDiskDriver{Name: "qemu", Type: "qcow2"},
		Source: &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: path}},
		Target: &libvirtxml.DomainDiskTarget{Dev: dev},
	}
}

// The whole path on the fake: GET, upload, read-back, publish; then a hit
// without HTTP or upload, Verify, List (with the domains using the base),
// Evict refused while used, Evict.
func TestFakeFetchHitVerifyListEvict(t *testing.T) {
	body, sum := testImage(200 << 10)
	srv := serve(t, body, nil)
	var progress atomic.Int64
	c, h := newFakeCache(t, func(cfg *Config) {
		cfg.ProgressInterval = time.Nanosecond
		cfg.Progress = func(p imagecache.Progress) { progress.Store(p.Bytes) }
	})
	img := imagecache.Image{Key: "deb.12", URL: srv.url, SHA256: sum}
	ctx := testCtx(t, 30*time.Second)

	b, err := c.Ensure(ctx, img)
	if err != nil {
		t.Fatal(err)
	}
	name := BaseName(fakeEntry, "deb.12", imagecache.FormatQCOW2)
	want := Base{Volume: name, Path: "/pools/p/" + name, Digest: sum, Format: imagecache.FormatQCOW2, Source: imagecache.SourceMirror}
	if b != want {
		t.Fatalf("Ensure = %+v, want %+v", b, want)
	}
	want.Source = imagecache.SourcePool // a hit from now on; List and Verify leave Source empty
	wantVolumes(t, h, name, MarkerName(name, sum))
	if got, _ := h.Volume(fakePool, name); !slices.Equal(got.Data, body) {
		t.Fatalf("stored %d bytes, not the image's %d", len(got.Data), len(body))
	}
	if progress.Load() != int64(len(body)) {
		t.Fatalf("last progress %d bytes, want %d", progress.Load(), len(body))
	}
	if n := h.OpenSessions(); n != 0 {
		t.Fatalf("%d dedicated sessions left open", n)
	}

	// A hit: no GET, no upload, no read-back; two calls in a row (the
	// listing, the path of the listing's volume; the pool's handle is the
	// one the fetch looked up), each a round trip on a link.
	img.SHA256 = "" // any digest is accepted
	callsBefore := map[string]int{}
	hitCalls := []string{"StoragePoolLookupByName", "StoragePoolListAllVolumes", "StorageVolLookupByName", "StorageVolGetPath"}
	for _, m := range hitCalls {
		callsBefore[m] = h.Calls(m)
	}
	if b2, err := c.Ensure(ctx, img); err != nil || b2 != want {
		t.Fatalf("hit = %+v, %v", b2, err)
	}
	for m, want := range map[string]int{"StoragePoolLookupByName": 0, "StoragePoolListAllVolumes": 1, "StorageVolLookupByName": 0, "StorageVolGetPath": 1} {
		if got := h.Calls(m) - callsBefore[m]; got != want {
			t.Errorf("a hit called %s %d times, want %d", m, got, want)
		}
	}
	if srv.gets.Load() != 1 || h.Calls("StorageVolUpload") != 1 || h.Calls("StorageVolDownload") != 1 {
		t.Fatalf("hit fetched again: %d GETs, %d uploads, %d downloads", srv.gets.Load(), h.Calls("StorageVolUpload"), h.Calls("StorageVolDownload"))
	}

	want.Source = ""
	if vb, err := c.Verify(ctx, img); err != nil || vb != want {
		t.Fatalf("Verify = %+v, %v", vb, err)
	}

	// A domain backed by the base through an overlay in another pool, and
	// one using the base directly.
	if err := h.AddPool("overlays", 1<<30); err != nil {
		t.Fatal(err)
	}
	ov := libvirtxml.StorageVolume{Name: "vm1.qcow2", Capacity: &libvirtxml.StorageVolumeSize{Unit: "GiB", Value: 1},
		Target:       &libvirtxml.StorageVolumeTarget{Format: &libvirtxml.StorageVolumeTargetFormat{Type: "qcow2"}},
		BackingStore: &libvirtxml.StorageVolumeBackingStore{Path: want.Path, Format: &libvirtxml.StorageVolumeTargetFormat{Type: "qcow2"}}}
	ovx, _ := ov.Marshal()
	s := h.Shared()
	op, _ := s.StoragePoolLookupByName("overlays")
	if _, err := s.StorageVolCreateXML(op, ovx, 0); err != nil {
		t.Fatal(err)
	}
	vm1 := libvirtxml.DomainDisk{Device: "disk", Driver: &libvirtxml.DomainDiskDriver{Type: "qcow2"},
		Source: &libvirtxml.DomainDiskSource{Volume: &libvirtxml.DomainDiskSourceVolume{Pool: "overlays", Volume: "vm1.qcow2"}},
		Target: &libvirtxml.DomainDiskTarget{Dev: "vda"}}
	d1, err := s.DomainDefineXML(domainXML("vm1", vm1))
	if err != nil {
		t.Fatal(err)
	}
	d2, err := s.DomainDefineXML(domainXML("vm2", fileDisk("vda", want.Path), libvirtxml.DomainDisk{Device: "cdrom", Target: &libvirtxml.DomainDiskTarget{Dev: "sda"}}))
	if err != nil {
		t.Fatal(err)
	}
	list, err := c.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	wantList := []Entry{{Base: want, Marker: MarkerName(name, sum), Size: int64(len(body)), UsedBy: []string{"vm1", "vm2"}}}
	if len(list) != 1 || list[0].Base != wantList[0].Base || list[0].Marker != wantList[0].Marker || list[0].Size != wantList[0].Size || !slices.Equal(list[0].UsedBy, wantList[0].UsedBy) {
		t.Fatalf("List = %+v, want %+v", list, wantList)
	}
	err = c.Evict(ctx, img)
	wantClass(t, err, errs.Permanent, "vm1, vm2")
	wantVolumes(t, h, name, MarkerName(name, sum))

	for _, d := range []libvirt.Domain{d1, d2} {
		if err := s.DomainUndefine(d); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Evict(ctx, img); err != nil {
		t.Fatal(err)
	}
	wantVolumes(t, h)
	if err := c.Evict(ctx, img); err != nil {
		t.Fatalf("Evict of a missing base: %v", err)
	}
	if _, err := c.Verify(ctx, img); errs.Code(err) != errs.NotFound {
		t.Fatalf("Verify after Evict = %v, want NotFound", err)
	}
	if list, err := c.List(ctx); err != nil || len(list) != 0 {
		t.Fatalf("List after Evict = %+v, %v", list, err)
	}
}

// Evict and replace refuse when a disk's chain cannot be resolved (it is
// in a stopped pool, or a qcow2 outside every pool): it might use the base.
func TestFakeUnresolvedDisksRefuse(t *testing.T) {
	body, sum := testImage(40 << 10)
	srv := serve(t, body, nil)
	c, h := newFakeCache(t, nil)
	ctx := testCtx(t, 30*time.Second)
	img := imagecache.Image{Key: "k", URL: srv.url}
	if _, err := c.Ensure(ctx, img); err != nil {
		t.Fatal(err)
	}
	s := h.Shared()
	if err := h.AddPool("stopped", 1<<30); err != nil {
		t.Fatal(err)
	}
	if err := h.PutVolume("stopped", libvirtfake.Volume{Name: "x.qcow2"}); err != nil {
		t.Fatal(err)
	}
	if err := h.SetPoolState("stopped", libvirt.StoragePoolInactive); err != nil {
		t.Fatal(err)
	}
	d, err := s.DomainDefineXML(domainXML("odd",
		fileDisk("vda", "/pools/stopped/x.qcow2"),
		fileDisk("vdb", "/elsewhere/y.qcow2"),
		libvirtxml.DomainDisk{Device: "disk", Source: &libvirtxml.DomainDiskSource{Volume: &libvirtxml.DomainDiskSourceVolume{Pool: "gone", Volume: "z"}}, Target: &libvirtxml.DomainDiskTarget{Dev: "vdc"}},
	))
	if err != nil {
		t.Fatal(err)
	}
	name := c.BaseName(img)
	err = c.Evict(ctx, img)
	wantClass(t, err, errs.Permanent, "inactive pool stopped")
	for _, part := range []string{"in no active storage pool", "pool gone, which does not exist"} {
		if !strings.Contains(err.Error(), part) {
			t.Fatalf("Evict = %v, want it to name %q", err, part)
		}
	}
	wantVolumes(t, h, name, MarkerName(name, sum))
	// List names the same disks: the base's users are not known.
	if list, err := c.List(ctx); err != nil || len(list) != 1 || len(list[0].Unresolved) != 3 || len(list[0].UsedBy) != 0 {
		t.Fatalf("List = %+v, %v; want the base with the 3 unresolved disks and no known user", list, err)
	}

	// Debris (a base without its marker) is not replaced either.
	if err := s.StorageVolDelete(libvirt.StorageVol{Pool: fakePool, Name: MarkerName(name, sum)}, 0); err != nil {
		t.Fatal(err)
	}
	_, err = c.Ensure(ctx, img)
	wantClass(t, err, errs.Permanent, "refusing to replace")
	wantVolumes(t, h, name)

	// A domain using the debris directly is named.
	if err := s.DomainUndefine(d); err != nil {
		t.Fatal(err)
	}
	if _, err := s.DomainDefineXML(domainXML("user", fileDisk("vda", "/pools/p/"+name))); err != nil {
		t.Fatal(err)
	}
	_, err = c.Ensure(ctx, img)
	wantClass(t, err, errs.Permanent, "domains user use it")
	if list, err := c.List(ctx); err != nil || len(list) != 1 || list[0].Marker != "" || !slices.Equal(list[0].UsedBy, []string{"user"}) || len(list[0].Unresolved) != 0 {
		t.Fatalf("List = %+v, %v; want the debris without marker, used by user, every disk resolved", list, err)
	}
}

// Concurrent Ensure calls share one fetch: one GET, one upload.
func TestFakeConcurrentEnsureSharesOneFetch(t *testing.T) {
	body, sum := testImage(100 << 10)
	release := make(chan struct{})
	srv := serve(t, body, func(w http.ResponseWriter, r *http.Request) {
		<-release
		_, _ = w.Write(body)
	})
	c, h := newFakeCache(t, nil)
	img := imagecache.Image{Key: "k", URL: srv.url}
	const n = 5
	var wg sync.WaitGroup
	bases := make([]Base, n)
	problems := make([]error, n)
	for i := range n {
		wg.Go(func() { bases[i], problems[i] = c.Ensure(testCtx(t, 30*time.Second), img) })
	}
	eventually.True(t, 10*time.Second, func() bool { return waiters(c, img) == n }, "%d callers wait for the flight", n)
	close(release)
	wg.Wait()
	for i := range n {
		if problems[i] != nil || bases[i].Digest != sum {
			t.Fatalf("caller %d: %+v, %v", i, bases[i], problems[i])
		}
	}
	if srv.gets.Load() != 1 || h.Calls("StorageVolUpload") != 1 {
		t.Fatalf("%d GETs, %d uploads for %d callers", srv.gets.Load(), h.Calls("StorageVolUpload"), n)
	}
}

// otherToken is a refreshed-claim token of another cache instance.
const otherToken = "0123456789abcdef0123456789abcdef"

// Claims of other writers and of our own past.
func TestFakeClaims(t *testing.T) {
	body, sum := testImage(40 << 10)
	img := func(url string) imagecache.Image { return imagecache.Image{Key: "k", URL: url} }
	name := BaseName(fakeEntry, "k", imagecache.FormatQCOW2)

	t.Run("taken: wait for the other writer to publish", func(t *testing.T) {
		srv := serve(t, body, nil)
		c, h := newFakeCache(t, nil)
		other := claimName(name, time.Now(), otherToken)
		if err := h.PutVolume(fakePool, libvirtfake.Volume{Name: other}); err != nil {
			t.Fatal(err)
		}
		var lists atomic.Int64
		h.SetHook("StoragePoolListAllVolumes", func(libvirtfake.Call) error {
			if lists.Add(1) == 2 { // we have seen the claim and waited once
				_ = h.PutVolume(fakePool, libvirtfake.Volume{Name: name, Data: body})
				_ = h.PutVolume(fakePool, libvirtfake.Volume{Name: MarkerName(name, sum)})
				_ = h.Shared().StorageVolDelete(libvirt.StorageVol{Pool: fakePool, Name: other}, 0)
			}
			return nil
		})
		b, err := c.Ensure(testCtx(t, 30*time.Second), img(srv.url))
		if err != nil || b.Digest != sum {
			t.Fatalf("Ensure = %+v, %v", b, err)
		}
		if srv.gets.Load() != 0 {
			t.Fatalf("%d GETs: the other writer's base was fetched again", srv.gets.Load())
		}
	})
	t.Run("taken: the caller gives up waiting", func(t *testing.T) {
		srv := serve(t, body, nil)
		c, h := newFakeCache(t, nil)
		if err := h.PutVolume(fakePool, libvirtfake.Volume{Name: claimName(name, time.Now(), otherToken)}); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		_, err := c.Ensure(ctx, img(srv.url))
		wantClass(t, err, errs.DeadlineExceeded, "")
	})
	t.Run("stale claims are taken over", func(t *testing.T) {
		srv := serve(t, body, nil)
		c, h := newFakeCache(t, func(cfg *Config) { cfg.ClaimTimeout = time.Minute })
		stale := claimName(name, time.Now().Add(-2*time.Minute), otherToken)
		legacy := claimName(name, time.Now().Add(-3*c.cfg.TransferBudget), "abc")
		for _, v := range []string{stale, legacy, MarkerName(name, "bad")} {
			if err := h.PutVolume(fakePool, libvirtfake.Volume{Name: v}); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := c.Ensure(testCtx(t, 30*time.Second), img(srv.url)); err != nil {
			t.Fatal(err)
		}
		wantVolumes(t, h, name, MarkerName(name, sum))
	})
	t.Run("own orphan is reclaimed at once", func(t *testing.T) {
		srv := serve(t, body, nil)
		c, h := newFakeCache(t, nil)
		orphan := claimName(name, time.Now(), c.instance+"0011223344556677")
		if err := h.PutVolume(fakePool, libvirtfake.Volume{Name: orphan}); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Ensure(testCtx(t, 30*time.Second), img(srv.url)); err != nil {
			t.Fatal(err)
		}
		wantVolumes(t, h, name, MarkerName(name, sum))
	})
	t.Run("refreshed while the fetch is slow", func(t *testing.T) {
		srv := serve(t, body, nil)
		c, h := newFakeCache(t, func(cfg *Config) {
			cfg.ClaimTimeout = 200 * time.Millisecond
			cfg.StreamStall = time.Minute
		})
		refreshed := make(chan struct{})
		var claims atomic.Int64
		h.SetHook("StorageVolCreateXML", func(call libvirtfake.Call) error {
			if strings.HasPrefix(call.Volume, "claim-") && claims.Add(1) == 3 {
				close(refreshed)
			}
			return nil
		})
		h.SetStreamHook("StorageVolUpload", func(call libvirtfake.Call) error {
			if call.Done == 0 {
				return call.Wait(refreshed)
			}
			return nil
		})
		if _, err := c.Ensure(testCtx(t, 30*time.Second), img(srv.url)); err != nil {
			t.Fatal(err)
		}
		wantVolumes(t, h, name, MarkerName(name, sum))
	})
	t.Run("a claim that cannot be refreshed gives the work up", func(t *testing.T) {
		srv := serve(t, body, nil)
		c, h := newFakeCache(t, func(cfg *Config) {
			cfg.ClaimTimeout = 200 * time.Millisecond
			cfg.StreamStall = time.Minute
		})
		var claims atomic.Int64
		h.SetHook("StorageVolCreateXML", func(call libvirtfake.Call) error {
			if strings.HasPrefix(call.Volume, "claim-") && claims.Add(1) > 1 {
				return libvirt.Error{Code: uint32(libvirt.ErrInternalError), Message: "internal error: no"}
			}
			return nil
		})
		h.SetStreamHook("StorageVolUpload", libvirtfake.StallAfter(0, make(chan struct{})))
		_, err := c.Ensure(testCtx(t, 30*time.Second), img(srv.url))
		wantClass(t, err, errs.Transient, "lost its claim")
		wantVolumes(t, h)
	})
	t.Run("two writers claim at once: back off, then fetch", func(t *testing.T) {
		srv := serve(t, body, nil)
		c, h := newFakeCache(t, nil)
		rival := claimName(name, time.Now(), otherToken)
		var once, gone sync.Once
		h.SetHook("StorageVolCreateXML", func(call libvirtfake.Call) error {
			if strings.HasPrefix(call.Volume, "claim-") {
				once.Do(func() { _ = h.PutVolume(fakePool, libvirtfake.Volume{Name: rival}) })
			}
			return nil
		})
		h.SetHook("StorageVolDelete", func(call libvirtfake.Call) error {
			if strings.HasPrefix(call.Volume, "claim-") && call.Volume != rival {
				// We back off: so does the rival.
				gone.Do(func() {
					_ = h.Shared().StorageVolDelete(libvirt.StorageVol{Pool: fakePool, Name: rival}, 0)
				})
			}
			return nil
		})
		if _, err := c.Ensure(testCtx(t, 30*time.Second), img(srv.url)); err != nil {
			t.Fatal(err)
		}
		wantVolumes(t, h, name, MarkerName(name, sum))
		if srv.gets.Load() != 1 {
			t.Fatalf("%d GETs", srv.gets.Load())
		}
	})
}

// The pool's state before a fetch: conflicts are left untouched, debris is
// replaced.
func TestFakeCacheStates(t *testing.T) {
	body, sum := testImage(40 << 10)
	name := BaseName(fakeEntry, "k", imagecache.FormatQCOW2)
	other := strings.Repeat("b", 64)
	for _, tt := range []struct {
		name   string
		before []string
		want   string // configured digest
		code   errs.ErrorCode
		text   string
		after  []string
	}{
		{"marker differs from the configured digest", []string{name, MarkerName(name, other)}, sum, errs.Permanent, "add the image under a new key, or delete the proxies using it, then evict the base with EvictImage (egressproxyctl images evict)", []string{name, MarkerName(name, other)}},
		{"two markers", []string{name, MarkerName(name, other), MarkerName(name, sum)}, "", errs.Permanent, "several digest markers (" + other + ", " + sum + "); it is left untouched because running VMs may use it: delete the proxies using it, then evict the base with EvictImage (egressproxyctl images evict), or add the image under a new key", []string{name, MarkerName(name, other), MarkerName(name, sum)}},
		{"base without marker is debris", []string{name}, "", errs.OK, "", []string{name, MarkerName(name, sum)}},
		{"marker without base is debris", []string{MarkerName(name, other)}, "", errs.OK, "", []string{name, MarkerName(name, sum)}},
		{"malformed marker beside a good one", []string{name, MarkerName(name, sum), name + ".sha256-zz"}, "", errs.OK, "", []string{name, MarkerName(name, sum)}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			srv := serve(t, body, nil)
			c, h := newFakeCache(t, nil)
			for _, v := range tt.before {
				var data []byte
				if v == name {
					data = body
				}
				if err := h.PutVolume(fakePool, libvirtfake.Volume{Name: v, Data: data}); err != nil {
					t.Fatal(err)
				}
			}
			img := imagecache.Image{Key: "k", URL: srv.url, SHA256: tt.want}
			_, err := c.Ensure(testCtx(t, 30*time.Second), img)
			if tt.code == errs.OK {
				if err != nil {
					t.Fatal(err)
				}
			} else {
				wantClass(t, err, tt.code, tt.text)
				if _, verr := c.Verify(testCtx(t, 30*time.Second), img); errs.Code(verr) != tt.code {
					t.Fatalf("Verify = %v, want %v", verr, tt.code)
				}
			}
			wantVolumes(t, h, tt.after...)
		})
	}
}

// Verify re-reads the stored bytes: a base changed on the host is reported,
// never deleted.
func TestFakeVerifyCatchesChangedBytes(t *testing.T) {
	body, sum := testImage(40 << 10)
	srv := serve(t, body, nil)
	c, h := newFakeCache(t, stallFast)
	img := imagecache.Image{Key: "k", URL: srv.url}
	ctx := testCtx(t, 30*time.Second)
	b, err := c.Ensure(ctx, img)
	if err != nil {
		t.Fatal(err)
	}
	bad := slices.Clone(body)
	bad[len(bad)-1] ^= 1
	if err := h.SetVolumeData(fakePool, b.Volume, bad); err != nil {
		t.Fatal(err)
	}
	_, err = c.Verify(ctx, img)
	wantClass(t, err, errs.Permanent, "its marker says "+sum+"; it is left untouched because running VMs may use it: delete the proxies using it, then evict the base with EvictImage (egressproxyctl images evict)")
	wantVolumes(t, h, b.Volume, MarkerName(b.Volume, sum))

	// A read-back that stalls once is retried on a fresh session.
	if err := h.SetVolumeData(fakePool, b.Volume, body); err != nil {
		t.Fatal(err)
	}
	var first atomic.Bool
	h.SetStreamHook("StorageVolDownload", func(call libvirtfake.Call) error {
		if first.CompareAndSwap(false, true) {
			return call.Wait(nil) // until the cache kills the session
		}
		return nil
	})
	if _, err := c.Verify(ctx, img); err != nil {
		t.Fatalf("Verify after one stalled read-back: %v", err)
	}
	h.SetStreamHook("StorageVolDownload", nil)

	// A read-back failing for good is Transient.
	h.SetHook("StorageVolDownload", libvirtfake.Fail(libvirt.Error{Code: uint32(libvirt.ErrSystemError), Message: "cannot read"}))
	_, err = c.Verify(ctx, img)
	wantClass(t, err, errs.Transient, "cannot read")
}

var errBoom = libvirt.Error{Code: uint32(libvirt.ErrInternalError), Message: "internal error: boom"}

// Every failure shape is classed and leaves nothing in the pool.
func TestFakeFailureShapes(t *testing.T) {
	body, sum := testImage(100 << 10)
	for _, tt := range []struct {
		name    string
		handler func(w http.ResponseWriter, r *http.Request)
		img     func(url string) imagecache.Image
		setup   func(t *testing.T, h *libvirtfake.Host)
		cfg     func(*Config)
		code    errs.ErrorCode
		text    string
		gets    int64 // 0: 1
	}{
		{name: "HTTP 404", handler: func(w http.ResponseWriter, r *http.Request) { http.NotFound(w, r) }, code: errs.Permanent, text: "404 Not Found"},
		{name: "HTTP 500", handler: func(w http.ResponseWriter, r *http.Request) { http.Error(w, "x", http.StatusInternalServerError) }, code: errs.Transient, text: "500 Internal Server Error"},
		{name: "HTTP 429", handler: func(w http.ResponseWriter, r *http.Request) { http.Error(w, "x", http.StatusTooManyRequests) }, code: errs.Transient, text: "429"},
		{name: "not a qcow2", handler: func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte("<html>sign in</html>")) }, code: errs.Permanent, text: "is not a qcow2 image"},
		{name: "empty body", handler: func(w http.ResponseWriter, r *http.Request) {}, code: errs.Transient, text: "empty body"},
		{name: "digest mismatch", img: func(u string) imagecache.Image {
			return imagecache.Image{Key: "k", URL: u, SHA256: strings.Repeat("c", 64)}
		}, code: errs.Permanent, text: "has sha256 " + sum},
		{name: "short body", handler: func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Length", strconv.Itoa(len(body)))
			_, _ = w.Write(body[:len(body)/2])
		}, code: errs.Transient, text: "reading the image"},
		{name: "pool missing", setup: func(t *testing.T, h *libvirtfake.Host) { h.RemovePool(fakePool) }, code: errs.Permanent, text: "no storage pool with matching name", gets: -1},
		{name: "pool inactive", setup: func(t *testing.T, h *libvirtfake.Host) { _ = h.SetPoolState(fakePool, libvirt.StoragePoolInactive) }, code: errs.Permanent, text: "is not active; start it", gets: -1},
		{name: "pool full (announced size)", setup: func(t *testing.T, h *libvirtfake.Host) { _ = h.SetPoolCapacity(fakePool, 50<<10) }, code: errs.Transient, text: "has only 51200 bytes free"},
		{name: "pool full (no size announced)", handler: func(w http.ResponseWriter, r *http.Request) {
			_, _ = w.Write(body[:20<<10])
			w.(http.Flusher).Flush() // chunked: no Content-Length
			_, _ = w.Write(body[20<<10:])
		}, setup: func(t *testing.T, h *libvirtfake.Host) { _ = h.SetPoolCapacity(fakePool, 50<<10) }, code: errs.Transient, text: "larger than the 51200 bytes free"},
		{name: "volume create fails", setup: func(t *testing.T, h *libvirtfake.Host) {
			h.SetHook("StorageVolCreateXML", func(c libvirtfake.Call) error {
				if strings.HasPrefix(c.Volume, "base-") {
					return errBoom
				}
				return nil
			})
		}, code: errs.Transient, text: "create volume"},
		{name: "no dedicated session", setup: func(t *testing.T, h *libvirtfake.Host) {
			h.SetHook("Dedicated", libvirtfake.Fail(&sshconn.Error{Kind: sshconn.KindUnreachable, Err: errors.New("dial refused")}))
		}, code: errs.Transient, text: "dedicated connection"},
		{name: "upload fails mid-stream", setup: func(t *testing.T, h *libvirtfake.Host) {
			h.SetStreamHook("StorageVolUpload", libvirtfake.CutAfter(2*fakeChunk, errBoom))
		}, code: errs.Transient, text: "bytes: internal error: boom"},
		{name: "upload stalls twice", cfg: stallFast, setup: func(t *testing.T, h *libvirtfake.Host) {
			h.SetStreamHook("StorageVolUpload", libvirtfake.StallAfter(fakeChunk, nil))
		}, code: errs.Transient, text: "made no progress", gets: 2},
		{name: "staged volume deleted mid-upload", setup: func(t *testing.T, h *libvirtfake.Host) {
			var once sync.Once
			h.SetStreamHook("StorageVolUpload", func(c libvirtfake.Call) error {
				if c.Done >= fakeChunk {
					once.Do(func() { _ = c.Session.StorageVolDelete(libvirt.StorageVol{Pool: c.Pool, Name: c.Volume}, 0) })
				}
				return nil
			})
		}, code: errs.Transient, text: "no storage vol with matching name"},
		{name: "read-back differs", setup: func(t *testing.T, h *libvirtfake.Host) {
			h.SetHook("StorageVolDownload", func(c libvirtfake.Call) error {
				bad := slices.Clone(body)
				bad[100] ^= 1
				return h.SetVolumeData(c.Pool, c.Volume, bad)
			})
		}, code: errs.Transient, text: "the host stores"},
		{name: "read-back fails", setup: func(t *testing.T, h *libvirtfake.Host) {
			h.SetStreamHook("StorageVolDownload", libvirtfake.CutAfter(fakeChunk, errBoom))
		}, code: errs.Transient, text: "read back"},
		{name: "marker create fails", setup: func(t *testing.T, h *libvirtfake.Host) {
			h.SetHook("StorageVolCreateXML", func(c libvirtfake.Call) error {
				if strings.Contains(c.Volume, ".sha256-") {
					return errBoom
				}
				return nil
			})
		}, code: errs.Transient, text: "create marker"},
		{name: "cleanup retried after a lost session", setup: func(t *testing.T, h *libvirtfake.Host) {
			h.SetStreamHook("StorageVolUpload", libvirtfake.CutAfter(fakeChunk, errBoom))
			h.SetHook("StorageVolDelete", libvirtfake.FailFirst(1, &sshconn.Error{Kind: sshconn.KindUnreachable, Err: errors.New("link lost")}))
		}, code: errs.Transient, text: "boom"},
		{name: "pool listing fails", setup: func(t *testing.T, h *libvirtfake.Host) {
			h.SetHook("StoragePoolListAllVolumes", libvirtfake.Fail(errBoom))
		}, code: errs.Transient, text: "list volumes of pool p", gets: -1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			srv := serve(t, body, tt.handler)
			c, h := newFakeCache(t, tt.cfg)
			if tt.setup != nil {
				tt.setup(t, h)
			}
			img := imagecache.Image{Key: "k", URL: srv.url}
			if tt.img != nil {
				img = tt.img(srv.url)
			}
			_, err := c.Ensure(testCtx(t, 30*time.Second), img)
			wantClass(t, err, tt.code, tt.text)
			if strings.Contains(err.Error(), "\n") {
				t.Fatalf("multi-line error: %q", err)
			}
			gets := tt.gets
			switch gets {
			case 0:
				gets = 1
			case -1:
				gets = 0
			}
			if srv.gets.Load() != gets {
				t.Fatalf("%d GETs, want %d", srv.gets.Load(), gets)
			}
			h.SetHook("StoragePoolListAllVolumes", nil)
			_ = h.SetPoolState(fakePool, libvirt.StoragePoolRunning)
			wantLeft(t, h)
		})
	}
}

// A stream that stalls once is retried once on a fresh dedicated session:
// the upload with a new GET, the read-back alone. The image is one
// segment, so its read-back rides the upload's session (2 sessions in
// all, not 3: the stalled one and its fresh replacement).
func TestFakeStallRetriedOnce(t *testing.T) {
	body, sum := testImage(100 << 10)
	for _, method := range []string{"StorageVolUpload", "StorageVolDownload"} {
		t.Run(method, func(t *testing.T) {
			srv := serve(t, body, nil)
			c, h := newFakeCache(t, stallFast)
			var first atomic.Bool
			h.SetStreamHook(method, func(call libvirtfake.Call) error {
				if call.Done >= fakeChunk && first.CompareAndSwap(false, true) {
					return call.Wait(nil) // until the cache kills the session
				}
				return nil
			})
			b, err := c.Ensure(testCtx(t, 30*time.Second), imagecache.Image{Key: "k", URL: srv.url})
			if err != nil || b.Digest != sum {
				t.Fatalf("Ensure = %+v, %v", b, err)
			}
			wantGets := int64(1)
			if method == "StorageVolUpload" {
				wantGets = 2
			}
			if srv.gets.Load() != wantGets || h.Calls("Dedicated") != 2 || h.Calls(method) != 2 {
				t.Fatalf("%d GETs, %d dedicated sessions, %d %s calls", srv.gets.Load(), h.Calls("Dedicated"), h.Calls(method), method)
			}
			wantVolumes(t, h, b.Volume, MarkerName(b.Volume, sum))
		})
	}
}

// The caller's cancellation returns at once; the abandoned fetch is
// canceled, its stream killed and its volume and claim removed.
func TestFakeCallerCancelDuringUpload(t *testing.T) {
	body, _ := testImage(100 << 10)
	srv := serve(t, body, nil)
	c, h := newFakeCache(t, func(cfg *Config) { cfg.StreamStall = time.Minute })
	started := make(chan struct{})
	var once sync.Once
	h.SetStreamHook("StorageVolUpload", func(call libvirtfake.Call) error {
		if call.Done >= fakeChunk {
			once.Do(func() { close(started) })
			return call.Wait(nil)
		}
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := c.Ensure(ctx, imagecache.Image{Key: "k", URL: srv.url})
		errc <- err
	}()
	<-started
	cancel()
	wantClass(t, <-errc, errs.Canceled, "")
	if err := c.Close(); err != nil { // waits for the abandoned flight
		t.Fatal(err)
	}
	wantLeft(t, h)
}

// Close during a fetch cancels it, waits for it and leaves no goroutine and
// no volume behind.
func TestFakeCloseDuringFetch(t *testing.T) {
	ignore := goleak.IgnoreCurrent()
	body, _ := testImage(100 << 10)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write(body) }))
	defer srv.Close()
	h := libvirtfake.New()
	h.SetChunkSize(fakeChunk)
	if err := h.AddPool(fakePool, 64<<20); err != nil {
		t.Fatal(err)
	}
	c, err := New(fakeLink{h}, Config{Entry: fakeEntry, Pool: fakePool, StreamStall: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan struct{})
	var once sync.Once
	h.SetStreamHook("StorageVolUpload", func(call libvirtfake.Call) error {
		if call.Done >= fakeChunk {
			once.Do(func() { close(started) })
			return call.Wait(nil)
		}
		return nil
	})
	img := imagecache.Image{Key: "k", URL: srv.URL + "/img.qcow2"}
	errc := make(chan error, 1)
	go func() {
		_, err := c.Ensure(context.Background(), img)
		errc <- err
	}()
	<-started
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	wantClass(t, <-errc, errs.Transient, "the cache was closed during the fetch")
	wantVolumes(t, h)
	if _, err := c.Ensure(context.Background(), img); !errors.Is(err, errs.ErrClosed) {
		t.Fatalf("Ensure after Close: %v", err)
	}
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	srv.Close() // and the idle connections of the default transport
	goleak.VerifyNone(t, ignore)
}

// A budget that runs out during the fetch is Transient and named as such,
// not the caller's deadline.
func TestFakeBudgetExhausted(t *testing.T) {
	body, _ := testImage(100 << 10)
	srv := serve(t, body, nil)
	c, h := newFakeCache(t, func(cfg *Config) {
		cfg.TransferBudget, cfg.HTTPGrace, cfg.StreamStall = 300*time.Millisecond, 10*time.Millisecond, time.Minute
	})
	h.SetStreamHook("StorageVolUpload", libvirtfake.StallAfter(fakeChunk, nil))
	_, err := c.Ensure(testCtx(t, 30*time.Second), imagecache.Image{Key: "k", URL: srv.url})
	wantClass(t, err, errs.Transient, "transfer budget 300ms exhausted")
	wantVolumes(t, h)
}

// SSH(nil) is refused by New; SSH passes sshconn's errors through
// unchanged (here: the key file is missing, so nothing is dialled).
func TestSSHAdapter(t *testing.T) {
	if c := SSH(nil); c != nil {
		t.Fatalf("SSH(nil) = %v, want nil", c)
	}
	if _, err := New(SSH(nil), Config{Entry: "e", Pool: "p"}); errs.Code(err) != errs.Permanent || !strings.Contains(err.Error(), "conn") {
		t.Fatalf("New(SSH(nil)) = %v, want Permanent naming conn", err)
	}
	dir := t.TempDir()
	pool, err := sshconn.New(sshconn.Config{Address: "127.0.0.1:1", User: "u", KeyFile: dir + "/missing", KnownHostsFile: dir + "/known_hosts"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	lv := libvirtconn.New(pool, libvirtconn.Config{}, nil)
	defer lv.Close()
	conn := SSH(lv)
	ran := false
	err = conn.Do(testCtx(t, 10*time.Second), func(Libvirt) error { ran = true; return nil })
	var se *sshconn.Error
	if !errors.As(err, &se) || ran {
		t.Fatalf("Do = %v (fn ran: %v), want the *sshconn.Error and fn not run", err, ran)
	}
	d, err := conn.Dedicated(testCtx(t, 10*time.Second))
	if !errors.As(err, &se) || d != nil {
		t.Fatalf("Dedicated = %v, %v; want nil and the *sshconn.Error", d, err)
	}
}

// A cleanup that fails for good (libvirtd answers with an error) leaves the
// unverified volume as debris; the next Ensure removes it and publishes.
func TestFakeFailedCleanupLeavesDebrisForNextEnsure(t *testing.T) {
	body, sum := testImage(40 << 10)
	srv := serve(t, body, nil)
	c, h := newFakeCache(t, nil)
	img := imagecache.Image{Key: "k", URL: srv.url}
	name := c.BaseName(img)
	h.SetStreamHook("StorageVolUpload", libvirtfake.CutAfter(1, errBoom))
	h.SetHook("StorageVolDelete", func(call libvirtfake.Call) error {
		if call.Volume == name {
			return errBoom
		}
		return nil
	})
	_, err := c.Ensure(testCtx(t, 30*time.Second), img)
	wantClass(t, err, errs.Transient, "boom")
	wantVolumes(t, h, name)
	if list, err := c.List(testCtx(t, 30*time.Second)); err != nil || len(list) != 1 || list[0].Marker != "" {
		t.Fatalf("List = %+v, %v; want the debris without a marker", list, err)
	}
	h.SetStreamHook("StorageVolUpload", nil)
	h.SetHook("StorageVolDelete", nil)
	if _, err := c.Ensure(testCtx(t, 30*time.Second), img); err != nil {
		t.Fatal(err)
	}
	wantVolumes(t, h, name, MarkerName(name, sum))
}

// libvirt writing fewer bytes than it was sent (a disk filling, say): the
// upload's source waits for the volume to hold every byte before it ends
// the stream; a size that stops short is a stall, retried once, then
// Transient. A volume that shrinks after the upload is caught by the size
// check before the read-back.
func TestFakeLibvirtLosesBytes(t *testing.T) {
	t.Parallel()
	body, _ := testImage(100 << 10)
	short := func(h *libvirtfake.Host) libvirtfake.Hook {
		return func(call libvirtfake.Call) error {
			if call.Done == int64(len(body)) { // before the Read that ends the source
				vol, _ := h.Volume(call.Pool, call.Volume)
				data := vol.Data
				return h.SetVolumeData(call.Pool, call.Volume, data[:len(data)-10])
			}
			return nil
		}
	}
	t.Run("during the upload", func(t *testing.T) {
		srv := serve(t, body, nil)
		c, h := newFakeCache(t, nil)
		c.drainStall = 100 * time.Millisecond
		h.SetStreamHook("StorageVolUpload", short(h))
		_, err := c.Ensure(testCtx(t, 30*time.Second), imagecache.Image{Key: "k", URL: srv.url})
		wantClass(t, err, errs.Transient, fmt.Sprintf("libvirt wrote only %d of %d bytes", len(body)-10, len(body)))
		if srv.gets.Load() != 2 {
			t.Fatalf("%d GETs, want 2 (one retry)", srv.gets.Load())
		}
		wantVolumes(t, h)
	})
	t.Run("after the upload", func(t *testing.T) {
		srv := serve(t, body, nil)
		c, h := newFakeCache(t, nil)
		var uploaded atomic.Bool
		h.SetStreamHook("StorageVolUpload", func(call libvirtfake.Call) error {
			if call.Done == int64(len(body)) {
				uploaded.Store(true)
			}
			return nil
		})
		var infos atomic.Int64
		h.SetHook("StorageVolGetInfoFlags", func(call libvirtfake.Call) error {
			// The first size query after the upload is the source's
			// drain; the second is the check before the read-back.
			if uploaded.Load() && infos.Add(1) == 2 {
				return h.SetVolumeData(call.Pool, call.Volume, body[:1000])
			}
			return nil
		})
		_, err := c.Ensure(testCtx(t, 30*time.Second), imagecache.Image{Key: "k", URL: srv.url})
		wantClass(t, err, errs.Transient, fmt.Sprintf("holds 1000 bytes on the host but %d were sent", len(body)))
		wantVolumes(t, h)
	})
	t.Run("size query fails", func(t *testing.T) {
		srv := serve(t, body, nil)
		c, h := newFakeCache(t, nil)
		h.SetHook("StorageVolGetInfoFlags", libvirtfake.Fail(errBoom))
		_, err := c.Ensure(testCtx(t, 30*time.Second), imagecache.Image{Key: "k", URL: srv.url})
		wantClass(t, err, errs.Transient, "libvirt failed: waiting for libvirt to write")
		wantVolumes(t, h)
	})
}

// Live domains list their backing chains in the XML; block and network
// disks have no file of a pool.
func TestFakeUsersFromLiveChains(t *testing.T) {
	body, _ := testImage(40 << 10)
	srv := serve(t, body, nil)
	c, h := newFakeCache(t, nil)
	ctx := testCtx(t, 30*time.Second)
	img := imagecache.Image{Key: "k", URL: srv.url}
	b, err := c.Ensure(ctx, img)
	if err != nil {
		t.Fatal(err)
	}
	live := libvirtxml.DomainDisk{Device: "disk", Driver: &libvirtxml.DomainDiskDriver{Type: "qcow2"},
		Source: &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: "/run/overlay.qcow2"}},
		BackingStore: &libvirtxml.DomainDiskBackingStore{
			Source:       &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: b.Path}},
			BackingStore: &libvirtxml.DomainDiskBackingStore{},
		},
		Target: &libvirtxml.DomainDiskTarget{Dev: "vda"}}
	block := libvirtxml.DomainDisk{Device: "disk", Driver: &libvirtxml.DomainDiskDriver{Type: "raw"},
		Source: &libvirtxml.DomainDiskSource{Block: &libvirtxml.DomainDiskSourceBlock{Dev: "/dev/sdb"}}, Target: &libvirtxml.DomainDiskTarget{Dev: "vdb"}}
	network := libvirtxml.DomainDisk{Device: "disk",
		Source: &libvirtxml.DomainDiskSource{Network: &libvirtxml.DomainDiskSourceNetwork{Protocol: "nbd", Name: "x"}}, Target: &libvirtxml.DomainDiskTarget{Dev: "vdc"}}
	if _, err := h.Shared().DomainDefineXML(domainXML("live", live, block, network)); err != nil {
		t.Fatal(err)
	}
	list, err := c.List(ctx)
	if err != nil || len(list) != 1 || !slices.Equal(list[0].UsedBy, []string{"live"}) {
		t.Fatalf("List = %+v, %v; want the base used by live", list, err)
	}
	wantClass(t, c.Evict(ctx, img), errs.Permanent, "backing store of domains live")
}

// Evict validates its image; List and Evict pass libvirt's failures on,
// classed.
func TestFakeEvictAndListFailures(t *testing.T) {
	c, h := newFakeCache(t, nil)
	ctx := testCtx(t, 30*time.Second)
	wantClass(t, c.Evict(ctx, imagecache.Image{Key: "a--b"}), errs.Permanent, "Key")
	wantClass(t, c.Evict(ctx, imagecache.Image{Key: "k", Format: "vmdk"}), errs.Permanent, "vmdk")
	if err := h.PutVolume(fakePool, libvirtfake.Volume{Name: BaseName(fakeEntry, "k", imagecache.FormatQCOW2)}); err != nil {
		t.Fatal(err)
	}
	h.SetHook("ConnectListAllDomains", libvirtfake.Fail(errBoom))
	wantClass(t, c.Evict(ctx, imagecache.Image{Key: "k"}), errs.Transient, "find domains using bases")
	_, err := c.List(ctx)
	wantClass(t, err, errs.Transient, "find domains using bases")
	h.SetHook("ConnectListAllDomains", nil)
	h.SetHook("StorageVolGetPath", libvirtfake.Fail(errBoom))
	_, err = c.List(ctx)
	wantClass(t, err, errs.Transient, "volume paths in pool p")
	h.SetHook("StorageVolGetPath", nil)
	h.SetHook("StorageVolDelete", libvirtfake.Fail(errBoom))
	wantClass(t, c.Evict(ctx, imagecache.Image{Key: "k"}), errs.Transient, "delete volume")
	h.SetHook("StorageVolDelete", nil)
	h.SetHook("ConnectListAllStoragePools", libvirtfake.Fail(errBoom))
	_, err = c.List(ctx)
	wantClass(t, err, errs.Transient, "list storage pools")
}

// The cache remembers the pool's handle, and libvirt finds a pool by the
// handle's UUID: after the pool is undefined and defined again under the
// same name, the next fetch forgets the stale handle, looks the pool up
// again and publishes; after the pool is gone for good it fails Permanent,
// naming the pool, as before.
func TestFakePoolRedefinedUnderTheCache(t *testing.T) {
	body, sum := testImage(40 << 10)
	srv := serve(t, body, nil)
	c, h := newFakeCache(t, nil)
	ctx := testCtx(t, 30*time.Second)
	if _, err := c.Ensure(ctx, imagecache.Image{Key: "a", URL: srv.url, SHA256: sum}); err != nil {
		t.Fatal(err)
	}
	lookups := h.Calls("StoragePoolLookupByName")
	h.RemovePool(fakePool)
	if err := h.AddPool(fakePool, 64<<20); err != nil {
		t.Fatal(err)
	}
	b, err := c.Ensure(ctx, imagecache.Image{Key: "a", URL: srv.url, SHA256: sum})
	if err != nil || b.Digest != sum {
		t.Fatalf("Ensure after the pool was defined again = %+v, %v", b, err)
	}
	if got, _ := h.Volume(fakePool, b.Volume); !slices.Equal(got.Data, body) {
		t.Errorf("the new pool holds %d bytes, not the image", len(got.Data))
	}
	if n := h.Calls("StoragePoolLookupByName") - lookups; n != 1 {
		t.Errorf("%d pool lookups after the pool was defined again, want 1 (the stale handle forgotten once)", n)
	}
	h.RemovePool(fakePool)
	_, err = c.Ensure(ctx, imagecache.Image{Key: "a", URL: srv.url, SHA256: sum})
	if errs.Code(err) != errs.Permanent || !strings.Contains(err.Error(), fakePool) {
		t.Fatalf("Ensure with the pool gone = %v (%v), want Permanent naming %s", err, errs.Code(err), fakePool)
	}
}

// Close releases the keep-alive connection of the cache's default HTTP
// client to a mirror that stays up (found by the chaos soak: a driver that
// closed every client still ran the connection's two goroutines, for up to
// the 90 s idle timeout of http.DefaultTransport, which the default client
// used).
func TestFakeCloseReleasesMirrorConnections(t *testing.T) {
	body, sum := testImage(100 << 10)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write(body) }))
	defer srv.Close()
	ignore := goleak.IgnoreCurrent() // the mirror's listener
	h := libvirtfake.New()
	defer h.Close()
	if err := h.AddPool(fakePool, 64<<20); err != nil {
		t.Fatal(err)
	}
	c, err := New(fakeLink{h}, Config{Entry: fakeEntry, Pool: fakePool})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Ensure(testCtx(t, 30*time.Second), imagecache.Image{Key: "k", URL: srv.URL + "/img.qcow2", SHA256: sum}); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	// The mirror is still up: only Close can have ended the connection.
	goleak.VerifyNone(t, ignore)
}
