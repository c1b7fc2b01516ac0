//go:build integration

package basecache

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
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
	"github.com/egressproxy/egressproxy/internal/obs"
	"github.com/egressproxy/egressproxy/internal/testing/metrictest"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
	"github.com/egressproxy/egressproxy/sshconn"
	"github.com/go-logr/logr/testr"
	"github.com/google/go-cmp/cmp"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"libvirt.org/go/libvirtxml"
)

// ---------- stack plumbing ----------

// link opens a fresh sshconn pool + libvirt session to the stack (each call
// is a separate SSH connection, as another process would have).
func link(t *testing.T, env teststack.Env) *libvirtconn.Session {
	t.Helper()
	p, err := sshconn.New(sshconn.Config{Address: env.SSHAddr, User: env.SSHUser, KeyFile: env.SSHKey, KnownHostsFile: env.KnownHosts}, nil)
	if err != nil {
		t.Fatal(err)
	}
	lv := libvirtconn.New(p, libvirtconn.Config{Socket: env.LibvirtSocket, URI: env.LibvirtURI}, nil)
	t.Cleanup(func() {
		_ = lv.Close()
		_ = p.Close()
	})
	return lv
}

// stackEntry links to the stack and returns a fresh entry whose volumes
// are deleted when the test ends.
func stackEntry(t *testing.T) (teststack.Env, *libvirtconn.Session, string) {
	t.Helper()
	env := teststack.Require(t)
	lv := link(t, env)
	entry := testEntry()
	cleanupEntry(t, lv, env.Pool, entry)
	return env, lv, entry
}

func testEntry() string { return "t" + hex.EncodeToString(randBytes(4)) }

func randBytes(n int) []byte {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return b
}

func newTestCache(t *testing.T, lv Conn, entry, pool string, mod func(*Config)) *Cache {
	t.Helper()
	cfg := Config{Entry: entry, Pool: pool, TransferBudget: time.Minute, HTTPGrace: 10 * time.Second, Logger: testr.NewWithOptions(t, testr.Options{Verbosity: 1})}
	if mod != nil {
		mod(&cfg)
	}
	c, err := New(lv, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return c
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// poolNames lists the pool's volume names.
func poolNames(t *testing.T, lv *libvirtconn.Session, pool string) []string {
	t.Helper()
	var names []string
	err := lv.Do(ctxT(t, 30*time.Second), onPool(pool, func(l *libvirt.Libvirt, p libvirt.StoragePool) error {
		// Best effort: libvirt refuses a refresh while an upload runs in
		// the pool, and volumes made through libvirt are listed anyway.
		_ = l.StoragePoolRefresh(p, 0)
		vols, _, err := l.StoragePoolListAllVolumes(p, 1, 0)
		for _, v := range vols {
			names = append(names, v.Name)
		}
		return err
	}))
	if err != nil {
		t.Fatal(err)
	}
	return names
}

// ours returns the volumes of entry (bases, markers, claims).
func ours(t *testing.T, lv *libvirtconn.Session, pool, entry string) []string {
	var out []string
	for _, n := range poolNames(t, lv, pool) {
		if strings.HasPrefix(n, basePrefix+entry+sep) || strings.HasPrefix(n, claimPrefix+entry+sep) {
			out = append(out, n)
		}
	}
	return out
}

// cleanupEntry deletes every volume of entry when the test ends.
func cleanupEntry(t *testing.T, lv *libvirtconn.Session, pool, entry string) {
	t.Cleanup(func() {
		for _, n := range ours(t, lv, pool, entry) {
			_ = delVol(lv, pool, n)
		}
	})
}

func delVol(lv *libvirtconn.Session, pool, name string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return lv.Do(ctx, onVol(pool, name, func(l *libvirt.Libvirt, v libvirt.StorageVol) error {
		return l.StorageVolDelete(v, 0)
	}))
}

// putVol creates a raw volume holding data.
func putVol(t *testing.T, lv *libvirtconn.Session, pool, name string, data []byte) {
	t.Helper()
	x, _ := volXML(name, 0)
	err := lv.Do(ctxT(t, 30*time.Second), onPool(pool, func(l *libvirt.Libvirt, p libvirt.StoragePool) error {
		v, err := l.StorageVolCreateXML(p, x, 0)
		if err != nil {
			return err
		}
		if len(data) == 0 {
			return nil
		}
		return l.StorageVolUpload(v, strings.NewReader(string(data)), 0, 0, 0)
	}))
	if err != nil {
		t.Fatal(err)
	}
}

func assertClean(t *testing.T, lv *libvirtconn.Session, pool, entry string) {
	t.Helper()
	if left := ours(t, lv, pool, entry); len(left) > 0 {
		t.Errorf("volumes left behind: %v", left)
	}
}

func wantCode(t *testing.T, err error, code errs.ErrorCode) {
	t.Helper()
	if got := errs.Code(err); got != code {
		t.Fatalf("error class = %v, want %v; err = %v", got, code, err)
	}
}

// ---------- images and the image server ----------

type imageFile struct {
	path   string
	size   int64
	sha256 string
}

// makeQcow2 builds a qcow2 whose clusters hold randomMiB MiB of random data
// (raw random file converted with qemu-img).
func makeQcow2(t testing.TB, dir string, randomMiB int) imageFile {
	t.Helper()
	raw := filepath.Join(dir, fmt.Sprintf("src-%d.raw", mrand.Int()))
	f, err := os.Create(raw)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.CopyN(f, rand.Reader, int64(randomMiB)<<20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	out := strings.TrimSuffix(raw, ".raw") + ".qcow2"
	if b, err := exec.Command("qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, out).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img convert: %v: %s", err, b)
	}
	os.Remove(raw)
	return hashFile(t, out)
}

func hashFile(t testing.TB, path string) imageFile {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		t.Fatal(err)
	}
	return imageFile{path: path, size: n, sha256: hex.EncodeToString(h.Sum(nil))}
}

// imageServer serves image files and, on demand, misbehaves.
type imageServer struct {
	*httptest.Server
	requests atomic.Int64
	mu       sync.Mutex
	handler  func(w http.ResponseWriter, r *http.Request, n int64)
	stop     chan struct{}
}

func newImageServer(t *testing.T, h func(w http.ResponseWriter, r *http.Request, n int64)) *imageServer {
	s := &imageServer{handler: h, stop: make(chan struct{})}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := s.requests.Add(1)
		s.mu.Lock()
		h := s.handler
		s.mu.Unlock()
		h(w, r, n)
	}))
	t.Cleanup(func() {
		close(s.stop)
		s.CloseClientConnections()
		s.Close()
	})
	return s
}

