//go:build integration

package basecache

import (
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/libvirtconn"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
	"github.com/egressproxy/egressproxy/sshconn"
)

// Many read-backs in a row each deliver every byte and return. Under CPU
// load the real libvirtd sometimes sends a download's first data packet
// before the call's reply (measured: 11 of 200 read-backs with both cores
// busy); without the libvirt session's stream guard each of those left go-libvirt's
// router deadlocked and the read-back never started (docs/upstream.md).
// The test logs how often the guard had to act.
func TestStackReadBacksComplete(t *testing.T) {
	env := teststack.Require(t)
	var guarded atomic.Int64
	log := funcr.New(func(_, args string) {
		if strings.Contains(args, "stream guard") {
			guarded.Add(1)
			t.Log(args)
		}
	}, funcr.Options{Verbosity: 1})
	p, err := sshconn.New(sshconn.Config{Address: env.SSHAddr, User: env.SSHUser, KeyFile: env.SSHKey, KnownHostsFile: env.KnownHosts}, &sshconn.Options{Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	lv := libvirtconn.New(p, libvirtconn.Config{Socket: env.LibvirtSocket, URI: env.LibvirtURI}, &libvirtconn.Options{Logger: log})
	t.Cleanup(func() {
		_ = lv.Close()
		_ = p.Close()
	})
	entry := testEntry()
	cleanupEntry(t, lv, env.Pool, entry)
	img := makeQcow2(t, t.TempDir(), 1)
	srv := newImageServer(t, serveFile(img))
	c := newTestCache(t, SSH(lv), entry, env.Pool, func(cfg *Config) { cfg.Logger = logr.Discard() })
	b, err := c.Ensure(ctxT(t, time.Minute), imagecache.Image{Key: "g", URL: srv.URL + "/g"})
	if err != nil {
		t.Fatal(err)
	}
	const n = 50
	start := time.Now()
	for i := range n {
		got, digest, err := c.readBack(ctxT(t, time.Minute), b.Volume)
		if err != nil {
			t.Fatalf("read-back %d: %v", i, err)
		}
		if got != img.size || digest != img.sha256 {
			t.Fatalf("read-back %d: %d bytes sha256 %s, want %d bytes %s", i, got, digest, img.size, img.sha256)
		}
	}
	t.Logf("%d read-backs in %v; the stream guard acted on %d of them", n, time.Since(start), guarded.Load())
}
