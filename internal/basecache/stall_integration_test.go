//go:build integration

package basecache

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/libvirtconn"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
	"github.com/egressproxy/egressproxy/sshconn"
)

// freezeProxy forwards TCP connections to the stack's sshd and can freeze
// one of them (by its number, 1 = first accepted) once a given number of
// bytes has flowed in one direction: from then on it forwards nothing in
// either direction, like a hung stream whose SSH peer stays connected.
type freezeProxy struct {
	ln     net.Listener
	target string

	freezeConn  int   // which connection to freeze (0: none)
	freezeAfter int64 // after this many bytes ...
	fromServer  bool  // ... in this direction

	accepted atomic.Int64
	frozen   atomic.Bool
	thaw     chan struct{}
	mu       sync.Mutex
	conns    []net.Conn
	wg       sync.WaitGroup
}

func newFreezeProxy(t *testing.T, target string, conn int, after int64, fromServer bool) *freezeProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &freezeProxy{ln: ln, target: target, freezeConn: conn, freezeAfter: after, fromServer: fromServer, thaw: make(chan struct{})}
	p.wg.Add(1)
	go p.serve()
	t.Cleanup(p.close)
	return p
}

func (p *freezeProxy) addr() string { return p.ln.Addr().String() }

func (p *freezeProxy) close() {
	_ = p.ln.Close()
	close(p.thaw)
	p.mu.Lock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *freezeProxy) serve() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		n := int(p.accepted.Add(1))
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, up)
		p.mu.Unlock()
		freeze := n == p.freezeConn
		var moved atomic.Int64
		pipe := func(dst, src net.Conn, counts bool) {
			defer p.wg.Done()
			defer dst.Close()
			defer src.Close()
			buf := make([]byte, 32<<10)
			for {
				k, err := src.Read(buf)
				if k > 0 {
					if freeze && counts && moved.Add(int64(k)) > p.freezeAfter {
						p.frozen.Store(true)
					}
					if freeze && p.frozen.Load() {
						<-p.thaw // hold everything; the link stays open
						return
					}
					if _, err := dst.Write(buf[:k]); err != nil {
						return
					}
				}
				if err != nil {
					return
				}
			}
		}
		p.wg.Add(2)
		go pipe(up, c, !p.fromServer)
		go pipe(c, up, p.fromServer)
	}
}

// A stream that hangs — the read-back (no byte from the host) or the upload
// (libvirt stops consuming) — ends after Config.StreamStall: its dedicated
// connection is discarded and the stream retried once on a fresh one, the
// base is published, and no goroutine is left (goleak in TestMain). Before,
// a hung read-back waited a minute for a stall and then failed the fetch.
func TestStackStreamStallRetriedOnce(t *testing.T) {
	env := teststack.Require(t)
	img := makeQcow2(t, t.TempDir(), 8)
	// Connections through the proxy: 1 the shared link, 2 the upload's,
	// which the read-back of this one-segment image rides once the upload
	// is over (then 3 for the retry: the read-back alone, or the upload
	// and its read-back). Frozen from the server after 1 MiB: the
	// read-back's data; from the client: the upload's.
	for _, tc := range []struct {
		name       string
		conn       int
		fromServer bool
		wantConns  int64
	}{
		{"read-back hangs", 2, true, 3},
		{"upload hangs", 2, false, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			proxy := newFreezeProxy(t, env.SSHAddr, tc.conn, 1<<20, tc.fromServer)
			pool, err := sshconn.New(sshconn.Config{Address: proxy.addr(), User: env.SSHUser, KeyFile: env.SSHKey, KnownHostsFile: knownHostsFor(t, env, proxy.addr())}, nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = pool.Close() })
			lv := libvirtconn.New(pool, libvirtconn.Config{Socket: env.LibvirtSocket, URI: env.LibvirtURI}, nil)
			t.Cleanup(func() { _ = lv.Close() })
			check := link(t, env)
			entry := testEntry()
			cleanupEntry(t, check, env.Pool, entry)
			srv := newImageServer(t, serveFile(img))
			c, err := New(SSH(lv), Config{Entry: entry, Pool: env.Pool, TransferBudget: 2 * time.Minute, HTTPGrace: 30 * time.Second,
				StreamStall: 2 * time.Second, Logger: testr.NewWithOptions(t, testr.Options{Verbosity: 1})})
			if err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			b, err := c.Ensure(ctxT(t, 90*time.Second), imagecache.Image{Key: "s", URL: srv.URL + "/s"})
			el := time.Since(start)
			if cerr := c.Close(); cerr != nil {
				t.Errorf("Close: %v", cerr)
			}
			if err != nil {
				t.Fatalf("Ensure with one hung stream: %v (class %v)", err, errs.Code(err))
			}
			t.Logf("published %s in %v after one hung stream; %d connections through the proxy", b.Volume, el, proxy.accepted.Load())
			if !proxy.frozen.Load() {
				t.Fatal("the stream was never frozen: the test did not exercise a hang")
			}
			if b.Digest != img.sha256 {
				t.Errorf("digest %s, want %s", b.Digest, img.sha256)
			}
			if got := proxy.accepted.Load(); got != tc.wantConns && got != tc.wantConns+1 {
				t.Errorf("%d connections, want %d (one retry on a fresh connection)", got, tc.wantConns)
			}
		})
	}
}

