package basecache

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/testing/eventually"
	"github.com/egressproxy/egressproxy/sshconn"
)

// fakeConn never runs fn (there is no libvirt behind it): Do blocks on gate
// (when set) and returns err.
type fakeConn struct {
	calls atomic.Int64
	gate  chan struct{}
	err   error
}

func (f *fakeConn) Do(ctx context.Context, _ func(Libvirt) error) error {
	f.calls.Add(1)
	if f.gate != nil {
		select {
		case <-f.gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return f.err
}

func (f *fakeConn) Dedicated(context.Context) (Dedicated, error) {
	return nil, errors.New("no dedicated connections here")
}

var okImage = imagecache.Image{Key: "deb.12", URL: "http://mirror.invalid/deb.qcow2"}

func TestNewValidates(t *testing.T) {
	good := Config{Entry: "host1", Pool: "default"}
	for _, tt := range []struct {
		name  string
		conn  Conn
		cfg   func(Config) Config
		field string
	}{
		{"nil conn", nil, func(c Config) Config { return c }, "conn"},
		{"no entry", &fakeConn{}, func(c Config) Config { c.Entry = ""; return c }, "Entry"},
		{"bad entry", &fakeConn{}, func(c Config) Config { c.Entry = "a--b"; return c }, "Entry"},
		{"no pool", &fakeConn{}, func(c Config) Config { c.Pool = ""; return c }, "Pool"},
		{"grace not shorter than budget", &fakeConn{}, func(c Config) Config {
			c.TransferBudget, c.HTTPGrace = time.Minute, time.Minute
			return c
		}, "HTTPGrace"},
		{"negative", &fakeConn{}, func(c Config) Config { c.ProgressInterval = -1; return c }, "ProgressInterval"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := New(tt.conn, tt.cfg(good))
			if errs.Code(err) != errs.Permanent || !strings.Contains(err.Error(), tt.field) {
				t.Fatalf("New = %v, want Permanent naming %s", err, tt.field)
			}
		})
	}
	c, err := New(&fakeConn{}, good)
	if err != nil {
		t.Fatal(err)
	}
	if c.cfg.TransferBudget != 20*time.Minute || c.cfg.HTTPGrace != time.Minute || c.cfg.ProgressInterval != 5*time.Second {
		t.Fatalf("defaults: %+v", c.cfg)
	}
	if c.BaseName(okImage) != "base-host1--deb.12.qcow2" {
		t.Fatalf("BaseName = %q", c.BaseName(okImage))
	}
	_ = c.Close()
	short, err := New(&fakeConn{}, Config{Entry: "h", Pool: "p", TransferBudget: 40 * time.Second})
	if err != nil || short.cfg.HTTPGrace != 10*time.Second {
		t.Fatalf("short budget: grace %v, err %v", short.cfg.HTTPGrace, err)
	}
	_ = short.Close()
}

func newFake(t *testing.T, f *fakeConn) *Cache {
	t.Helper()
	c, err := New(f, Config{Entry: "e", Pool: "p"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func TestEnsureClassesWithoutLibvirt(t *testing.T) {
	t.Run("bad image touches nothing", func(t *testing.T) {
		f := &fakeConn{}
		_, err := newFake(t, f).Ensure(context.Background(), imagecache.Image{Key: "x"})
		if errs.Code(err) != errs.Permanent || f.calls.Load() != 0 {
			t.Fatalf("err %v, %d libvirt calls", err, f.calls.Load())
		}
	})
	t.Run("libvirt down is transient", func(t *testing.T) {
		f := &fakeConn{err: &sshconn.Error{Kind: sshconn.KindUnreachable, Err: errors.New("link dead")}}
		_, err := newFake(t, f).Ensure(context.Background(), okImage)
		if errs.Code(err) != errs.Transient {
			t.Fatalf("err %v", err)
		}
	})
	t.Run("after Close", func(t *testing.T) {
		c := newFake(t, &fakeConn{})
		_ = c.Close()
		_, err := c.Ensure(context.Background(), okImage)
		if errs.Code(err) != errs.Permanent || !errors.Is(err, errs.ErrClosed) {
			t.Fatalf("err %v", err)
		}
		if _, err := c.List(context.Background()); !errors.Is(err, errs.ErrClosed) {
			t.Fatalf("List after Close: %v", err)
		}
		if err := c.Evict(context.Background(), okImage); !errors.Is(err, errs.ErrClosed) {
			t.Fatalf("Evict after Close: %v", err)
		}
	})
	t.Run("caller deadline returns promptly and cancels the fetch", func(t *testing.T) {
		f := &fakeConn{gate: make(chan struct{})} // never opens
		c := newFake(t, f)
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		start := time.Now()
		_, err := c.Ensure(ctx, okImage)
		if errs.Code(err) != errs.DeadlineExceeded || time.Since(start) > 5*time.Second {
			t.Fatalf("err %v after %s", err, time.Since(start))
		}
		done := make(chan error)
		go func() { done <- c.Close() }()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("Close: %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("Close blocked: the abandoned fetch was not canceled")
		}
	})
}

// N concurrent Ensure calls of one image share one flight: libvirt is asked
// once, and every caller gets the same result.
func TestEnsureSingleFlight(t *testing.T) {
	f := &fakeConn{gate: make(chan struct{}), err: errors.New("pool gone")}
	c := newFake(t, f)
	const n = 6
	var wg sync.WaitGroup
	problems := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, problems[i] = c.Ensure(context.Background(), okImage)
		}()
	}
	eventually.True(t, 5*time.Second, func() bool { return waiters(c, okImage) == n }, "%d callers wait for the flight", n)
	close(f.gate)
	wg.Wait()
	if got := f.calls.Load(); got != 1 {
		t.Fatalf("%d libvirt calls for %d concurrent Ensure, want 1", got, n)
	}
	for i, err := range problems {
		if errs.Code(err) != errs.Transient || !strings.Contains(err.Error(), "pool gone") {
			t.Fatalf("caller %d: %v", i, err)
		}
	}
	// A different URL for the same key while in flight is refused.
	f2 := &fakeConn{gate: make(chan struct{})}
	c2 := newFake(t, f2)
	go func() { _, _ = c2.Ensure(context.Background(), okImage) }()
	eventually.True(t, 5*time.Second, func() bool { return f2.calls.Load() > 0 }, "the first Ensure asks libvirt")
	other := okImage
	other.URL = "http://elsewhere.invalid/x"
	if _, err := c2.Ensure(context.Background(), other); errs.Code(err) != errs.Permanent {
		t.Fatalf("conflicting in-flight Ensure: %v", err)
	}
	close(f2.gate)
}

// waiters is how many callers wait for the flight of img.
func waiters(c *Cache, img imagecache.Image) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if f := c.flights[c.BaseName(img)]; f != nil {
		return f.waiters
	}
	return 0
}
