package basecache

import (
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/testing/libvirtfake"
)

// holdWait bounds how long a hook of these tests holds a call for another
// call to arrive: a sequential cache makes the test fail after it instead
// of hanging.
const holdWait = 3 * time.Second

// signal is closed once, by the first call of a hook made with seen.
type signal struct {
	ch   chan struct{}
	once sync.Once
}

func newSignal() *signal { return &signal{ch: make(chan struct{})} }

func (s *signal) seen(libvirtfake.Call) error {
	s.once.Do(func() { close(s.ch) })
	return nil
}

// within reports whether s was closed by d from now.
func (s *signal) within(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-s.ch:
		return true
	case <-t.C:
		return false
	}
}

// A cold fetch dials the upload's connection and reads the pool's free
// space while it takes its claim: the claim's creation is held until both
// have begun, which they can only do if they do not wait for it.
func TestFakeColdFetchStartsAhead(t *testing.T) {
	body, sum := testImage(40 << 10)
	srv := serve(t, body, nil)
	c, h := newFakeCache(t, nil)
	dialled, refreshed := newSignal(), newSignal()
	h.SetHook("Dedicated", dialled.seen)
	h.SetHook("StoragePoolRefresh", refreshed.seen)
	var overlapped atomic.Bool
	h.SetHook("StorageVolCreateXML", func(call libvirtfake.Call) error {
		if strings.HasPrefix(call.Volume, "claim-") && !overlapped.Load() {
			overlapped.Store(dialled.within(holdWait) && refreshed.within(holdWait))
		}
		return nil
	})
	b, err := c.Ensure(testCtx(t, 30*time.Second), imagecache.Image{Key: "k", URL: srv.url, SHA256: sum})
	if err != nil || b.Digest != sum {
		t.Fatalf("Ensure = %+v, %v", b, err)
	}
	if !overlapped.Load() {
		t.Error("the dial and the free-space read did not begin while the claim was being created")
	}
	if n := h.Calls("Dedicated"); n != 1 {
		t.Errorf("%d dedicated sessions, want 1 (the upload's, which the read-back of one segment rides)", n)
	}
	if n := h.Calls("StoragePoolRefresh"); n != 1 {
		t.Errorf("%d pool refreshes, want 1 (read ahead, used by the fetch)", n)
	}
	if n := h.OpenSessions(); n != 0 {
		t.Errorf("%d dedicated sessions open after Ensure returned, want 0", n)
	}
}

// The read-back of an image of one segment rides the upload's session
// (nothing was read back while it uploaded, so a session of its own would
// only add its handshakes after the upload), and that session is closed
// before Ensure returns.
func TestFakeOneSegmentReadBackRidesTheUpload(t *testing.T) {
	body, sum := testImage(100 << 10)
	srv := serve(t, body, nil)
	c, h := newFakeCache(t, nil)
	var mu sync.Mutex
	sessions := map[string]*libvirtfake.Session{}
	record := func(call libvirtfake.Call) error {
		mu.Lock()
		sessions[call.Method] = call.Session
		mu.Unlock()
		return nil
	}
	h.SetHook("StorageVolUpload", record)
	h.SetHook("StorageVolDownload", record)
	b, err := c.Ensure(testCtx(t, 30*time.Second), imagecache.Image{Key: "k", URL: srv.url, SHA256: sum})
	if err != nil || b.Digest != sum {
		t.Fatalf("Ensure = %+v, %v", b, err)
	}
	mu.Lock()
	up, down := sessions["StorageVolUpload"], sessions["StorageVolDownload"]
	mu.Unlock()
	if up == nil || up != down || up == h.Shared() {
		t.Errorf("upload on %p, read-back on %p (shared %p): want both on one dedicated session", up, down, h.Shared())
	}
	if n := h.Calls("Dedicated"); n != 1 {
		t.Errorf("%d dedicated sessions, want 1", n)
	}
	if n := h.OpenSessions(); n != 0 {
		t.Errorf("%d dedicated sessions open after Ensure returned, want 0", n)
	}
}

