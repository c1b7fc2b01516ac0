//go:build integration

package basecache

import (
	"net/http"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/libvirtconn"
	"github.com/egressproxy/egressproxy/internal/testing/lab"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
	"github.com/egressproxy/egressproxy/sshconn"
)

// fanTarget is one host (pool) a fan-out test publishes on.
type fanTarget struct {
	name string
	lv   *libvirtconn.Session
	pool string
}

// fanTargets returns two lab hosts when a lab is up (onstack --lab 2),
// else the stack twice (two entries on one host; the cache cannot tell).
func fanTargets(t *testing.T) []fanTarget {
	t.Helper()
	if os.Getenv(lab.VarHosts) == "" {
		env := teststack.Require(t)
		return []fanTarget{{"stack", link(t, env), env.Pool}, {"stack", link(t, env), env.Pool}}
	}
	env := lab.Require(t)
	if len(env.Hosts) < 2 {
		t.Fatalf("the lab has %d hosts; this test needs 2 (onstack --lab 2)", len(env.Hosts))
	}
	var out []fanTarget
	for _, h := range env.Hosts[:2] {
		p, err := sshconn.New(sshconn.Config{Address: h.SSHAddr, User: h.SSHUser, KeyFile: h.SSHKey, KnownHostsFile: h.KnownHosts}, nil)
		if err != nil {
			t.Fatal(err)
		}
		lv := libvirtconn.New(p, libvirtconn.Config{Socket: h.LibvirtSocket, URI: h.LibvirtURI}, nil)
		t.Cleanup(func() {
			_ = lv.Close()
			_ = p.Close()
		})
		out = append(out, fanTarget{h.Netns, lv, h.Pool})
	}
	return out
}

// newFanCaches returns one cache per target (a fresh entry each, its
// volumes deleted when the test ends), all with Fanout f.
func newFanCaches(t *testing.T, targets []fanTarget, f *Fanout) []*Cache {
	caches := make([]*Cache, len(targets))
	for i, tg := range targets {
		entry := testEntry()
		cleanupEntry(t, tg.lv, tg.pool, entry)
		caches[i] = newTestCache(t, SSH(tg.lv), entry, tg.pool, func(cfg *Config) { cfg.Fanout = f })
	}
	return caches
}

// ensureEach runs Ensure of image on every cache at once.
func ensureEach(t *testing.T, caches []*Cache, image imagecache.Image) ([]Base, []error) {
	bases := make([]Base, len(caches))
	problems := make([]error, len(caches))
	var wg sync.WaitGroup
	for i, c := range caches {
		wg.Go(func() { bases[i], problems[i] = c.Ensure(ctxT(t, time.Minute), image) })
	}
	wg.Wait()
	return bases, problems
}

// The mirror drops the connection halfway through the shared body: both
// hosts fail Transient with nothing of their entry left in their pools;
// the retry shares one download again and both publish.
func TestIntegrationFanoutMirrorCut(t *testing.T) {
	targets := fanTargets(t)
	img := makeQcow2(t, t.TempDir(), 16)
	f := NewFanout(FanoutOptions{})
	var cut atomic.Bool
	cut.Store(true)
	srv := newImageServer(t, func(w http.ResponseWriter, r *http.Request, n int64) {
		if !cut.Load() {
			http.ServeFile(w, r, img.path)
			return
		}
		serveHalfThen(img, func(http.ResponseWriter, *http.Request) {
			waitMembers(f, len(targets))
			panic(http.ErrAbortHandler)
		})(w, r, n)
	})
	image := imagecache.Image{Key: "fan", URL: srv.URL + "/img.qcow2", SHA256: img.sha256}
	caches := newFanCaches(t, targets, f)
	_, problems := ensureEach(t, caches, image)
	for i, c := range caches {
		wantCode(t, problems[i], errs.Transient)
		if left := ours(t, targets[i].lv, targets[i].pool, c.cfg.Entry); len(left) > 0 {
			t.Fatalf("%s left %q after the cut", c.cfg.Entry, left)
		}
	}
	if n := srv.requests.Load(); n != 1 {
		t.Fatalf("%d requests, want 1", n)
	}
	cut.Store(false)
	bases, problems := ensureEach(t, caches, image)
	for i, c := range caches {
		if problems[i] != nil || bases[i].Digest != img.sha256 {
			t.Fatalf("retry, %s: %+v, %v", c.cfg.Entry, bases[i], problems[i])
		}
	}
	if n := srv.requests.Load(); n != 2 {
		t.Fatalf("%d requests after the retry, want 2", n)
	}
}

