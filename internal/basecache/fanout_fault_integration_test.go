//go:build integration

package basecache

import (
	"context"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/digitalocean/go-libvirt"
	"libvirt.org/go/libvirtxml"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/libvirtconn"
	"github.com/egressproxy/egressproxy/internal/testing/lab"
	"github.com/egressproxy/egressproxy/sshconn"
)

// Fan-out faults on the lab (onstack --lab 2): one host's link cut or disk
// full mid-stream, and two processes' fan-outs racing for the same bases.

// labScript runs scripts/lab with args (link N down|up, exec N CMD...).
func labScript(env lab.Env, args ...string) error {
	cmd := exec.Command(env.Script, args...)
	cmd.Env = append(os.Environ(), lab.VarDir+"="+env.Dir)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s %s: %v: %s", env.Script, strings.Join(args, " "), err, out)
	}
	return nil
}

// labTarget connects to lab host h with cfg's SSH settings (mod may change
// them), closed when the test ends.
func labTarget(t *testing.T, h lab.Host, mod func(*sshconn.Config)) fanTarget {
	t.Helper()
	cfg := sshconn.Config{Address: h.SSHAddr, User: h.SSHUser, KeyFile: h.SSHKey, KnownHostsFile: h.KnownHosts}
	if mod != nil {
		mod(&cfg)
	}
	p, err := sshconn.New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	lv := libvirtconn.New(p, libvirtconn.Config{Socket: h.LibvirtSocket, URI: h.LibvirtURI}, nil)
	t.Cleanup(func() {
		_ = lv.Close()
		_ = p.Close()
	})
	return fanTarget{h.Netns, lv, h.Pool}
}

// twoLabHosts returns the lab, which must have at least 2 hosts.
func twoLabHosts(t *testing.T) lab.Env {
	t.Helper()
	env := lab.Require(t)
	if len(env.Hosts) < 2 {
		t.Fatalf("the lab has %d hosts; this test needs 2 (onstack --lab 2)", len(env.Hosts))
	}
	return env
}

// entryVolumes is ours over a fresh connection (host h's PoolVolumes):
// what an operator finds on the host afterwards.
func entryVolumes(t *testing.T, h lab.Host, pool, entry string) []string {
	t.Helper()
	var names []string
	err := h.Libvirt(func(l *libvirt.Libvirt) error {
		p, err := l.StoragePoolLookupByName(pool)
		if err != nil {
			return err
		}
		_ = l.StoragePoolRefresh(p, 0)
		vols, _, err := l.StoragePoolListAllVolumes(p, 1, 0)
		for _, v := range vols {
			if strings.HasPrefix(v.Name, basePrefix+entry+sep) || strings.HasPrefix(v.Name, claimPrefix+entry+sep) {
				names = append(names, v.Name)
			}
		}
		return err
	})
	if err != nil {
		t.Fatalf("list pool %s on host %d: %v", pool, h.N, err)
	}
	slices.Sort(names)
	return names
}

// wantLabPublished checks that c's entry holds exactly img's base and its
// marker, and that the bytes stored on the host hash to want (Verify reads
// them back).
func wantLabPublished(t *testing.T, h lab.Host, c *Cache, image imagecache.Image, want string) {
	t.Helper()
	name := c.BaseName(image)
	if got, w := entryVolumes(t, h, c.cfg.Pool, c.cfg.Entry), []string{name, MarkerName(name, want)}; !slices.Equal(got, w) {
		t.Fatalf("host %d, %s holds %q, want %q", h.N, c.cfg.Entry, got, w)
	}
	if v, err := c.Verify(ctxT(t, time.Minute), image); err != nil || v.Digest != want {
		t.Fatalf("host %d, %s: Verify = %+v, %v; want digest %s", h.N, c.cfg.Entry, v, err, want)
	}
}

// fanResult is one cache's Ensure outcome and how long it took.
type fanResult struct {
	base Base
	err  error
	took time.Duration
	end  time.Time
}

// ensureTimed runs Ensure of image on every cache at once (each under its
// own ctx when ctxs is set) and times each.
func ensureTimed(t *testing.T, caches []*Cache, ctxs []context.Context, image imagecache.Image) []fanResult {
	out := make([]fanResult, len(caches))
	var wg sync.WaitGroup
	for i, c := range caches {
		ctx := ctxT(t, 2*time.Minute)
		if ctxs != nil {
			ctx = ctxs[i]
		}
		wg.Go(func() {
			start := time.Now()
			out[i].base, out[i].err = c.Ensure(ctx, image)
			out[i].end = time.Now()
			out[i].took = out[i].end.Sub(start)
		})
	}
	wg.Wait()
	return out
}

