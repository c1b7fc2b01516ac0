//go:build integration

package basecache

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
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

// Late joiners on the lab (onstack --lab 2): host 1 publishes an image
// from the mirror, then host 2, cold, copies host 1's base over the two
// links (StorageVolDownload from host 1, StorageVolUpload to host 2) and
// verifies it by its own read-back; faults of the peer mid-copy make host
// 2's download go on from the mirror.

// peerPair returns two caches on the first two lab hosts sharing a Fanout
// (mod1, mod2 change their SSH and cache settings), a 64 MiB image on a
// counting server, and host 1's base already published from it.
func peerPair(t *testing.T, ssh1 func(*sshconn.Config), mod2 func(*Config)) (lab.Env, [2]*Cache, [2]fanTarget, imagecache.Image, imageFile, *imageServer) {
	t.Helper()
	env := twoLabHosts(t)
	targets := [2]fanTarget{labTarget(t, env.Hosts[0], ssh1), labTarget(t, env.Hosts[1], nil)}
	img := makeQcow2(t, t.TempDir(), 64)
	srv := newImageServer(t, serveFile(img))
	image := imagecache.Image{Key: "peer", URL: srv.URL + "/img.qcow2", SHA256: img.sha256}
	f := NewFanout(FanoutOptions{})
	var caches [2]*Cache
	for i, tg := range targets {
		entry := testEntry()
		cleanupEntry(t, tg.lv, tg.pool, entry)
		caches[i] = newTestCache(t, SSH(tg.lv), entry, tg.pool, func(cfg *Config) {
			cfg.Fanout = f
			cfg.TransferBudget = 2 * time.Minute
			if i == 1 && mod2 != nil {
				mod2(cfg)
			}
		})
	}
	b, err := caches[0].Ensure(ctxT(t, 2*time.Minute), image)
	if err != nil || b.Source != imagecache.SourceMirror {
		t.Fatalf("host 1: %+v, %v; want a download from the mirror", b, err)
	}
	return env, caches, targets, image, img, srv
}

// Host 2 copies host 1's published base: no request to the mirror, source
// peer, and host 2's base reads back (Verify, over its own connection) as
// the image's digest, with exactly its base and marker in its pool.
func TestIntegrationPeer(t *testing.T) {
	env, caches, _, image, img, srv := peerPair(t, nil, nil)
	start := time.Now()
	b, err := caches[1].Ensure(ctxT(t, 2*time.Minute), image)
	took := time.Since(start)
	if err != nil || b.Source != imagecache.SourcePeer {
		t.Fatalf("host 2: %+v, %v; want a copy from host 1", b, err)
	}
	t.Logf("host 2 copied %d bytes from host 1 in %v", img.size, took.Round(time.Millisecond))
	if n := srv.requests.Load(); n != 1 {
		t.Fatalf("the mirror served %d requests, want 1 (host 1's)", n)
	}
	wantLabPublished(t, env.Hosts[1], caches[1], image, img.sha256)
	wantLabPublished(t, env.Hosts[0], caches[0], image, img.sha256)
}

// Host 1's link is pulled 16 MiB into host 2's copy of its base, and is
// back 4 s later. Host 2's download switches to the mirror within the same
// Ensure, from where it was (host 1's dedicated connection is declared
// dead by its keepalives, 0.5 s x 3; source peer+mirror), and publishes
// the image's digest; the mirror served 2 requests in all (host 1's, the
// rest of host 2's); host 2 holds only its base and marker, and host 1's
// base is intact once its link is back.
func TestIntegrationPeerLinkCut(t *testing.T) {
	const down = 4 * time.Second
	var cutTime atomic.Pointer[time.Time]
	upAgain := make(chan struct{})
	var once sync.Once
	var env lab.Env
	env, caches, _, image, img, srv := peerPair(t, func(c *sshconn.Config) {
		c.KeepaliveInterval = 500 * time.Millisecond
		c.KeepaliveCount = 3
		c.DialTimeout = 2 * time.Second
	}, func(cfg *Config) {
		cfg.ProgressInterval = time.Millisecond
		cfg.Progress = cutAfter(16<<20, func(imagecache.Progress) {
			once.Do(func() {
				n := strconv.Itoa(env.Hosts[0].N)
				if err := labScript(env, "link", n, "down"); err != nil {
					t.Error(err)
					close(upAgain)
					return
				}
				now := time.Now()
				cutTime.Store(&now)
				go func() {
					defer close(upAgain)
					time.Sleep(down)
					if err := labScript(env, "link", n, "up"); err != nil {
						t.Error(err)
					}
				}()
			})
		})
	})
	// Runs before the entries' cleanups (LIFO): host 1's link is up for them.
	t.Cleanup(func() { _ = labScript(env, "link", strconv.Itoa(env.Hosts[0].N), "up") })
	start := time.Now()
	b, err := caches[1].Ensure(ctxT(t, 2*time.Minute), image)
	took := time.Since(start)
	if cutTime.Load() == nil {
		t.Fatalf("host 1's link was never cut (host 2: %+v, %v)", b, err)
	}
	<-upAgain
	t.Logf("host 2: %v in all, %v after the cut, source %q, %v", took.Round(time.Millisecond), time.Since(*cutTime.Load()).Round(time.Millisecond), b.Source, err)
	if err != nil || b.Source != "peer+mirror" {
		t.Fatalf("host 2 beside a peer whose link was cut: %+v, %v; want a switch to the mirror (peer+mirror)", b, err)
	}
	if n := srv.requests.Load(); n != 2 {
		t.Fatalf("the mirror served %d requests, want 2 (host 1's, the rest of host 2's)", n)
	}
	wantLabPublished(t, env.Hosts[1], caches[1], image, img.sha256)
	wantLabPublished(t, env.Hosts[0], caches[0], image, img.sha256)
}