func serveFile(img imageFile) func(http.ResponseWriter, *http.Request, int64) {
	return func(w http.ResponseWriter, r *http.Request, _ int64) {
		http.ServeFile(w, r, img.path)
	}
}

// serveHalfThen writes the headers (Content-Length: full size) and half of
// the file, then runs then().
func serveHalfThen(img imageFile, then func(w http.ResponseWriter, r *http.Request)) func(http.ResponseWriter, *http.Request, int64) {
	return func(w http.ResponseWriter, r *http.Request, _ int64) {
		f, err := os.Open(img.path)
		if err != nil {
			panic(err)
		}
		defer f.Close()
		w.Header().Set("Content-Length", strconv.FormatInt(img.size, 10))
		w.WriteHeader(http.StatusOK)
		_, _ = io.CopyN(w, f, img.size/2)
		w.(http.Flusher).Flush()
		then(w, r)
	}
}

// serveChunked streams n bytes of pseudo-random data without a
// Content-Length.
func serveChunked(n int64) func(http.ResponseWriter, *http.Request, int64) {
	return func(w http.ResponseWriter, r *http.Request, _ int64) {
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		_, _ = io.CopyN(w, mrand.NewChaCha8([32]byte{1}), n)
	}
}

// truncatingTransport ends every response body cleanly (io.EOF, no error)
// after half of its Content-Length: a source that ends short.
type truncatingTransport struct{}

func (truncatingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := http.DefaultTransport.RoundTrip(r)
	if err != nil || resp.ContentLength <= 0 {
		return resp, err
	}
	resp.Body = struct {
		io.Reader
		io.Closer
	}{io.LimitReader(resp.Body, resp.ContentLength/2), resp.Body}
	return resp, nil
}

// recordingConn hands out dedicated connections and remembers the last one
// so a test can kill it mid-upload.
type recordingConn struct {
	*libvirtconn.Session
	mu   sync.Mutex
	last *libvirtconn.Dedicated
}

func (r *recordingConn) Do(ctx context.Context, fn func(Libvirt) error) error {
	return SSH(r.Session).Do(ctx, fn)
}

func (r *recordingConn) Dedicated(ctx context.Context) (Dedicated, error) {
	d, err := r.Session.Dedicated(ctx)
	r.mu.Lock()
	r.last = d
	r.mu.Unlock()
	if err != nil {
		return nil, err
	}
	return sshDedicated{d}, nil
}

// ---------- tests ----------

func TestStackColdFetchHitVerifyListEvict(t *testing.T) {
	env, lv, entry := stackEntry(t)
	img := makeQcow2(t, t.TempDir(), 8)
	srv := newImageServer(t, serveFile(img))
	var progress atomic.Int64
	var rate atomic.Uint64
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	c := newTestCache(t, SSH(lv), entry, env.Pool, func(cfg *Config) {
		cfg.ProgressInterval = time.Millisecond
		cfg.Progress = func(p imagecache.Progress) { progress.Store(p.Bytes); rate.Store(uint64(p.Rate)) }
		cfg.TracerProvider = tp
	})
	im := imagecache.Image{Key: "deb.12", URL: srv.URL + "/x.qcow2", SHA256: img.sha256}

	b, err := c.Ensure(ctxT(t, time.Minute), im)
	if err != nil {
		t.Fatal(err)
	}
	if b.Volume != "base-"+entry+"--deb.12.qcow2" || b.Digest != img.sha256 || b.Format != "qcow2" || !strings.HasSuffix(b.Path, "/"+b.Volume) {
		t.Fatalf("Base = %+v", b)
	}
	if got := hashFile(t, b.Path); got.sha256 != img.sha256 || got.size != img.size {
		t.Fatalf("stored file %+v, want %+v", got, img)
	}
	if progress.Load() != img.size || rate.Load() == 0 {
		t.Errorf("last progress %d bytes at %d B/s, want %d bytes", progress.Load(), rate.Load(), img.size)
	}
	spans := map[string]bool{}
	for _, s := range rec.Ended() {
		for _, a := range s.Attributes() {
			if a.Key == "egressproxy.volume" && a.Value.AsString() == b.Volume {
				spans[s.Name()] = true
			}
		}
	}
	for _, want := range []string{"imagecache.Ensure", "imagecache.Fetch", "imagecache.Upload", "imagecache.Verify"} {
		if !spans[want] {
			t.Errorf("no span %s with the volume attribute; got %v", want, spans)
		}
	}
	names := ours(t, lv, env.Pool, entry)
	if len(names) != 2 || !contains(names, MarkerName(b.Volume, img.sha256)) {
		t.Fatalf("volumes after publish: %v", names)
	}

	if b.Source != imagecache.SourceMirror {
		t.Fatalf("cold Ensure's source %q, want %q", b.Source, imagecache.SourceMirror)
	}
	// From now on a hit (source pool); List and Verify leave Source empty.
	hit := b
	hit.Source = imagecache.SourcePool
	b.Source = ""
	before := srv.requests.Load()
	b2, err := c.Ensure(ctxT(t, time.Minute), im)
	if err != nil || b2 != hit {
		t.Fatalf("second Ensure = %+v, %v", b2, err)
	}
	// Without a configured digest any well-formed marker is a hit too.
	b3, err := c.Ensure(ctxT(t, time.Minute), imagecache.Image{Key: im.Key, URL: im.URL})
	if err != nil || b3 != hit {
		t.Fatalf("Ensure without digest = %+v, %v", b3, err)
	}
	if n := srv.requests.Load() - before; n != 0 {
		t.Fatalf("cache hits made %d HTTP requests", n)
	}

	if vb, err := c.Verify(ctxT(t, time.Minute), im); err != nil || vb != b {
		t.Fatalf("Verify = %+v, %v", vb, err)
	}
	list, err := c.List(ctxT(t, time.Minute))
	if err != nil || len(list) != 1 || list[0].Base != b || list[0].Marker != MarkerName(b.Volume, b.Digest) || len(list[0].UsedBy) != 0 {
		t.Fatalf("List = %+v, %v", list, err)
	}
	if err := c.Evict(ctxT(t, time.Minute), im); err != nil {
		t.Fatal(err)
	}
	assertClean(t, lv, env.Pool, entry)
	if _, err := c.Verify(ctxT(t, time.Minute), im); errs.Code(err) != errs.NotFound {
		t.Fatalf("Verify after Evict: %v", err)
	}
}