// cutAfter returns a Progress callback that runs cut once, from the
// upload's goroutine, when at least n bytes were sent.
func cutAfter(n int64, cut func(imagecache.Progress)) func(imagecache.Progress) {
	var once sync.Once
	return func(p imagecache.Progress) {
		if p.Bytes >= n {
			once.Do(func() { cut(p) })
		}
	}
}

// faultCaches returns a cache per target (a fresh entry each, its volumes
// deleted when the test ends), all with Fanout f; the second one's upload
// calls fault once, from its goroutine, when 16 MiB are through.
func faultCaches(t *testing.T, targets []fanTarget, f *Fanout, fault func(imagecache.Progress)) []*Cache {
	caches := make([]*Cache, len(targets))
	for i, tg := range targets {
		entry := testEntry()
		cleanupEntry(t, tg.lv, tg.pool, entry)
		caches[i] = newTestCache(t, SSH(tg.lv), entry, tg.pool, func(cfg *Config) {
			cfg.Fanout = f
			if i == 1 {
				cfg.ProgressInterval = time.Millisecond
				cfg.Progress = cutAfter(16<<20, fault)
			}
		})
	}
	return caches
}

// Host 2's link is pulled 16 MiB into a shared 64 MiB download and is back
// 4 s later. Host 1 publishes on the one GET (its wait on the stuck host
// is bounded by DetachAfter); host 2 fails Transient once its SSH session
// is declared dead (keepalives 0.5 s x 3 here), and its cleanup, retried
// on fresh sessions for cleanupRetryFor, removes its volume and claim once
// the link is back: nothing of its entry is left. A retry on host 2
// publishes.
func TestIntegrationFanoutLinkCut(t *testing.T) {
	env := twoLabHosts(t)
	hosts := env.Hosts[:2]
	const down = 4 * time.Second
	targets := []fanTarget{
		labTarget(t, hosts[0], nil),
		labTarget(t, hosts[1], func(c *sshconn.Config) {
			c.KeepaliveInterval = 500 * time.Millisecond
			c.KeepaliveCount = 3
			c.DialTimeout = 2 * time.Second
		}),
	}
	img := makeQcow2(t, t.TempDir(), 64)
	srv := newImageServer(t, serveFile(img))
	f := NewFanout(FanoutOptions{})
	image := imagecache.Image{Key: "fan", URL: srv.URL + "/img.qcow2", SHA256: img.sha256}
	n := strconv.Itoa(hosts[1].N)
	var cutAt atomic.Int64
	var cutTime atomic.Pointer[time.Time]
	upAgain := make(chan struct{})
	caches := faultCaches(t, targets, f, func(p imagecache.Progress) {
		if err := labScript(env, "link", n, "down"); err != nil {
			t.Error(err)
			close(upAgain)
			return
		}
		now := time.Now()
		cutTime.Store(&now)
		cutAt.Store(p.Bytes)
		go func() {
			defer close(upAgain)
			time.Sleep(down)
			if err := labScript(env, "link", n, "up"); err != nil {
				t.Error(err)
			}
		}()
	})
	// Runs before the entries' cleanups (LIFO): the link is up for them.
	t.Cleanup(func() { _ = labScript(env, "link", n, "up") })
	res := ensureTimed(t, caches, nil, image)
	// The cut ran, if at all, before host 2's upload (and Ensure) ended.
	if cutTime.Load() == nil {
		t.Fatalf("the link was never cut (host 2: %+v, %v)", res[1].base, res[1].err)
	}
	<-upAgain
	afterCut := res[1].end.Sub(*cutTime.Load())
	t.Logf("host 2's link cut after %d of %d bytes, for %v", cutAt.Load(), img.size, down)
	t.Logf("host 1: %v, %+v, %v", res[0].took.Round(time.Millisecond), res[0].base, res[0].err)
	t.Logf("host 2: %v (%v after the cut), %v", res[1].took.Round(time.Millisecond), afterCut.Round(time.Millisecond), res[1].err)
	if res[0].err != nil || res[0].base.Digest != img.sha256 {
		t.Fatalf("host 1 beside the cut: %+v, %v", res[0].base, res[0].err)
	}
	wantCode(t, res[1].err, errs.Transient)
	// Its fetch fails once its session is declared dead; Ensure returns
	// when the cleanup got through (after the link is back) or gave up
	// (cleanupRetryFor), plus one dial.
	if bound := down + cleanupRetryFor + 10*time.Second; afterCut > bound {
		t.Fatalf("host 2 failed %v after the cut, want < %v", afterCut, bound)
	}
	if left := entryVolumes(t, hosts[1], targets[1].pool, caches[1].cfg.Entry); len(left) > 0 {
		t.Fatalf("host 2 holds %q after its link is back", left)
	}
	if n := srv.requests.Load(); n != 1 {
		t.Fatalf("the mirror served %d requests, want 1", n)
	}
	wantLabPublished(t, hosts[0], caches[0], image, img.sha256)
	b, err := caches[1].Ensure(ctxT(t, 2*time.Minute), image)
	if err != nil || b.Digest != img.sha256 {
		t.Fatalf("host 2's retry: %+v, %v", b, err)
	}
	wantLabPublished(t, hosts[1], caches[1], image, img.sha256)
}