// knownHostsFor writes a known_hosts that pins the stack's host key(s) for
// addr (the proxy in front of the stack's sshd).
func knownHostsFor(t *testing.T, env teststack.Env, addr string) string {
	t.Helper()
	b, err := os.ReadFile(env.KnownHosts)
	if err != nil {
		t.Fatal(err)
	}
	host, port, _ := net.SplitHostPort(addr)
	var out []string
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if f := strings.Fields(line); len(f) >= 3 {
			out = append(out, "["+host+"]:"+port+" "+strings.Join(f[1:], " "))
		}
	}
	path := filepath.Join(t.TempDir(), "known_hosts")
	if err := os.WriteFile(path, []byte(strings.Join(out, "\n")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// Callers on one shared session are isolated: while fetches fail (a body
// that errors mid-upload, so the drain poll on the shared session is
// stopped mid-call) and other callers' Ensures are cancelled after a few
// milliseconds, 20 concurrent readers of the same session keep succeeding
// and the session is never torn down. Before, each failed upload and each
// cancelled call killed the shared session and failed the readers.
func TestStackCallersIsolatedFromFailingUploads(t *testing.T) {
	env := teststack.Require(t)
	lv := link(t, env)
	entry := testEntry()
	cleanupEntry(t, lv, env.Pool, entry)
	img := makeQcow2(t, t.TempDir(), 8)
	failing := newImageServer(t, serveHalfThen(img, func(http.ResponseWriter, *http.Request) { panic(http.ErrAbortHandler) }))
	c := newTestCache(t, SSH(lv), entry, env.Pool, nil)

	stop := make(chan struct{})
	var ok, failed atomic.Int64
	var firstErr atomic.Value
	var wg sync.WaitGroup
	for range 20 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				cctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				_, err := c.poolAvailable(cctx)
				cancel()
				if err != nil {
					failed.Add(1)
					firstErr.CompareAndSwap(nil, err)
					continue
				}
				ok.Add(1)
			}
		})
	}
	var uploadsFailed, cancelled atomic.Int64
	wg.Go(func() { // uploads that fail mid-body
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			_, err := c.Ensure(ctxT(t, 30*time.Second), imagecache.Image{Key: fmt.Sprintf("f%d", i), URL: failing.URL + "/f"})
			if err != nil {
				uploadsFailed.Add(1)
			}
		}
	})
	wg.Go(func() { // callers whose ctx ends after 1–8 ms
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			cctx, cancel := context.WithTimeout(context.Background(), time.Duration(1+i%8)*time.Millisecond)
			_, err := c.List(cctx)
			cancel()
			if err != nil {
				cancelled.Add(1)
			}
		}
	})
	time.Sleep(6 * time.Second)
	close(stop)
	wg.Wait()
	t.Logf("reader calls ok %d, failed %d; uploads failed %d; cancelled calls %d", ok.Load(), failed.Load(), uploadsFailed.Load(), cancelled.Load())
	if n := failed.Load(); n > 0 {
		t.Errorf("%d reader calls failed beside failing uploads and cancelled callers; first: %v", n, firstErr.Load())
	}
	if uploadsFailed.Load() == 0 || cancelled.Load() == 0 {
		t.Errorf("the test exercised no failing upload (%d) or no cancelled call (%d)", uploadsFailed.Load(), cancelled.Load())
	}
	if lv.Dead() {
		t.Error("the shared session is dead after callers failed or cancelled")
	}
}