// Host 1's cache evicts its base 16 MiB into host 2's copy of it. Host 2
// publishes a base that reads back as the image's digest, whichever way
// libvirt took the eviction (a download keeps reading the file it opened,
// so the copy may complete; a copy that fails goes on from the mirror),
// with nothing else of its entry left; host 1 holds nothing of its entry
// when the eviction succeeded, its base and marker when it did not.
func TestIntegrationPeerEvictedMidCopy(t *testing.T) {
	var evictErr error
	var once sync.Once
	var c1 *Cache
	var image imagecache.Image
	env, caches, _, img1, img, srv := peerPair(t, nil, func(cfg *Config) {
		cfg.ProgressInterval = time.Millisecond
		cfg.Progress = cutAfter(16<<20, func(imagecache.Progress) {
			once.Do(func() { evictErr = c1.Evict(ctxT(t, time.Minute), image) })
		})
	})
	c1, image = caches[0], img1
	b, err := caches[1].Ensure(ctxT(t, 2*time.Minute), image)
	t.Logf("host 2: source %q, %v; host 1's eviction: %v; %d requests to the mirror", b.Source, err, evictErr, srv.requests.Load())
	if err != nil {
		t.Fatalf("host 2 beside a peer evicting its base: %v", err)
	}
	wantLabPublished(t, env.Hosts[1], caches[1], image, img.sha256)
	left := entryVolumes(t, env.Hosts[0], caches[0].cfg.Pool, caches[0].cfg.Entry)
	if evictErr == nil && len(left) > 0 {
		t.Fatalf("host 1 holds %q after its eviction succeeded", left)
	}
	if evictErr != nil {
		wantCode(t, evictErr, errs.Transient)
		wantLabPublished(t, env.Hosts[0], caches[0], image, img.sha256)
	}
}

// Two entries on the one stack host (its libvirtd, its pool): the second
// going cold never reads the first's base over the network. A raw image
// is copied inside the host by libvirt (StorageVolCreateXMLFrom) — no
// request to the mirror, source peer — and its copy reads back as the
// image's digest (Verify, over the second entry's connection); a qcow2
// image, which libvirt would copy through qemu-img convert into other
// bytes, is downloaded (source mirror).
func TestIntegrationCopyInsideHost(t *testing.T) {
	env := teststack.Require(t)
	dir := t.TempDir()
	rawFile := filepath.Join(dir, "img.raw")
	if err := os.WriteFile(rawFile, append([]byte("RAW!"), randBytes(8<<20)...), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, format string
		file         imageFile
		want         string
	}{
		{"raw", imagecache.FormatRaw, hashFile(t, rawFile), imagecache.SourcePeer},
		{"qcow2", "", makeQcow2(t, dir, 8), imagecache.SourceMirror},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := newImageServer(t, serveFile(tc.file))
			image := imagecache.Image{Key: "inhost", URL: srv.URL + "/img", SHA256: tc.file.sha256, Format: tc.format}
			f := NewFanout(FanoutOptions{})
			var caches [2]*Cache
			var lvs [2]*libvirtconn.Session
			for i := range caches {
				lvs[i] = link(t, env)
				entry := testEntry()
				cleanupEntry(t, lvs[i], env.Pool, entry)
				caches[i] = newTestCache(t, SSH(lvs[i]), entry, env.Pool, func(cfg *Config) { cfg.Fanout = f })
			}
			if b, err := caches[0].Ensure(ctxT(t, time.Minute), image); err != nil || b.Source != imagecache.SourceMirror {
				t.Fatalf("first entry: %+v, %v", b, err)
			}
			b, err := caches[1].Ensure(ctxT(t, time.Minute), image)
			if err != nil || b.Source != tc.want {
				t.Fatalf("second entry: %+v, %v; want source %s", b, err, tc.want)
			}
			want := int64(2)
			if tc.want == imagecache.SourcePeer {
				want = 1
			}
			if n := srv.requests.Load(); n != want {
				t.Fatalf("the mirror served %d requests, want %d", n, want)
			}
			name := caches[1].BaseName(image)
			if got := slices.Sorted(slices.Values(ours(t, lvs[1], env.Pool, caches[1].cfg.Entry))); !slices.Equal(got, []string{name, MarkerName(name, tc.file.sha256)}) {
				t.Fatalf("second entry holds %q", got)
			}
			if v, err := caches[1].Verify(ctxT(t, time.Minute), image); err != nil || v.Digest != tc.file.sha256 {
				t.Fatalf("second entry: Verify = %+v, %v", v, err)
			}
		})
	}
}