// On the real stack, with a MeterProvider: a cold fetch from the mirror
// counts the image's bytes under source mirror and one fetch, and the
// entry holds one base of the image's size; a hit changes nothing; Evict
// counts one eviction and the base is gone; after Close the bases' gauges
// are absent.
func TestStackMetrics(t *testing.T) {
	env, lv, entry := stackEntry(t)
	img := makeQcow2(t, t.TempDir(), 2)
	srv := newImageServer(t, serveFile(img))
	rd := metrictest.New(t)
	c := newTestCache(t, SSH(lv), entry, env.Pool, func(cfg *Config) { cfg.MeterProvider = rd.MeterProvider() })
	im := imagecache.Image{Key: "deb.12", URL: srv.URL + "/x.qcow2", SHA256: img.sha256}
	values := func() map[string]string {
		out := map[string]string{}
		for _, s := range rd.Collect(t) {
			if s.Scope != meterName || s.Attrs["egressproxy.entry"] != entry {
				t.Errorf("%s: scope %q; want %q and the entry", s.Key(), s.Scope, meterName)
			}
			delete(s.Attrs, "egressproxy.entry")
			out[s.Key()] = s.Text()
		}
		return out
	}
	mirror := map[string]string{"egressproxy.image.source": "mirror"}
	size := strconv.FormatInt(img.size, 10)
	want := map[string]string{
		metrictest.Key(obs.MetricImageTransferSize, mirror):  size,
		metrictest.Key(obs.MetricImageFetchDuration, mirror): "count 1",
		metrictest.Key(obs.MetricImageBaseCount, nil):        "1",
		metrictest.Key(obs.MetricImageBaseUsage, nil):        size,
	}
	for _, when := range []string{"a cold fetch", "a hit"} {
		if _, err := c.Ensure(ctxT(t, time.Minute), im); err != nil {
			t.Fatal(err)
		}
		if d := cmp.Diff(want, values()); d != "" {
			t.Fatalf("after %s (-want +got):\n%s", when, d)
		}
	}
	if err := c.Evict(ctxT(t, time.Minute), im); err != nil {
		t.Fatal(err)
	}
	want[metrictest.Key(obs.MetricImageEvictions, nil)] = "1"
	want[metrictest.Key(obs.MetricImageBaseCount, nil)] = "0"
	want[metrictest.Key(obs.MetricImageBaseUsage, nil)] = "0"
	if d := cmp.Diff(want, values()); d != "" {
		t.Fatalf("after Evict (-want +got):\n%s", d)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	delete(want, metrictest.Key(obs.MetricImageBaseCount, nil))
	delete(want, metrictest.Key(obs.MetricImageBaseUsage, nil))
	if d := cmp.Diff(want, values()); d != "" {
		t.Fatalf("after Close (-want +got):\n%s", d)
	}
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

func TestStackSingleFlight(t *testing.T) {
	env, lv, entry := stackEntry(t)
	img := makeQcow2(t, t.TempDir(), 16)
	srv := newImageServer(t, serveFile(img))
	c := newTestCache(t, SSH(lv), entry, env.Pool, nil)
	im := imagecache.Image{Key: "k", URL: srv.URL + "/x", SHA256: img.sha256}
	const n = 8
	var wg sync.WaitGroup
	res := make([]Base, n)
	problems := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res[i], problems[i] = c.Ensure(ctxT(t, time.Minute), im)
		}()
	}
	wg.Wait()
	for i := range n {
		if problems[i] != nil || res[i] != res[0] || res[i].Digest != img.sha256 {
			t.Fatalf("Ensure %d = %+v, %v", i, res[i], problems[i])
		}
	}
	if got := srv.requests.Load(); got != 1 {
		t.Fatalf("%d concurrent Ensure made %d HTTP requests, want 1", n, got)
	}
}

// Each failure shape returns promptly with the right class and leaves no
// volume behind (goroutines: checked by TestMain's goleak).
func TestStackFailureShapes(t *testing.T) {
	env := teststack.Require(t)
	lv := link(t, env)
	img := makeQcow2(t, t.TempDir(), 24)
	other := makeQcow2(t, t.TempDir(), 1)

	for _, tt := range []struct {
		name    string
		handler func(http.ResponseWriter, *http.Request, int64)
		mod     func(*Config)
		sha     bool
		want    errs.ErrorCode
		msg     string
		within  time.Duration
	}{
		{name: "body error mid-stream", handler: serveHalfThen(img, func(http.ResponseWriter, *http.Request) { panic(http.ErrAbortHandler) }), want: errs.Transient, msg: "reading the image", within: 20 * time.Second},
		{name: "body ends short", handler: serveFile(img), mod: func(c *Config) { c.HTTPClient = &http.Client{Transport: truncatingTransport{}} }, want: errs.Transient, msg: "body ended after", within: 20 * time.Second},
		{name: "stalled mirror", handler: serveHalfThen(img, func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() }),
			mod: func(c *Config) {
				c.TransferBudget, c.HTTPGrace = 8*time.Second, 4*time.Second
			},
			want: errs.Transient, msg: "deadline", within: 7 * time.Second},
		{name: "pool too small for Content-Length", handler: func(w http.ResponseWriter, r *http.Request, _ int64) {
			w.Header().Set("Content-Length", strconv.FormatInt(1<<55, 10))
			w.WriteHeader(http.StatusOK)
			w.(http.Flusher).Flush()
			<-r.Context().Done()
		}, want: errs.Transient, msg: "bytes free", within: 20 * time.Second},
		{name: "different bytes than configured", handler: serveFile(other), sha: true, want: errs.Permanent, msg: img.sha256, within: 20 * time.Second},
		{name: "empty body", handler: func(w http.ResponseWriter, r *http.Request, _ int64) { w.WriteHeader(200) }, want: errs.Transient, msg: "empty body", within: 10 * time.Second},
		{name: "http 404", handler: func(w http.ResponseWriter, r *http.Request, _ int64) { http.NotFound(w, r) }, want: errs.Permanent, msg: "404", within: 10 * time.Second},
		{name: "http 503", handler: func(w http.ResponseWriter, r *http.Request, _ int64) { w.WriteHeader(503) }, want: errs.Transient, msg: "503", within: 10 * time.Second},
	} {
		t.Run(tt.name, func(t *testing.T) {
			entry := testEntry()
			cleanupEntry(t, lv, env.Pool, entry)
			srv := newImageServer(t, tt.handler)
			c := newTestCache(t, SSH(lv), entry, env.Pool, tt.mod)
			im := imagecache.Image{Key: "img", URL: srv.URL + "/i"}
			if tt.sha {
				im.SHA256 = img.sha256
			}
			start := time.Now()
			_, err := c.Ensure(ctxT(t, 2*time.Minute), im)
			el := time.Since(start)
			wantCode(t, err, tt.want)
			if !strings.Contains(err.Error(), tt.msg) {
				t.Errorf("error %q does not mention %q", err, tt.msg)
			}
			if el > tt.within {
				t.Errorf("returned after %s, want within %s", el, tt.within)
			}
			t.Logf("%s after %s: %v", tt.name, el.Round(time.Millisecond), err)
			assertClean(t, lv, env.Pool, entry)
		})
	}
}

