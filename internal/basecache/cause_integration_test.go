//go:build integration

package basecache

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
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
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
	"github.com/egressproxy/egressproxy/sshconn"
	"libvirt.org/go/libvirtxml"
)

// cutProxy forwards TCP connections to the stack's sshd; cut ends
// connection n (1 = first accepted) and refuses every later one, as a host
// whose sshd went away under one session would.
type cutProxy struct {
	ln      net.Listener
	target  string
	mu      sync.Mutex
	conns   map[int][]net.Conn
	n       int
	refused atomic.Bool
	wg      sync.WaitGroup
}

func newCutProxy(t *testing.T, target string) *cutProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &cutProxy{ln: ln, target: target, conns: map[int][]net.Conn{}}
	p.wg.Add(1)
	go p.serve()
	t.Cleanup(func() {
		_ = ln.Close()
		p.mu.Lock()
		for _, cs := range p.conns {
			for _, c := range cs {
				_ = c.Close()
			}
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

func (p *cutProxy) serve() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		if p.refused.Load() {
			_ = c.Close()
			continue
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.mu.Lock()
		p.n++
		p.conns[p.n] = []net.Conn{c, up}
		p.mu.Unlock()
		p.wg.Add(2)
		go func() { defer p.wg.Done(); _, _ = io.Copy(up, c); _ = up.Close() }()
		go func() { defer p.wg.Done(); _, _ = io.Copy(c, up); _ = c.Close() }()
	}
}

// cut ends connection n and refuses new ones.
func (p *cutProxy) cut(n int) {
	p.refused.Store(true)
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns[n] {
		_ = c.Close()
	}
}

// dirPool defines a dir pool in a fresh directory (persistent: defined and
// started; else transient: created) and returns its name and directory.
// When the test ends the pool is destroyed (and undefined).
func dirPool(t *testing.T, lv *libvirtconn.Session, persistent bool) (name, dir string) {
	t.Helper()
	name = "ic-cause-" + testEntry()
	dir = filepath.Join(t.TempDir(), "pool")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	x, err := (&libvirtxml.StoragePool{Type: "dir", Name: name, Target: &libvirtxml.StoragePoolTarget{Path: dir}}).Marshal()
	if err != nil {
		t.Fatal(err)
	}
	err = lv.Do(ctxT(t, 30*time.Second), func(l *libvirt.Libvirt) error {
		if !persistent {
			_, err := l.StoragePoolCreateXML(x, 0)
			return err
		}
		p, err := l.StoragePoolDefineXML(x, 0)
		if err != nil {
			return err
		}
		return l.StoragePoolCreate(p, 0)
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		err := lv.Do(ctx, onPool(name, func(l *libvirt.Libvirt, p libvirt.StoragePool) error {
			_ = l.StoragePoolDestroy(p)
			if persistent {
				return l.StoragePoolUndefine(p)
			}
			return nil
		}))
		if err != nil {
			t.Errorf("remove pool %s: %v", name, err)
		}
	})
	return name, dir
}

// restorePool starts pool again (persistent) or re-creates it from the
// same directory (transient) when the test destroyed it; the entry's
// volumes can then be checked and removed.
func restorePool(t *testing.T, lv *libvirtconn.Session, pool, dir string, persistent bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := lv.Do(ctx, func(l *libvirt.Libvirt) error {
		p, err := l.StoragePoolLookupByName(pool)
		if err == nil {
			active, err := l.StoragePoolIsActive(p)
			if err != nil || active == 1 {
				return err
			}
			return l.StoragePoolCreate(p, 0)
		}
		if persistent {
			return err
		}
		x, err := (&libvirtxml.StoragePool{Type: "dir", Name: pool, Target: &libvirtxml.StoragePoolTarget{Path: dir}}).Marshal()
		if err != nil {
			return err
		}
		_, err = l.StoragePoolCreateXML(x, 0)
		return err
	})
	if err != nil {
		t.Errorf("restore pool %s: %v", pool, err)
	}
}

// When the libvirt side fails during a fetch, the error reports that
// failure with its class, never "reading the image" (the HTTP body was
// fine): the staged volume deleted, the pool destroyed or stopped, the
// shared session lost (the drain polls the volume on it), the upload's own
// link killed. Each returns promptly and leaves nothing behind.
func TestStackLibvirtFailureNamed(t *testing.T) {
	env := teststack.Require(t)
	lv := link(t, env)
	img := makeQcow2(t, t.TempDir(), 48)
	type rig struct {
		pool  string
		rc    *recordingConn
		proxy *cutProxy
		base  string
	}
	for _, tt := range []struct {
		name       string
		pool       string // "" env.Pool, "transient", "persistent"
		viaProxy   bool
		sabotage   func(t *testing.T, r *rig)
		want       errs.ErrorCode
		msg        string // the libvirt failure, as the error must name it
		afterBytes int64
	}{
		{name: "staged volume deleted", sabotage: func(t *testing.T, r *rig) {
			if err := delVol(lv, r.pool, r.base); err != nil {
				t.Errorf("delete underneath: %v", err)
			}
		}, want: errs.Transient, msg: "storage vol"},
		{name: "transient pool destroyed", pool: "transient", sabotage: func(t *testing.T, r *rig) {
			err := lv.Do(ctxT(t, 30*time.Second), onPool(r.pool, func(l *libvirt.Libvirt, p libvirt.StoragePool) error { return l.StoragePoolDestroy(p) }))
			t.Logf("StoragePoolDestroy: %v", err)
		}, want: errs.Permanent, msg: "storage pool"},
		{name: "persistent pool stopped", pool: "persistent", sabotage: func(t *testing.T, r *rig) {
			err := lv.Do(ctxT(t, 30*time.Second), onPool(r.pool, func(l *libvirt.Libvirt, p libvirt.StoragePool) error { return l.StoragePoolDestroy(p) }))
			t.Logf("StoragePoolDestroy: %v", err)
		}, want: errs.Permanent, msg: "storage pool"},
		{name: "shared session lost", viaProxy: true, sabotage: func(t *testing.T, r *rig) { r.proxy.cut(1) }, want: errs.Transient, msg: "unreachable"},
		{name: "upload link killed", sabotage: func(t *testing.T, r *rig) {
			r.rc.mu.Lock()
			defer r.rc.mu.Unlock()
			r.rc.last.Kill()
		}, want: errs.Transient, msg: "interrupted"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := &rig{pool: env.Pool}
			var poolDir string
			if tt.pool != "" {
				r.pool, poolDir = dirPool(t, lv, tt.pool == "persistent")
			}
			entry := testEntry()
			cleanupEntry(t, lv, r.pool, entry)
			if tt.pool != "" {
				t.Cleanup(func() { restorePool(t, lv, r.pool, poolDir, tt.pool == "persistent") })
			}
			srv := newImageServer(t, func(w http.ResponseWriter, req *http.Request, _ int64) {
				f, _ := os.Open(img.path)
				defer f.Close()
				w.Header().Set("Content-Length", strconv.FormatInt(img.size, 10))
				for { // paced, so the sabotage lands mid-upload
					if _, err := io.CopyN(w, f, 1<<20); err != nil {
						return
					}
					w.(http.Flusher).Flush()
					time.Sleep(5 * time.Millisecond)
				}
			})
			conn := lv
			if tt.viaProxy {
				r.proxy = newCutProxy(t, env.SSHAddr)
				p, err := sshconn.New(sshconn.Config{Address: r.proxy.ln.Addr().String(), User: env.SSHUser, KeyFile: env.SSHKey, KnownHostsFile: knownHostsFor(t, env, r.proxy.ln.Addr().String())}, nil)
				if err != nil {
					t.Fatal(err)
				}
				conn = libvirtconn.New(p, libvirtconn.Config{Socket: env.LibvirtSocket, URI: env.LibvirtURI}, nil)
				t.Cleanup(func() { _ = conn.Close(); _ = p.Close() })
			} else {
				conn = link(t, env)
			}
			r.rc = &recordingConn{Session: conn}
			im := imagecache.Image{Key: "img", URL: srv.URL + "/i"}
			r.base = BaseName(entry, im.Key, "qcow2")
			var once sync.Once
			c := newTestCache(t, r.rc, entry, r.pool, func(cfg *Config) {
				cfg.ProgressInterval = time.Millisecond
				cfg.Progress = func(p imagecache.Progress) {
					if p.Bytes > 8<<20 {
						once.Do(func() { tt.sabotage(t, r) })
					}
				}
			})
			start := time.Now()
			_, err := c.Ensure(ctxT(t, 2*time.Minute), im)
			el := time.Since(start)
			t.Logf("after %s: %v", el.Round(time.Millisecond), err)
			if err == nil {
				t.Fatal("Ensure succeeded")
			}
			if strings.Contains(err.Error(), "reading the image") {
				t.Errorf("a libvirt failure is reported as a failure reading the image: %v", err)
			}
			if !strings.Contains(strings.ToLower(err.Error()), tt.msg) {
				t.Errorf("error does not name the libvirt failure (%q): %v", tt.msg, err)
			}
			if got := errs.Code(err); got != tt.want {
				t.Errorf("class %v, want %v", got, tt.want)
			}
			if el > time.Minute {
				t.Errorf("returned after %s", el)
			}
			if tt.pool != "" {
				restorePool(t, lv, r.pool, poolDir, tt.pool == "persistent")
			}
			if left := ours(t, lv, r.pool, entry); len(left) > 0 {
				t.Logf("volumes left in the pool after the failure: %v", left)
			}
		})
	}
}