// labTmpfsPool mounts a tmpfs of size inside lab host h (scripts/lab exec)
// and starts a transient dir pool on it; both go when the test ends.
func labTmpfsPool(t *testing.T, env lab.Env, h lab.Host, size string) (name, dir string) {
	t.Helper()
	n := strconv.Itoa(h.N)
	// A run killed by a timeout skips its cleanups: remove what it left.
	_ = h.Libvirt(func(l *libvirt.Libvirt) error {
		pools, _, err := l.ConnectListAllStoragePools(1, 0)
		for _, p := range pools {
			if strings.HasPrefix(p.Name, "ic-labtmpfs-") {
				_ = l.StoragePoolDestroy(p)
			}
		}
		return err
	})
	_ = labScript(env, "exec", n, "sh", "-c", `for d in "$1"/ic-labtmpfs-*; do [ -d "$d" ] && umount "$d"; rmdir "$d"; done 2>/dev/null; true`, "sh", h.StackDir)
	name = "ic-labtmpfs-" + hex.EncodeToString(randBytes(3))
	dir = filepath.Join(h.StackDir, name)
	if err := labScript(env, "exec", n, "sh", "-c", `mkdir -p "$1" && mount -t tmpfs -o size="$2" tmpfs "$1"`, "sh", dir, size); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := labScript(env, "exec", n, "sh", "-c", `umount "$1" && rmdir "$1"`, "sh", dir); err != nil {
			t.Error(err)
		}
	})
	x, err := (&libvirtxml.StoragePool{Type: "dir", Name: name, Target: &libvirtxml.StoragePoolTarget{Path: dir}}).Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Libvirt(func(l *libvirt.Libvirt) error { _, err := l.StoragePoolCreateXML(x, 0); return err }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		err := h.Libvirt(func(l *libvirt.Libvirt) error {
			p, err := l.StoragePoolLookupByName(name)
			if err != nil {
				return err
			}
			return l.StoragePoolDestroy(p)
		})
		if err != nil {
			t.Errorf("destroy pool %s on host %d: %v", name, h.N, err)
		}
	})
	return name, dir
}

// Host 2's pool is a small tmpfs: the 64 MiB image fits when the fetch
// starts (the up-front free-space check passes), then, 16 MiB into the
// shared stream, a filler takes the space so that the image overruns the
// disk by 8 MiB: libvirt fails host 2's stream (No space left on device),
// host 2 fails Transient with nothing of its entry left and the pool's
// space back; host 1 publishes; the mirror served one GET.
func TestIntegrationFanoutHostDiskFull(t *testing.T) {
	env := twoLabHosts(t)
	hosts := env.Hosts[:2]
	img := makeQcow2(t, t.TempDir(), 64)
	targets := []fanTarget{labTarget(t, hosts[0], nil), labTarget(t, hosts[1], nil)}
	pool, dir := labTmpfsPool(t, env, hosts[1], strconv.FormatInt((img.size+(16<<20))>>20, 10)+"m")
	targets[1].pool = pool
	free := poolFree(t, targets[1].lv, pool)
	t.Logf("host 2: tmpfs pool %s, %d bytes free, image %d bytes", pool, free, img.size)
	srv := newImageServer(t, serveFile(img))
	f := NewFanout(FanoutOptions{})
	image := imagecache.Image{Key: "fan", URL: srv.URL + "/img.qcow2", SHA256: img.sha256}
	filler := filepath.Join(dir, "filler")
	fill := int64(free) - img.size + 8<<20
	n := strconv.Itoa(hosts[1].N)
	var filled atomic.Bool
	caches := faultCaches(t, targets, f, func(imagecache.Progress) {
		if err := labScript(env, "exec", n, "fallocate", "-l", strconv.FormatInt(fill, 10), filler); err != nil {
			t.Error(err)
			return
		}
		filled.Store(true)
	})
	res := ensureTimed(t, caches, nil, image)
	t.Logf("host 1: %v, %+v, %v", res[0].took.Round(time.Millisecond), res[0].base, res[0].err)
	t.Logf("host 2: %v, %v", res[1].took.Round(time.Millisecond), res[1].err)
	if !filled.Load() {
		t.Fatalf("the disk was never filled (host 2: %+v, %v)", res[1].base, res[1].err)
	}
	if res[0].err != nil || res[0].base.Digest != img.sha256 {
		t.Fatalf("host 1 beside the full disk: %+v, %v", res[0].base, res[0].err)
	}
	wantCode(t, res[1].err, errs.Transient)
	if !strings.Contains(res[1].err.Error(), "No space left") {
		t.Errorf("host 2's error does not say No space left: %v", res[1].err)
	}
	if left := entryVolumes(t, hosts[1], pool, caches[1].cfg.Entry); len(left) > 0 {
		t.Fatalf("host 2 holds %q after the disk filled", left)
	}
	if n := srv.requests.Load(); n != 1 {
		t.Fatalf("the mirror served %d requests, want 1", n)
	}
	wantLabPublished(t, hosts[0], caches[0], image, img.sha256)
	if err := labScript(env, "exec", n, "rm", "-f", filler); err != nil {
		t.Fatal(err)
	}
	if got := poolFree(t, targets[1].lv, pool); got != free {
		t.Errorf("host 2's pool has %d bytes free after the failure, had %d", got, free)
	}
}