// A mid-upload failure of the libvirt side: the SSH link of the transfer is
// killed, or the volume being filled is deleted underneath.
func TestStackUploadSabotage(t *testing.T) {
	env := teststack.Require(t)
	lv := link(t, env)
	img := makeQcow2(t, t.TempDir(), 64)
	for _, tt := range []struct {
		name     string
		sabotage func(t *testing.T, rc *recordingConn, base string)
	}{
		{"ssh link killed mid-upload", func(t *testing.T, rc *recordingConn, _ string) {
			rc.mu.Lock()
			defer rc.mu.Unlock()
			rc.last.Kill()
		}},
		{"staged volume deleted mid-upload", func(t *testing.T, rc *recordingConn, base string) {
			if err := delVol(lv, env.Pool, base); err != nil {
				t.Errorf("delete underneath: %v", err)
			}
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			entry := testEntry()
			cleanupEntry(t, lv, env.Pool, entry)
			// A slow source so the sabotage lands mid-upload.
			srv := newImageServer(t, func(w http.ResponseWriter, r *http.Request, _ int64) {
				f, _ := os.Open(img.path)
				defer f.Close()
				w.Header().Set("Content-Length", strconv.FormatInt(img.size, 10))
				for {
					if _, err := io.CopyN(w, f, 1<<20); err != nil {
						return
					}
					w.(http.Flusher).Flush()
					time.Sleep(5 * time.Millisecond)
				}
			})
			rc := &recordingConn{Session: link(t, env)}
			var once sync.Once
			im := imagecache.Image{Key: "img", URL: srv.URL + "/i"}
			base := BaseName(entry, im.Key, "qcow2")
			c := newTestCache(t, rc, entry, env.Pool, func(cfg *Config) {
				cfg.ProgressInterval = time.Millisecond
				cfg.Progress = func(p imagecache.Progress) {
					if p.Bytes > 8<<20 {
						once.Do(func() { tt.sabotage(t, rc, base) })
					}
				}
			})
			start := time.Now()
			_, err := c.Ensure(ctxT(t, 2*time.Minute), im)
			el := time.Since(start)
			wantCode(t, err, errs.Transient)
			if el > 30*time.Second {
				t.Errorf("returned after %s", el)
			}
			t.Logf("after %s: %v", el.Round(time.Millisecond), err)
			assertClean(t, lv, env.Pool, entry)
			// The cache still works afterwards.
			srv.mu.Lock()
			srv.handler = serveFile(img)
			srv.mu.Unlock()
			if b, err := c.Ensure(ctxT(t, 2*time.Minute), im); err != nil || b.Digest != img.sha256 {
				t.Fatalf("Ensure after sabotage = %+v, %v", b, err)
			}
		})
	}
}

// tmpfsPool mounts a small tmpfs under the stack dir and defines a
// transient dir pool on it; both are removed when the test ends.
func tmpfsPool(t *testing.T, env teststack.Env, lv *libvirtconn.Session, size string) (name, dir string) {
	t.Helper()
	// A run killed by a timeout skips its cleanups: remove what it left.
	_ = lv.Do(ctxT(t, 30*time.Second), func(l *libvirt.Libvirt) error {
		pools, _, err := l.ConnectListAllStoragePools(1, 0)
		for _, p := range pools {
			if strings.HasPrefix(p.Name, "ic-tmpfs-") {
				_ = l.StoragePoolDestroy(p)
			}
		}
		return err
	})
	if old, _ := filepath.Glob(filepath.Join(env.Dir, "ic-tmpfs-*")); len(old) > 0 {
		for _, d := range old {
			_ = exec.Command("umount", d).Run()
			_ = os.Remove(d)
		}
	}
	name = "ic-tmpfs-" + hex.EncodeToString(randBytes(3))
	dir = filepath.Join(env.Dir, name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if b, err := exec.Command("mount", "-t", "tmpfs", "-o", "size="+size, "tmpfs", dir).CombinedOutput(); err != nil {
		if teststack.InCI() {
			t.Fatalf("cannot mount tmpfs for the disk-full pool (required under CI=true): %v: %s", err, b)
		}
		t.Skipf("cannot mount tmpfs: %v: %s", err, b)
	}
	t.Cleanup(func() {
		if b, err := exec.Command("umount", dir).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v: %s", dir, err, b)
		}
		os.Remove(dir)
	})
	x, err := (&libvirtxml.StoragePool{Type: "dir", Name: name, Target: &libvirtxml.StoragePoolTarget{Path: dir}}).Marshal()
	if err != nil {
		t.Fatal(err)
	}
	err = lv.Do(ctxT(t, 30*time.Second), func(l *libvirt.Libvirt) error {
		_, err := l.StoragePoolCreateXML(x, 0)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		err := lv.Do(ctx, onPool(name, func(l *libvirt.Libvirt, p libvirt.StoragePool) error {
			return l.StoragePoolDestroy(p)
		}))
		if err != nil {
			t.Errorf("destroy pool %s: %v", name, err)
		}
	})
	return name, dir
}

func poolFree(t *testing.T, lv *libvirtconn.Session, pool string) uint64 {
	var avail uint64
	err := lv.Do(ctxT(t, 30*time.Second), onPool(pool, func(l *libvirt.Libvirt, p libvirt.StoragePool) error {
		if err := l.StoragePoolRefresh(p, 0); err != nil {
			return err
		}
		var err error
		_, _, _, avail, err = l.StoragePoolGetInfo(p)
		return err
	}))
	if err != nil {
		t.Fatal(err)
	}
	return avail
}

