package kvm2

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/go-logr/logr/testr"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/basecache"
	"github.com/egressproxy/egressproxy/internal/budget"
	"github.com/egressproxy/egressproxy/internal/testing/libvirtfake"
	"github.com/egressproxy/egressproxy/sshconn"
)

// The unit tests build a provider on internal/testing/libvirtfake's
// in-memory libvirtd (fakeLink is the lvSession over it) and on fakeImages
// (the imageCache, which puts the base volume into the fake's pool as a
// fetch would).

var _ lvAPI = (*libvirtfake.Session)(nil)

const fakeAddr = "hv1.example:22"

// fakeLink is the lvSession over a libvirtfake.Host. Calls run on the
// Host's shared session through Host.Do (a Do whose ctx ends returns at
// once; its fn is abandoned and completes later), and fail as the real
// session's do: a ctx that ended as an sshconn error, a call whose session
// went (libvirtfake.ErrKilled, go-libvirt's ErrInterrupted) as
// KindUnreachable, every call once Close began as KindClosed. Close closes
// the Host: it ends every held call and waits for every fn. The Host's
// hook "Do" stands for the link: its error is the call's (a failed dial).
type fakeLink struct {
	host *libvirtfake.Host

	mu     sync.Mutex
	closed bool
	closes int
}

func (l *fakeLink) isClosed() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.closed
}

func (l *fakeLink) closeCount() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.closes
}

func fakeClosedError() error {
	return &sshconn.Error{Kind: sshconn.KindClosed, Address: fakeAddr, Op: "libvirt call", Err: errors.New("libvirt session closed")}
}

func fakeCtxError(err error) error {
	k := sshconn.KindUnknown
	if errors.Is(err, context.DeadlineExceeded) || errors.As(err, new(*budget.TimeoutError)) {
		k = sshconn.KindUnreachable
	}
	return &sshconn.Error{Kind: k, Address: fakeAddr, Op: "libvirt call", Err: err}
}

func (l *fakeLink) Do(ctx context.Context, fn func(lvAPI) error) error {
	if err := budget.Err(ctx); err != nil {
		return fakeCtxError(err)
	}
	if l.isClosed() {
		return fakeClosedError()
	}
	err := l.host.Do(ctx, func(s *libvirtfake.Session) error { return fn(s) })
	switch {
	case err == nil:
		return nil
	case l.isClosed():
		return fakeClosedError()
	case ctx.Err() != nil && errors.Is(err, ctx.Err()):
		return fakeCtxError(budget.Err(ctx))
	case errors.Is(err, libvirtfake.ErrKilled), errors.Is(err, libvirt.ErrInterrupted):
		return &sshconn.Error{Kind: sshconn.KindUnreachable, Address: fakeAddr, Op: "libvirt call", Err: err}
	}
	return err
}

func (l *fakeLink) Close() error {
	l.mu.Lock()
	l.closes++
	closed := l.closed
	l.closed = true
	l.mu.Unlock()
	if closed {
		return nil
	}
	return l.host.Close()
}

// fakeImages is the imageCache: Ensure puts the base volume into the
// fake's pool (as a fetch would) and returns it, or fails with err.
type fakeImages struct {
	host  *libvirtfake.Host
	entry string
	pool  string

	mu      sync.Mutex
	err     error
	ensured []string
	pools   []libvirt.StoragePool // given by UsePool
	closed  int
	block   chan struct{} // when set, Ensure waits for it or ctx
	entered chan struct{} // when set, closed by the first Ensure
	once    sync.Once
}

func (c *fakeImages) setErr(err error) {
	c.mu.Lock()
	c.err = err
	c.mu.Unlock()
}