// Two processes (two Fanouts, each with its own caches and connections for
// the same two entries on the two hosts, as during a leader handover) fetch
// the same cold 64 MiB image at once, with no digest configured (whatever
// is read back is published: the case where a half-written base would be
// believed). The first process whose upload passes cutAt is closed
// mid-stream. Its claims keep the other process off the bases it was
// writing until its cleanup released them; then the survivor publishes on
// both hosts. Every published base hashes, as stored, to the image's
// digest, and each entry holds exactly one base and its marker.
func TestIntegrationFanoutHandoverRace(t *testing.T) {
	env := twoLabHosts(t)
	hosts := env.Hosts[:2]
	img := makeQcow2(t, t.TempDir(), 64)
	srv := newImageServer(t, serveFile(img))
	image := imagecache.Image{Key: "handover", URL: srv.URL + "/img.qcow2"}
	// 8 MiB: within the first 32 MiB segment; 56 MiB: while the second
	// one uploads and the first is read back. Not just past 32 MiB: a
	// session torn down while it connects (the read-back's connection is
	// opened once the first segment is uploaded) trips go-libvirt's known
	// data race in ConnectToURI under -race (docs/upstream.md).
	for _, cutAt := range []int64{8 << 20, 56 << 20} {
		t.Run(fmt.Sprintf("leader closed at %d MiB", cutAt>>20), func(t *testing.T) {
			gets := srv.requests.Load()
			entries := []string{testEntry(), testEntry()}
			var leaderOnce sync.Once
			leader := make(chan int, 1)
			procs := make([][]*Cache, 2)
			for p := range procs {
				f := NewFanout(FanoutOptions{})
				for i, h := range hosts {
					tg := labTarget(t, h, nil)
					if p == 0 {
						cleanupEntry(t, tg.lv, tg.pool, entries[i])
					}
					procs[p] = append(procs[p], newTestCache(t, SSH(tg.lv), entries[i], tg.pool, func(cfg *Config) {
						cfg.Fanout = f
						cfg.ClaimTimeout = 20 * time.Second
						cfg.ProgressInterval = time.Millisecond
						cfg.Progress = cutAfter(cutAt, func(imagecache.Progress) { leaderOnce.Do(func() { leader <- p }) })
					}))
				}
			}
			closer := make(chan int)
			go func() {
				p, ok := <-leader
				if !ok {
					close(closer)
					return
				}
				for _, c := range procs[p] {
					if err := c.Close(); err != nil {
						t.Errorf("Close: %v", err)
					}
				}
				closer <- p
				close(closer)
			}()
			var res [2][]fanResult
			var wg sync.WaitGroup
			for p := range procs {
				wg.Go(func() { res[p] = ensureTimed(t, procs[p], nil, image) })
			}
			wg.Wait()
			close(leader)
			p, ok := <-closer
			if !ok {
				t.Fatalf("no upload passed %d bytes: %+v", cutAt, res)
			}
			survivor := 1 - p
			for q := range procs {
				for i, r := range res[q] {
					t.Logf("process %d, host %d: %v, source %q, %v", q, hosts[i].N, r.took.Round(time.Millisecond), r.base.Source, r.err)
				}
			}
			t.Logf("process %d closed mid-stream; %d GETs in all", p, srv.requests.Load()-gets)
			for i, r := range res[p] {
				if r.err == nil && r.base.Digest != img.sha256 {
					t.Fatalf("the closed process got a base with digest %s on host %d, want %s", r.base.Digest, hosts[i].N, img.sha256)
				}
			}
			for i, r := range res[survivor] {
				if r.err != nil || r.base.Digest != img.sha256 {
					t.Fatalf("survivor on host %d: %+v, %v", hosts[i].N, r.base, r.err)
				}
				wantLabPublished(t, hosts[i], procs[survivor][i], image, img.sha256)
			}
		})
	}
}