// The disk fills during the upload. Without a Content-Length the
// free-space check cannot refuse the image up front: an image far larger
// than the pool is cut by the source guard. Then another writer takes the
// space mid-upload, so libvirt itself runs out of disk, far past and only
// slightly past the end (where libvirt may report success for a short file:
// STACK.md); the drain/size/digest checks must catch every case.
func TestStackDiskFills(t *testing.T) {
	env := teststack.Require(t)
	lv := link(t, env)
	pool, dir := tmpfsPool(t, env, lv, "64m")
	free := poolFree(t, lv, pool)
	t.Logf("tmpfs pool %s: %d bytes free", pool, free)
	const size = 40 << 20
	for _, tt := range []struct {
		name    string
		size    int64
		overrun int64 // >0: a filler takes the space so that the image overruns by this much
		msg     string
	}{
		{"far larger than the pool, no Content-Length", int64(free) * 2, 0, "bytes free in pool"},
		{"disk taken mid-upload, overrun 16 MiB", size, 16 << 20, ""},
		{"disk taken mid-upload, overrun 3 MiB", size, 3 << 20, ""},
		{"disk taken mid-upload, overrun 256 KiB", size, 256 << 10, ""},
		{"disk taken mid-upload, overrun 64 KiB", size, 64 << 10, ""},
		{"disk taken mid-upload, overrun 4 KiB", size, 4 << 10, ""},
		{"disk taken mid-upload, overrun 1 byte", size, 1, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			entry := testEntry()
			srv := newImageServer(t, serveChunked(tt.size))
			filler := filepath.Join(dir, "filler-"+entry)
			t.Cleanup(func() { os.Remove(filler) })
			var once sync.Once
			c := newTestCache(t, SSH(lv), entry, pool, func(cfg *Config) {
				if tt.overrun == 0 {
					return
				}
				cfg.ProgressInterval = time.Millisecond
				cfg.Progress = func(p imagecache.Progress) {
					if p.Bytes < 8<<20 {
						return
					}
					once.Do(func() {
						if err := os.WriteFile(filler, make([]byte, int64(free)-tt.size+tt.overrun), 0o600); err != nil {
							t.Errorf("filler: %v", err)
						}
					})
				}
			})
			start := time.Now()
			_, err := c.Ensure(ctxT(t, 2*time.Minute), imagecache.Image{Key: "big", URL: srv.URL + "/b", Format: "raw"})
			el := time.Since(start)
			wantCode(t, err, errs.Transient)
			t.Logf("after %s: %v", el.Round(time.Millisecond), err)
			if !strings.Contains(err.Error(), tt.msg) {
				t.Errorf("error does not mention %q", tt.msg)
			}
			if el > 30*time.Second {
				t.Errorf("returned after %s", el)
			}
			assertClean(t, lv, pool, entry)
			os.Remove(filler)
			if got := poolFree(t, lv, pool); got != free {
				t.Errorf("pool free %d after the failure, was %d", got, free)
			}
		})
	}
}

// Cache states found on the real pool.
func TestStackCacheStates(t *testing.T) {
	env := teststack.Require(t)
	lv := link(t, env)
	img := makeQcow2(t, t.TempDir(), 4)
	srv := newImageServer(t, serveFile(img))
	dOther := strings.Repeat("e", 64)
	for _, tt := range []struct {
		name    string
		place   func(t *testing.T, base string)
		want    errs.ErrorCode
		fetches int64
		kept    func(base string) []string // volumes that must still exist
	}{
		{"base without marker", func(t *testing.T, base string) { putVol(t, lv, env.Pool, base, []byte("half-written")) }, errs.OK, 1, nil},
		{"marker not a digest", func(t *testing.T, base string) {
			putVol(t, lv, env.Pool, base, []byte("junk"))
			putVol(t, lv, env.Pool, base+".sha256-nothex", nil)
		}, errs.OK, 1, nil},
		{"stale claim of a crashed writer", func(t *testing.T, base string) {
			putVol(t, lv, env.Pool, base, []byte("partial"))
			putVol(t, lv, env.Pool, claimName(base, time.Now().Add(-3*time.Minute), "dead"), nil)
		}, errs.OK, 1, nil},
		{"live writer still filling: wait, never delete", func(t *testing.T, base string) {
			putVol(t, lv, env.Pool, base, []byte("being written"))
			putVol(t, lv, env.Pool, claimName(base, time.Now(), "11fe"), nil)
		}, errs.DeadlineExceeded, 0, func(base string) []string { return []string{base} }},
		{"marker digest differs from configured", func(t *testing.T, base string) {
			putVol(t, lv, env.Pool, base, []byte("old image"))
			putVol(t, lv, env.Pool, MarkerName(base, dOther), nil)
		}, errs.Permanent, 0, func(base string) []string { return []string{base, MarkerName(base, dOther)} }},
		{"hit placed by another cache", func(t *testing.T, base string) {
			putVol(t, lv, env.Pool, base, []byte("whatever"))
			putVol(t, lv, env.Pool, MarkerName(base, img.sha256), nil)
		}, errs.OK, 0, func(base string) []string { return []string{base, MarkerName(base, img.sha256)} }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			entry := testEntry()
			cleanupEntry(t, lv, env.Pool, entry)
			c := newTestCache(t, SSH(lv), entry, env.Pool, nil)
			im := imagecache.Image{Key: "s", URL: srv.URL + "/s", SHA256: img.sha256}
			base := c.BaseName(im)
			tt.place(t, base)
			before := srv.requests.Load()
			budget := time.Minute
			if tt.want == errs.DeadlineExceeded {
				budget = 3 * time.Second // waits for the live writer until the caller gives up
			}
			b, err := c.Ensure(ctxT(t, budget), im)
			wantCode(t, err, tt.want)
			if n := srv.requests.Load() - before; n != tt.fetches {
				t.Errorf("%d HTTP requests, want %d", n, tt.fetches)
			}
			names := ours(t, lv, env.Pool, entry)
			if err == nil {
				if b.Digest != img.sha256 || !contains(names, MarkerName(base, img.sha256)) || len(names) != 2 {
					t.Errorf("Base %+v, volumes %v", b, names)
				}
			} else if tt.want == errs.Permanent {
				t.Logf("error: %v", err)
				for _, s := range []string{dOther, img.sha256, "new key", "evict the base with EvictImage (egressproxyctl images evict)"} {
					if !strings.Contains(err.Error(), s) {
						t.Errorf("error does not mention %q", s)
					}
				}
			}
			if tt.kept != nil {
				for _, k := range tt.kept(base) {
					if !contains(names, k) {
						t.Errorf("%s was touched; volumes %v", k, names)
					}
				}
			}
		})
	}
}