func (c *fakeImages) Ensure(ctx context.Context, img imagecache.Image) (basecache.Base, error) {
	c.mu.Lock()
	c.ensured = append(c.ensured, img.Key)
	err, block := c.err, c.block
	c.mu.Unlock()
	if c.entered != nil {
		c.once.Do(func() { close(c.entered) })
	}
	if block != nil {
		select {
		case <-block:
		case <-ctx.Done():
			return basecache.Base{}, ctx.Err()
		}
	}
	if err != nil {
		return basecache.Base{}, err
	}
	format := img.Format
	if format == "" {
		format = "qcow2"
	}
	name := basecache.BaseName(c.entry, img.Key, format)
	if _, ok := c.host.Volume(c.pool, name); !ok {
		if err := c.host.PutVolume(c.pool, libvirtfake.Volume{Name: name, Format: format, Capacity: 1 << 30, Data: []byte("base")}); err != nil {
			return basecache.Base{}, err
		}
	}
	v, _ := c.host.Volume(c.pool, name)
	return basecache.Base{Volume: name, Path: v.Path, Digest: "0123456789abcdef", Format: format}, nil
}

func (c *fakeImages) UsePool(p libvirt.StoragePool) {
	c.mu.Lock()
	c.pools = append(c.pools, p)
	c.mu.Unlock()
}

func (c *fakeImages) usedPools() []libvirt.StoragePool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.pools)
}

func (c *fakeImages) closeCount() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed
}

func (c *fakeImages) Close() error {
	c.mu.Lock()
	c.closed++
	c.mu.Unlock()
	return nil
}

// fakeEnv is a Provider on the fakes.
type fakeEnv struct {
	t      *testing.T
	cfg    Config
	host   *libvirtfake.Host
	link   *fakeLink
	images *fakeImages
	p      *provider
}

// newFakeEnv builds a Provider of validConfig with image "tiny" (and mod
// applied before validation) on fresh fakes: a host whose pool has 42 GiB
// free and offers KVM (testdata/domcaps-kvm.xml). It is closed when t
// ends.
func newFakeEnv(t *testing.T, mod ...func(*Config)) *fakeEnv {
	t.Helper()
	c := validConfig()
	c.Images = map[string]imagecache.Image{"tiny": {URL: "http://127.0.0.1:1/tiny.qcow2"}}
	for _, m := range mod {
		m(&c)
	}
	cfg, err := c.validate(false)
	if err != nil {
		t.Fatal(err)
	}
	host := libvirtfake.New()
	if err := host.AddPool(cfg.Pool, 42<<30); err != nil {
		t.Fatal(err)
	}
	host.SetDomainCapabilities(domcapsKVM)
	e := &fakeEnv{t: t, cfg: cfg, host: host, link: &fakeLink{host: host}, images: &fakeImages{host: host, entry: cfg.Entry, pool: cfg.Pool}}
	e.p = newProvider(cfg, testr.NewWithOptions(t, testr.Options{Verbosity: 1}), noop.NewTracerProvider().Tracer(tracerName), e.link, e.images)
	t.Cleanup(func() {
		if err := e.p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return e
}

func (e *fakeEnv) dom(name string) string { return domainName(e.cfg.Entry, name) }

// defineXML defines a domain from x directly, as another client of the
// host would. It may run in a hook, on a call's goroutine: it reports a
// failure with t.Error, never Fatal.
func (e *fakeEnv) defineXML(t *testing.T, x string) {
	t.Helper()
	if _, err := e.host.DefineDomain(x); err != nil {
		t.Error(err)
	}
}

// putVolume puts v into the entry's pool directly (test setup).
func (e *fakeEnv) putVolume(v libvirtfake.Volume) {
	e.t.Helper()
	if err := e.host.PutVolume(e.cfg.Pool, v); err != nil {
		e.t.Fatal(err)
	}
}

// fakeFault is a hook on the calls of one method, before they take
// effect, for tables of faults.
type fakeFault struct {
	method string
	hook   libvirtfake.Hook
}

func (f fakeFault) install(h *libvirtfake.Host) { h.SetHook(f.method, f.hook) }

// failCalls fails every call of method with err.
func failCalls(method string, err error) fakeFault { return fakeFault{method, libvirtfake.Fail(err)} }

// fakeRPC is what the tests compare of one logged call.
type fakeRPC struct{ Method, Name string }

func rpcsOf(calls []libvirtfake.Call) []fakeRPC {
	out := make([]fakeRPC, len(calls))
	for i, c := range calls {
		out[i] = fakeRPC{c.Method, c.Name()}
	}
	return out
}