// Two entries (on two lab hosts) sharing a Fanout fetch a cold 16 MiB
// qcow2 at once: the mirror serves one GET, each host publishes the
// image's digest (its own read-back) under its own entry's name, one
// source "mirror" and one "shared". A retry is a hit on both.
func TestIntegrationFanout(t *testing.T) {
	targets := fanTargets(t)
	img := makeQcow2(t, t.TempDir(), 16)
	srv := newImageServer(t, serveFile(img))
	f := NewFanout(FanoutOptions{})
	image := imagecache.Image{Key: "fan", URL: srv.URL + "/img.qcow2", SHA256: img.sha256}
	caches := make([]*Cache, len(targets))
	for i, tg := range targets {
		entry := testEntry()
		cleanupEntry(t, tg.lv, tg.pool, entry)
		caches[i] = newTestCache(t, SSH(tg.lv), entry, tg.pool, func(cfg *Config) { cfg.Fanout = f })
	}
	bases := make([]Base, len(caches))
	problems := make([]error, len(caches))
	start := time.Now()
	var wg sync.WaitGroup
	for i, c := range caches {
		wg.Go(func() { bases[i], problems[i] = c.Ensure(ctxT(t, time.Minute), image) })
	}
	wg.Wait()
	t.Logf("2 cold fetches of %d bytes through one download: %v", img.size, time.Since(start))
	var sources []string
	for i, c := range caches {
		if problems[i] != nil {
			t.Fatalf("%s (%s): %v", c.cfg.Entry, targets[i].name, problems[i])
		}
		name := c.BaseName(image)
		if bases[i].Volume != name || bases[i].Digest != img.sha256 {
			t.Fatalf("%s: base %+v, want %s with sha256 %s", c.cfg.Entry, bases[i], name, img.sha256)
		}
		got := ours(t, targets[i].lv, targets[i].pool, c.cfg.Entry)
		slices.Sort(got)
		if want := []string{name, MarkerName(name, img.sha256)}; !slices.Equal(got, want) {
			t.Fatalf("%s on %s holds %q, want %q", c.cfg.Entry, targets[i].name, got, want)
		}
		if v, err := c.Verify(ctxT(t, time.Minute), image); err != nil || v.Digest != img.sha256 {
			t.Fatalf("%s: Verify = %+v, %v", c.cfg.Entry, v, err)
		}
		sources = append(sources, bases[i].Source)
	}
	if n := srv.requests.Load(); n != 1 {
		t.Fatalf("the mirror served %d requests for 2 hosts, want 1", n)
	}
	slices.Sort(sources)
	if !slices.Equal(sources, []string{imagecache.SourceMirror, imagecache.SourceShared}) {
		t.Fatalf("sources %q, want one mirror and one shared", sources)
	}
	for _, c := range caches {
		if b, err := c.Ensure(ctxT(t, time.Minute), image); err != nil || b.Source != imagecache.SourcePool {
			t.Fatalf("%s: second Ensure = %+v, %v; want a hit", c.cfg.Entry, b, err)
		}
	}
	if n := srv.requests.Load(); n != 1 {
		t.Fatalf("hits made %d requests in all, want 1", n)
	}
}