// Two entries with the same key get two bases; an old-style base-<key>
// volume is never touched.
func TestStackEntriesDoNotShare(t *testing.T) {
	env := teststack.Require(t)
	lv := link(t, env)
	img := makeQcow2(t, t.TempDir(), 2)
	srv := newImageServer(t, serveFile(img))
	key := "shared-" + hex.EncodeToString(randBytes(3))
	old := "base-" + key + ".qcow2"
	putVol(t, lv, env.Pool, old, []byte("old provider's base"))
	t.Cleanup(func() { _ = delVol(lv, env.Pool, old) })
	e1, e2 := testEntry(), testEntry()
	cleanupEntry(t, lv, env.Pool, e1)
	cleanupEntry(t, lv, env.Pool, e2)
	im := imagecache.Image{Key: key, URL: srv.URL + "/x"}
	c1 := newTestCache(t, SSH(lv), e1, env.Pool, nil)
	c2 := newTestCache(t, SSH(lv), e2, env.Pool, nil)
	b1, err := c1.Ensure(ctxT(t, time.Minute), im)
	if err != nil {
		t.Fatal(err)
	}
	b2, err := c2.Ensure(ctxT(t, time.Minute), im)
	if err != nil {
		t.Fatal(err)
	}
	if b1.Volume == b2.Volume || b1.Path == b2.Path || b1.Digest != b2.Digest {
		t.Fatalf("bases %+v and %+v", b1, b2)
	}
	if err := c1.Evict(ctxT(t, time.Minute), im); err != nil {
		t.Fatal(err)
	}
	names := poolNames(t, lv, env.Pool)
	if !contains(names, old) || !contains(names, b2.Volume) || contains(names, b1.Volume) {
		t.Fatalf("after evicting %s: %v", b1.Volume, names)
	}
	var stored string
	_ = lv.Do(ctxT(t, 30*time.Second), onVol(env.Pool, old, func(l *libvirt.Libvirt, v libvirt.StorageVol) error {
		var sb strings.Builder
		err := l.StorageVolDownload(v, &sb, 0, 0, 0)
		stored = sb.String()
		return err
	}))
	if stored != "old provider's base" {
		t.Fatalf("old-style volume content changed: %q", stored)
	}
}

// Two caches on separate SSH connections (as two processes during a leader
// handover) race a cold fetch; the server even serves different bytes on
// each request. Exactly one base is published, both get it, and the host
// stores the digest its marker names.
func TestStackTwoProcessesRace(t *testing.T) {
	env := teststack.Require(t)
	a, b := makeQcow2(t, t.TempDir(), 32), makeQcow2(t, t.TempDir(), 32)
	for round := range 3 {
		t.Run(fmt.Sprint("round", round), func(t *testing.T) {
			lv1, lv2 := link(t, env), link(t, env)
			entry := testEntry()
			cleanupEntry(t, lv1, env.Pool, entry)
			srv := newImageServer(t, func(w http.ResponseWriter, r *http.Request, n int64) {
				if n%2 == 0 {
					serveFile(b)(w, r, n)
				} else {
					serveFile(a)(w, r, n)
				}
			})
			c1 := newTestCache(t, SSH(lv1), entry, env.Pool, nil)
			c2 := newTestCache(t, SSH(lv2), entry, env.Pool, nil)
			im := imagecache.Image{Key: "race", URL: srv.URL + "/r"}
			var wg sync.WaitGroup
			var r1, r2 Base
			var e1, e2 error
			wg.Add(2)
			go func() { defer wg.Done(); r1, e1 = c1.Ensure(ctxT(t, 2*time.Minute), im) }()
			go func() { defer wg.Done(); r2, e2 = c2.Ensure(ctxT(t, 2*time.Minute), im) }()
			wg.Wait()
			if e1 != nil || e2 != nil {
				t.Fatalf("Ensure errors: %v / %v", e1, e2)
			}
			r1.Source, r2.Source = "", "" // one fetched (mirror), the other found it (pool)
			if r1 != r2 || (r1.Digest != a.sha256 && r1.Digest != b.sha256) {
				t.Fatalf("bases differ or wrong digest: %+v vs %+v", r1, r2)
			}
			if got := hashFile(t, r1.Path); got.sha256 != r1.Digest {
				t.Fatalf("stored %s, marker %s", got.sha256, r1.Digest)
			}
			names := ours(t, lv1, env.Pool, entry)
			if len(names) != 2 {
				t.Fatalf("volumes after race: %v", names)
			}
			t.Logf("HTTP requests: %d", srv.requests.Load())
		})
	}
}

// Evict is refused while a defined (inactive) domain has a qcow2 overlay
// backed by the base.
func TestStackEvictRefusedWhileUsed(t *testing.T) {
	env, lv, entry := stackEntry(t)
	img := makeQcow2(t, t.TempDir(), 2)
	srv := newImageServer(t, serveFile(img))
	c := newTestCache(t, SSH(lv), entry, env.Pool, nil)
	im := imagecache.Image{Key: "ev", URL: srv.URL + "/e"}
	base, err := c.Ensure(ctxT(t, time.Minute), im)
	if err != nil {
		t.Fatal(err)
	}
	overlay := "ovl-" + entry + ".qcow2"
	dom := "ic-" + entry
	ox, _ := (&libvirtxml.StorageVolume{
		Name:         overlay,
		Capacity:     &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: 64 << 20},
		Target:       &libvirtxml.StorageVolumeTarget{Format: &libvirtxml.StorageVolumeTargetFormat{Type: "qcow2"}},
		BackingStore: &libvirtxml.StorageVolumeBackingStore{Path: base.Path, Format: &libvirtxml.StorageVolumeTargetFormat{Type: "qcow2"}},
	}).Marshal()
	var ovPath string
	err = lv.Do(ctxT(t, 30*time.Second), onPool(env.Pool, func(l *libvirt.Libvirt, p libvirt.StoragePool) error {
		v, err := l.StorageVolCreateXML(p, ox, 0)
		if err != nil {
			return err
		}
		ovPath, err = l.StorageVolGetPath(v)
		return err
	}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = delVol(lv, env.Pool, overlay) })
	undefine := defineWithDisk(t, lv, dom, ovPath, "qcow2")

	err = c.Evict(ctxT(t, time.Minute), im)
	wantCode(t, err, errs.Permanent)
	if !strings.Contains(err.Error(), dom) {
		t.Fatalf("error does not name the domain: %v", err)
	}
	list, lerr := c.List(ctxT(t, time.Minute))
	if lerr != nil || len(list) != 1 || len(list[0].UsedBy) != 1 || list[0].UsedBy[0] != dom {
		t.Fatalf("List = %+v, %v", list, lerr)
	}
	if names := ours(t, lv, env.Pool, entry); len(names) != 2 {
		t.Fatalf("refused Evict touched volumes: %v", names)
	}
	if err := undefine(); err != nil {
		t.Fatal(err)
	}
	if err := delVol(lv, env.Pool, overlay); err != nil {
		t.Fatal(err)
	}
	if err := c.Evict(ctxT(t, time.Minute), im); err != nil {
		t.Fatal(err)
	}
	assertClean(t, lv, env.Pool, entry)
}

