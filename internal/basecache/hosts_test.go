package basecache

import (
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/testing/libvirtfake"
)

// barrier holds each of its n parties until all n have arrived, or until
// wait has passed since the first arrived (then every party goes on and
// full reports false), so that a cache that serialises them makes the
// test fail instead of hang.
type barrier struct {
	n    int
	wait time.Duration

	mu      sync.Mutex
	arrived int
	most    int // the most parties ever held at once
	timer   *time.Timer
	open    chan struct{}
	full    bool
}

func newBarrier(n int, wait time.Duration) *barrier {
	return &barrier{n: n, wait: wait, open: make(chan struct{})}
}

func (b *barrier) arrive() {
	b.mu.Lock()
	b.arrived++
	b.most = max(b.most, b.arrived)
	switch {
	case b.arrived == b.n && !b.full:
		b.full = true
		close(b.open)
		if b.timer != nil {
			b.timer.Stop()
		}
	case b.arrived == 1 && !b.full:
		b.timer = time.AfterFunc(b.wait, func() {
			b.mu.Lock()
			defer b.mu.Unlock()
			if !b.full {
				close(b.open)
				b.full = true // open, though not by n parties
				b.most = -b.most
			}
		})
	}
	b.mu.Unlock()
	<-b.open
	b.mu.Lock()
	b.arrived--
	b.mu.Unlock()
}

// filled reports whether all n parties were held at once.
func (b *barrier) filled() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.most == b.n
}

// Nothing in the cache serialises independent hosts: the cold fetches of
// four caches (one per host: each on its own libvirt fake, all with the
// default HTTP client, fetching the same image from one server) have their
// GETs in flight at once, their uploads streaming at once and their
// read-backs downloading at once: each is held until all four are there,
// which only concurrent fetches can do. (Between the hosts the cache
// shares nothing but the process: no lock, no single-flight key across
// caches, no semaphore; the default HTTP client has no per-host
// connection limit.)
func TestFakeHostsFetchConcurrently(t *testing.T) {
	const hosts = 4
	body, sum := testImage(64 << 10)
	gets := newBarrier(hosts, 5*time.Second)
	uploads := newBarrier(hosts, 5*time.Second)
	downloads := newBarrier(hosts, 5*time.Second)
	srv := serve(t, body, func(w http.ResponseWriter, r *http.Request) {
		gets.arrive()
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		_, _ = w.Write(body)
	})
	caches := make([]*Cache, hosts)
	for i := range caches {
		c, h := newFakeCache(t, nil)
		// Each party arrives once: before the first chunk of its stream.
		h.SetStreamHook("StorageVolUpload", func(call libvirtfake.Call) error {
			if call.Done == 0 {
				uploads.arrive()
			}
			return nil
		})
		h.SetStreamHook("StorageVolDownload", func(call libvirtfake.Call) error {
			if call.Done == 0 {
				downloads.arrive()
			}
			return nil
		})
		caches[i] = c
	}
	var wg sync.WaitGroup
	errs := make([]error, hosts)
	for i, c := range caches {
		wg.Go(func() {
			b, err := c.Ensure(testCtx(t, 30*time.Second), imagecache.Image{Key: "k", URL: srv.url, SHA256: sum})
			if err == nil && b.Digest != sum {
				err = fmt.Errorf("digest %s", b.Digest)
			}
			errs[i] = err
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("host %d: %v", i+1, err)
		}
	}
	for _, x := range []struct {
		what string
		b    *barrier
	}{{"GETs", gets}, {"uploads", uploads}, {"read-backs", downloads}} {
		if !x.b.filled() {
			t.Errorf("the %d hosts' %s were never all in flight at once", hosts, x.what)
		}
	}
}