// After the upload, the volume's size is asked for while the last range is
// read back, and the base's path while its marker is created: the
// read-back's download is held until the size was asked for (the drain
// asks once when the one segment ends, the check once more), and the
// marker's creation until the path is being read.
func TestFakeColdFetchTailOverlaps(t *testing.T) {
	body, sum := testImage(40 << 10)
	srv := serve(t, body, nil)
	c, h := newFakeCache(t, nil)
	pathed := newSignal()
	h.SetHook("StorageVolGetPath", pathed.seen)
	var sizeWithDownload, pathWithMarker atomic.Bool
	sized := newSignal() // the size was asked for twice
	h.SetHook("StorageVolGetInfoFlags", func(call libvirtfake.Call) error {
		if h.Calls("StorageVolGetInfoFlags") >= 2 {
			return sized.seen(call)
		}
		return nil
	})
	h.SetHook("StorageVolDownload", func(libvirtfake.Call) error {
		sizeWithDownload.Store(sized.within(holdWait))
		return nil
	})
	h.SetHook("StorageVolCreateXML", func(call libvirtfake.Call) error {
		if _, _, ok := ParseMarkerName(call.Volume); ok {
			pathWithMarker.Store(pathed.within(holdWait))
		}
		return nil
	})
	b, err := c.Ensure(testCtx(t, 30*time.Second), imagecache.Image{Key: "k", URL: srv.url, SHA256: sum})
	if err != nil || b.Digest != sum || b.Path == "" {
		t.Fatalf("Ensure = %+v, %v", b, err)
	}
	if !sizeWithDownload.Load() {
		t.Error("the volume's size was not asked for while the read-back downloaded")
	}
	if !pathWithMarker.Load() {
		t.Error("the base's path was not read while the marker was created")
	}
	if n := h.Calls("StorageVolGetInfoFlags"); n != 2 {
		t.Errorf("%d size reads, want 2 (the drain's, the check's)", n)
	}
	if n := h.Calls("StorageVolLookupByName"); n != 0 {
		t.Errorf("%d volume lookups, want 0 (every call uses the handle its creation answered)", n)
	}
}

// The free space read ahead is read again when debris was removed under
// the claim: a pool that has room only once an old, unmarked base is
// gone still takes the image.
func TestFakeSpaceReadAgainAfterDebris(t *testing.T) {
	body, sum := testImage(3 << 20)
	srv := serve(t, body, nil)
	c, h := newFakeCache(t, nil)
	if err := h.SetPoolCapacity(fakePool, 5<<20); err != nil {
		t.Fatal(err)
	}
	name := BaseName(fakeEntry, "k", imagecache.FormatQCOW2)
	if err := h.PutVolume(fakePool, libvirtfake.Volume{Name: name, Data: make([]byte, 4<<20)}); err != nil { // debris: no marker
		t.Fatal(err)
	}
	// The space is read ahead before the debris goes (else this test
	// would not see the stale read).
	read := newSignal()
	h.SetHook("StoragePoolGetInfo", read.seen)
	h.SetHook("StorageVolDelete", func(call libvirtfake.Call) error {
		if call.Volume == name && !read.within(holdWait) {
			t.Error("the free space was not read ahead")
		}
		return nil
	})
	b, err := c.Ensure(testCtx(t, 30*time.Second), imagecache.Image{Key: "k", URL: srv.url, SHA256: sum})
	if err != nil || b.Digest != sum {
		t.Fatalf("Ensure = %+v, %v", b, err)
	}
	if n := h.Calls("StoragePoolRefresh"); n != 2 {
		t.Errorf("%d pool refreshes, want 2 (ahead, and again after the debris was removed)", n)
	}
	wantVolumes(t, h, name, MarkerName(name, sum))
}