// The 1 GiB cold fetch: bytes really transferred (a fully preallocated
// qcow2 plus written data), verified, published; the second Ensure makes no
// HTTP request. Run alone under /usr/bin/time -v for the peak RSS.
func TestStackOneGiB(t *testing.T) {
	env := teststack.Require(t)
	if testing.Short() {
		t.Skip("short")
	}
	lv := link(t, env)
	entry := testEntry()
	cleanupEntry(t, lv, env.Pool, entry)
	// IMAGECACHE_1GIB_IMAGE names a pre-built image, so that a peak-RSS
	// measurement of this test binary does not include the generator.
	path := os.Getenv("IMAGECACHE_1GIB_IMAGE")
	if path == "" {
		path = filepath.Join(t.TempDir(), "big.qcow2")
		makeBigQcow2(t, path)
	}
	img := hashFile(t, path)
	if img.size < 1<<30 {
		t.Fatalf("image is only %d bytes", img.size)
	}
	srv := newImageServer(t, serveFile(img))
	var uploadHWM string
	c := newTestCache(t, SSH(lv), entry, env.Pool, func(cfg *Config) {
		cfg.Logger = testr.NewWithOptions(t, testr.Options{Verbosity: 0})
		// 2 GiB through SSH (upload + read-back) took over a minute with
		// both cores busy (make stress): this test is about correctness
		// and memory, not speed.
		cfg.TransferBudget, cfg.HTTPGrace = 10*time.Minute, time.Minute
		cfg.Progress = func(p imagecache.Progress) {
			if p.Bytes == img.size {
				uploadHWM = procStatus("VmHWM")
			}
		}
	})
	im := imagecache.Image{Key: "big", URL: srv.URL + "/big.qcow2", SHA256: img.sha256}
	start := time.Now()
	b, err := c.Ensure(ctxT(t, 10*time.Minute), im)
	if err != nil {
		t.Fatal(err)
	}
	el := time.Since(start)
	t.Logf("1 GiB cold fetch (upload + read-back verify): %d bytes in %s, %.0f MB/s end to end", img.size, el.Round(time.Millisecond), float64(img.size)/el.Seconds()/1e6)
	if b.Digest != img.sha256 {
		t.Fatalf("digest %s", b.Digest)
	}
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	t.Logf("peak RSS at the end of the upload: %s; after verify+publish: %s (%s, %s); Go runtime Sys %d MiB, HeapSys %d MiB, HeapInuse %d MiB, total allocated %d MiB",
		uploadHWM, procStatus("VmHWM"), procStatus("RssAnon"), procStatus("RssFile"), ms.Sys>>20, ms.HeapSys>>20, ms.HeapInuse>>20, ms.TotalAlloc>>20)
	if got := hashFile(t, b.Path); got != (imageFile{path: b.Path, size: img.size, sha256: img.sha256}) {
		t.Fatalf("stored %+v", got)
	}
	n := srv.requests.Load()
	if _, err := c.Ensure(ctxT(t, time.Minute), im); err != nil {
		t.Fatal(err)
	}
	if srv.requests.Load() != n {
		t.Fatal("second Ensure made an HTTP request")
	}
}

var _ = errors.Is

// The checks behind "a nil from StorageVolUpload is not proof": a stored
// file shorter than what was sent, and stored bytes whose digest differs
// from the streamed one, are both refused.
func TestStackVerifyStoredCatchesShortAndWrongBytes(t *testing.T) {
	env, lv, entry := stackEntry(t)
	c := newTestCache(t, SSH(lv), entry, env.Pool, nil)
	name := BaseName(entry, "v", "raw")
	data := randBytes(1 << 20)
	putVol(t, lv, env.Pool, name, data)
	sum := sha256.Sum256(data)
	good := hex.EncodeToString(sum[:])
	if err := c.verifyStored(ctxT(t, time.Minute), name, int64(len(data)), good); err != nil {
		t.Fatalf("verify of intact bytes: %v", err)
	}
	for _, tt := range []struct {
		name   string
		n      int64
		digest string
		msg    string
	}{
		{"host file shorter than sent", int64(len(data)) + 4096, good, "holds 1048576 bytes on the host but 1052672 were sent"},
		{"stored digest differs from streamed", int64(len(data)), strings.Repeat("0", 64), "host stores 1048576 bytes with sha256 " + good},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := c.verifyStored(ctxT(t, time.Minute), name, tt.n, tt.digest)
			wantCode(t, err, errs.Transient)
			if !strings.Contains(err.Error(), tt.msg) {
				t.Fatalf("error %q does not say %q", err, tt.msg)
			}
		})
	}
}

// makeBigQcow2 builds a fully preallocated 1 GiB qcow2 and writes 512 MiB of
// patterned data into it (16 MiB per qemu-io write, to keep its buffer small).
func makeBigQcow2(t testing.TB, path string) {
	t.Helper()
	if b, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-o", "preallocation=full", path, "1G").CombinedOutput(); err != nil {
		t.Fatalf("qemu-img create: %v: %s", err, b)
	}
	args := []string{"-f", "qcow2"}
	for off := 0; off < 512; off += 16 {
		args = append(args, "-c", fmt.Sprintf("write -P 0x%02x %dM 16M", 0x10+off/16, off))
	}
	if b, err := exec.Command("qemu-io", append(args, path)...).CombinedOutput(); err != nil {
		t.Fatalf("qemu-io: %v: %s", err, b)
	}
}

// TestMakeBigImage writes the 1 GiB image to IMAGECACHE_MAKE_1GIB (for the
// RSS measurement); skipped otherwise.
func TestMakeBigImage(t *testing.T) {
	p := os.Getenv("IMAGECACHE_MAKE_1GIB")
	if p == "" {
		t.Skip("IMAGECACHE_MAKE_1GIB not set")
	}
	makeBigQcow2(t, p)
}

