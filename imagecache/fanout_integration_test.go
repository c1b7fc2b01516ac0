//go:build integration

package imagecache

import (
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/internal/lab"
	"github.com/egressproxy/egressproxy/internal/teststack"
	"github.com/egressproxy/egressproxy/sshconn"
)

// fanTarget is one host (pool) a fan-out test publishes on.
type fanTarget struct {
	name string
	lv   *sshconn.Libvirt
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
		p, err := sshconn.New(sshconn.Config{Addr: h.SSHAddr, User: h.SSHUser, KeyFile: h.SSHKey, KnownHostsFile: h.KnownHosts})
		if err != nil {
			t.Fatal(err)
		}
		lv := sshconn.NewLibvirt(p, sshconn.LibvirtConfig{Socket: h.LibvirtSocket, URI: h.LibvirtURI})
		t.Cleanup(func() {
			_ = lv.Close()
			_ = p.Close()
		})
		out = append(out, fanTarget{h.Netns, lv, h.Pool})
	}
	return out
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
	image := Image{Key: "fan", URL: srv.URL + "/img.qcow2", SHA256: img.sha256}
	caches := make([]*Cache, len(targets))
	for i, tg := range targets {
		entry := testEntry()
		cleanupEntry(t, tg.lv, tg.pool, entry)
		caches[i] = newTestCache(t, SSH(tg.lv), entry, tg.pool, func(cfg *Config) { cfg.Fanout = f })
	}
	bases := make([]Base, len(caches))
	errs := make([]error, len(caches))
	start := time.Now()
	var wg sync.WaitGroup
	for i, c := range caches {
		wg.Go(func() { bases[i], errs[i] = c.Ensure(ctxT(t, time.Minute), image) })
	}
	wg.Wait()
	t.Logf("2 cold fetches of %d bytes through one download: %v", img.size, time.Since(start))
	var sources []string
	for i, c := range caches {
		if errs[i] != nil {
			t.Fatalf("%s (%s): %v", c.cfg.Entry, targets[i].name, errs[i])
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
	if !slices.Equal(sources, []string{SourceMirror, SourceShared}) {
		t.Fatalf("sources %q, want one mirror and one shared", sources)
	}
	for _, c := range caches {
		if b, err := c.Ensure(ctxT(t, time.Minute), image); err != nil || b.Source != SourcePool {
			t.Fatalf("%s: second Ensure = %+v, %v; want a hit", c.cfg.Entry, b, err)
		}
	}
	if n := srv.requests.Load(); n != 1 {
		t.Fatalf("hits made %d requests in all, want 1", n)
	}
}
