//go:build integration

package basecache

import (
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/testing/eventually"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// claimsOf lists the claim volumes of entry's bases in the pool.
func claimsOf(t *testing.T, names []string) []string {
	t.Helper()
	var out []string
	for _, n := range names {
		if strings.HasPrefix(n, claimPrefix) {
			out = append(out, n)
		}
	}
	return out
}

// serveSlowly serves the file in 64 KiB pieces spread over about d.
func serveSlowly(img imageFile, d time.Duration) func(http.ResponseWriter, *http.Request, int64) {
	return func(w http.ResponseWriter, r *http.Request, _ int64) {
		f, err := os.Open(img.path)
		if err != nil {
			panic(err)
		}
		defer f.Close()
		w.Header().Set("Content-Length", strconv.FormatInt(img.size, 10))
		w.WriteHeader(http.StatusOK)
		pieces := img.size/(64<<10) + 1
		pause := d / time.Duration(pieces)
		for {
			if _, err := io.CopyN(w, f, 64<<10); err != nil {
				return
			}
			w.(http.Flusher).Flush()
			select {
			case <-time.After(pause):
			case <-r.Context().Done():
				return
			}
		}
	}
}

// libvirtd dies in the middle of a fetch and stays down while the fetch
// cleans up: the fetch fails Transient, its cleanup is retried on a fresh
// connection (or its orphaned claim is recognised as this cache's own),
// and the very next Ensure after libvirtd is back fetches at once: the
// failed cleanup leaves no fresh-looking claim that would block every
// Ensure of the image for twice the transfer budget.
func TestStackRestartDuringFetchDoesNotBlock(t *testing.T) {
	env, lv, entry := stackEntry(t)
	img := makeQcow2(t, t.TempDir(), 8)
	release := make(chan struct{})
	var released bool
	t.Cleanup(func() {
		if !released {
			close(release)
		}
	})
	stuck := newImageServer(t, serveHalfThen(img, func(_ http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	good := newImageServer(t, serveFile(img))
	c := newTestCache(t, SSH(lv), entry, env.Pool, nil)
	im := imagecache.Image{Key: "r", URL: stuck.URL + "/r"}
	t0 := time.Now()
	errc := make(chan error, 1)
	go func() {
		_, err := c.Ensure(ctxT(t, 2*time.Minute), im)
		errc <- err
	}()
	eventually.True(t, time.Minute, func() bool { return stuck.requests.Load() > 0 }, "the GET arrives")
	// Wait until the upload is under way (the staged volume exists).
	eventually.True(t, 30*time.Second, func() bool { return contains(ours(t, lv, env.Pool, entry), c.BaseName(im)) }, "the staged volume exists")
	t.Logf("upload under way after %v", time.Since(t0))
	// libvirtd dies and stays down while the failed fetch cleans up.
	pid, err := strconv.Atoi(teststack.Run(t, "libvirtd-pid"))
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// It comes back 2 s later, while the failed fetch retries its cleanup.
	restartDone := make(chan struct{})
	time.AfterFunc(2*time.Second, func() {
		defer close(restartDone)
		teststack.Run(t, "libvirtd-restart")
	})
	t.Cleanup(func() { <-restartDone })
	close(release)
	released = true
	err = <-errc
	wantCode(t, err, errs.Transient)
	t.Logf("fetch across libvirtd's death failed after %v: %v", time.Since(t0), err)
	<-restartDone
	// The cleanup was retried on a fresh session: nothing of the fetch is left.
	if left := claimsOf(t, ours(t, lv, env.Pool, entry)); len(left) > 0 {
		t.Errorf("claims left after the failed fetch's cleanup: %v", left)
	}

	start := time.Now()
	b, err := c.Ensure(ctxT(t, time.Minute), imagecache.Image{Key: "r", URL: good.URL + "/r"})
	if err != nil {
		t.Fatalf("Ensure after the restart: %v", err)
	}
	t.Logf("next Ensure published %s in %v", b.Volume, time.Since(start))
}

// A claim this cache took but could not delete (its cleanup gave up) is
// recognised as its own orphan and reclaimed at once by the next Ensure,
// however fresh it looks; before, it blocked the image for twice the
// transfer budget.
func TestStackOwnOrphanClaimReclaimed(t *testing.T) {
	env, lv, entry := stackEntry(t)
	img := makeQcow2(t, t.TempDir(), 2)
	srv := newImageServer(t, serveFile(img))
	c := newTestCache(t, SSH(lv), entry, env.Pool, nil)
	im := imagecache.Image{Key: "o", URL: srv.URL + "/o"}
	orphan := claimName(c.BaseName(im), time.Now(), c.instance+randHex(claimBytes))
	putVol(t, lv, env.Pool, orphan, nil)
	start := time.Now()
	if _, err := c.Ensure(ctxT(t, 20*time.Second), im); err != nil {
		t.Fatalf("Ensure beside its own orphaned claim: %v", err)
	}
	t.Logf("reclaimed and published in %v", time.Since(start))
	if left := claimsOf(t, ours(t, lv, env.Pool, entry)); len(left) > 0 {
		t.Errorf("claims left: %v", left)
	}
}

// A claim of another cache (another process) that has not been refreshed
// for ClaimTimeout is taken over at once; a fresh one is waited for and
// never deleted.
func TestStackClaimTakeover(t *testing.T) {
	env, lv, entry := stackEntry(t)
	img := makeQcow2(t, t.TempDir(), 2)
	srv := newImageServer(t, serveFile(img))
	tok := strings.Repeat("c", 2*instanceBytes) + strings.Repeat("d", 2*claimBytes)
	for _, tc := range []struct {
		name  string
		age   time.Duration
		taken bool
	}{{"crashed writer (3m without refresh)", 3 * time.Minute, true}, {"live writer (refreshed now)", 0, false}} {
		t.Run(tc.name, func(t *testing.T) {
			c := newTestCache(t, SSH(lv), entry, env.Pool, func(cfg *Config) { cfg.TransferBudget = 30 * time.Minute })
			im := imagecache.Image{Key: "k" + randHex(2), URL: srv.URL + "/k"}
			claim := claimName(c.BaseName(im), time.Now().Add(-tc.age), tok)
			putVol(t, lv, env.Pool, claim, nil)
			budget := time.Minute
			if !tc.taken {
				budget = 3 * time.Second
			}
			start := time.Now()
			_, err := c.Ensure(ctxT(t, budget), im)
			names := ours(t, lv, env.Pool, entry)
			if tc.taken {
				if err != nil {
					t.Fatalf("Ensure beside a crashed writer's claim: %v", err)
				}
				t.Logf("took over in %v", time.Since(start))
				if contains(names, claim) {
					t.Errorf("the crashed writer's claim is still there")
				}
				return
			}
			wantCode(t, err, errs.DeadlineExceeded)
			if !contains(names, claim) {
				t.Errorf("a live writer's claim was deleted")
			}
		})
	}
}

// A fetch that takes longer than ClaimTimeout keeps its claim fresh: a
// second cache (another process) on the same entry waits for it instead of
// taking it over, and then uses the published base: one download in all.
func TestStackHeartbeatKeepsSlowFetch(t *testing.T) {
	env, lv, entry := stackEntry(t)
	img := makeQcow2(t, t.TempDir(), 4)
	srv := newImageServer(t, serveSlowly(img, 8*time.Second))
	short := func(cfg *Config) { cfg.ClaimTimeout = 2 * time.Second }
	a := newTestCache(t, SSH(lv), entry, env.Pool, short)
	b := newTestCache(t, SSH(link(t, env)), entry, env.Pool, short)
	im := imagecache.Image{Key: "h", URL: srv.URL + "/h"}
	errA := make(chan error, 1)
	go func() {
		_, err := a.Ensure(ctxT(t, 2*time.Minute), im)
		errA <- err
	}()
	eventually.True(t, time.Minute, func() bool { return srv.requests.Load() > 0 }, "A's download starts")
	got, err := b.Ensure(ctxT(t, 2*time.Minute), im)
	if err != nil {
		t.Fatalf("B: %v", err)
	}
	if err := <-errA; err != nil {
		t.Fatalf("A: %v", err)
	}
	if n := srv.requests.Load(); n != 1 {
		t.Errorf("%d downloads, want 1 (B took over a claim whose holder was alive)", n)
	}
	if got.Digest != img.sha256 {
		t.Errorf("B's base digest %s, want %s", got.Digest, img.sha256)
	}
}