// The pinned go-libvirt returns promptly when the upload's source fails
// (older versions deadlocked on their unbuffered stream channels), the
// connection stays usable, and no goroutine is left (TestMain's goleak).
func TestStackGoLibvirtFailingReaderReturnsPromptly(t *testing.T) {
	env, lv, entry := stackEntry(t)
	name := BaseName(entry, "reader", "raw")
	putVol(t, lv, env.Pool, name, nil)
	dc, err := lv.Dedicated(ctxT(t, 30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer dc.Close()
	boom := errors.New("source failed")
	for i, after := range []int64{0, 1 << 20, 9 << 20} {
		src := io.MultiReader(io.LimitReader(mrand.NewChaCha8([32]byte{byte(i)}), after), iotest{boom})
		v, err := lookupVol(dc.L, env.Pool, name)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		done := make(chan error, 1)
		go func() { done <- dc.L.StorageVolUpload(v, src, 0, 0, 0) }()
		select {
		case err := <-done:
			if !errors.Is(err, boom) {
				t.Fatalf("upload failing after %d bytes returned %v, want the source error", after, err)
			}
			t.Logf("failing after %d bytes: returned in %s", after, time.Since(start).Round(time.Millisecond))
		case <-time.After(10 * time.Second):
			dc.Kill()
			t.Fatalf("upload with a failing source after %d bytes did not return within 10s", after)
		}
		if _, err := dc.L.ConnectGetLibVersion(); err != nil {
			t.Fatalf("connection unusable after the failed upload: %v", err)
		}
	}
}

type iotest struct{ err error }

func (r iotest) Read([]byte) (int, error) { return 0, r.err }

// Close during a fetch cancels it, waits for it, and leaves nothing behind.
func TestStackCloseDuringFetch(t *testing.T) {
	env, lv, entry := stackEntry(t)
	img := makeQcow2(t, t.TempDir(), 8)
	srv := newImageServer(t, serveHalfThen(img, func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() }))
	uploading := make(chan struct{})
	var once sync.Once
	c, err := New(SSH(lv), Config{Entry: entry, Pool: env.Pool, Logger: testr.New(t), ProgressInterval: time.Millisecond,
		Progress: func(p imagecache.Progress) {
			if p.Bytes > 0 {
				once.Do(func() { close(uploading) })
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := c.Ensure(context.Background(), imagecache.Image{Key: "c", URL: srv.URL + "/c"})
		done <- err
	}()
	// Close mid-body: bytes are being uploaded, and the mirror holds the
	// rest of the body back.
	select {
	case <-uploading:
	case <-time.After(30 * time.Second):
		t.Fatal("the fetch never started its upload")
	}
	start := time.Now()
	if err := c.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if el := time.Since(start); el > 10*time.Second {
		t.Fatalf("Close took %s", el)
	}
	select {
	case err := <-done:
		wantCode(t, err, errs.Transient)
		t.Logf("Ensure after Close: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("Ensure did not return after Close")
	}
	assertClean(t, lv, env.Pool, entry)
}

// procStatus returns one "Key: value" line of /proc/self/status.
func procStatus(key string) string {
	st, _ := os.ReadFile("/proc/self/status")
	for _, l := range strings.Split(string(st), "\n") {
		if strings.HasPrefix(l, key+":") {
			return strings.Join(strings.Fields(l), " ")
		}
	}
	return key + ": ?"
}

// BenchmarkStackTransfer compares, side by side on one link (the sub-
// benchmarks alternate under -count), a bare go-libvirt upload of a file
// with the cache's upload (count + sha256 + drain) and its read-back
// verification. Run: go test -tags integration -run XXX -bench Transfer
// -benchtime 5x ./internal/basecache (each op is one round: A, B, C)
func BenchmarkStackTransfer(b *testing.B) {
	env := teststack.Require(b)
	const size = 256 << 20
	path := filepath.Join(b.TempDir(), "bench.raw")
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := io.CopyN(f, mrand.NewChaCha8([32]byte{7}), size); err != nil {
		b.Fatal(err)
	}
	f.Close()
	p, err := sshconn.New(sshconn.Config{Address: env.SSHAddr, User: env.SSHUser, KeyFile: env.SSHKey, KnownHostsFile: env.KnownHosts}, nil)
	if err != nil {
		b.Fatal(err)
	}
	lv := libvirtconn.New(p, libvirtconn.Config{Socket: env.LibvirtSocket, URI: env.LibvirtURI}, nil)
	defer p.Close()
	defer lv.Close()
	entry := testEntry()
	c, err := New(SSH(lv), Config{Entry: entry, Pool: env.Pool})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	name := BaseName(entry, "bench", "raw")
	ctx := context.Background()
	defer func() { _ = c.deleteVolume(ctx, name) }()
	open := func(b *testing.B) *os.File {
		f, err := os.Open(path)
		if err != nil {
			b.Fatal(err)
		}
		return f
	}
	raw := func(b *testing.B) {
		f := open(b)
		defer f.Close()
		dc, err := lv.Dedicated(ctx)
		if err != nil {
			b.Fatal(err)
		}
		defer dc.Close()
		v, _ := lookupVol(dc.L, env.Pool, name)
		if err := dc.L.StorageVolUpload(v, f, 0, 0, 0); err != nil {
			b.Fatal(err)
		}
	}
	up := func(b *testing.B) {
		_, _, dc, err := c.upload(ctx, name, nil, nil, open(b), size, 0, newCommitted(), nil)
		if err != nil {
			b.Fatal(err)
		}
		_ = dc.Close()
	}
	back := func(b *testing.B) {
		if n, _, err := c.readBack(ctx, name); err != nil || n != size {
			b.Fatal(n, err)
		}
	}
	// Alternate A B C, A B C, ... and report the median rate of each.
	var rates [3][]float64
	b.ResetTimer()
	for range b.N {
		for i, fn := range []func(*testing.B){raw, up, back} {
			if i < 2 {
				b.StopTimer()
				_ = c.deleteVolume(ctx, name)
				if err := c.createEmpty(ctx, name); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			start := time.Now()
			fn(b)
			rates[i] = append(rates[i], size/time.Since(start).Seconds()/1e6)
		}
	}
	for i, unit := range []string{"go-libvirt-upload-MB/s", "imagecache-upload-MB/s", "imagecache-readback-MB/s"} {
		slices.Sort(rates[i])
		b.ReportMetric(rates[i][len(rates[i])/2], unit)
	}
	b.ReportMetric(0, "ns/op")
}

// onVol turns fn into a function of the connection that first looks up
// volume name of pool.
func onVol[L Libvirt](pool, name string, fn func(L, libvirt.StorageVol) error) func(L) error {
	return func(l L) error {
		v, err := lookupVol(l, pool, name)
		if err != nil {
			return err
		}
		return fn(l, v)
	}
}

// lookupVol looks up volume name of pool on l (for tests that drive a
// connection directly; the cache itself uses Cache.lookupVol).
func lookupVol(l Libvirt, pool, name string) (libvirt.StorageVol, error) {
	p, err := l.StoragePoolLookupByName(pool)
	if err != nil {
		return libvirt.StorageVol{}, err
	}
	return l.StorageVolLookupByName(p, name)
}

// onPool turns fn into a function of the connection that first looks up
// pool. L is Libvirt, or *libvirt.Libvirt where a test calls sshconn
// directly.
func onPool[L Libvirt](pool string, fn func(L, libvirt.StoragePool) error) func(L) error {
	return func(l L) error {
		p, err := l.StoragePoolLookupByName(pool)
		if err != nil {
			return err
		}
		return fn(l, p)
	}
}
