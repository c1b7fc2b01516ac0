//go:build integration

package basecache

import (
	"crypto/sha256"
	"encoding/hex"
	"io"
	"log"
	mrand "math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
)

// What a server sends is checked before it is published, on the real
// stack: an HTML page served with 200 for a qcow2 (no sha256 configured)
// is refused as Permanent, naming the image, the format and the first
// bytes, and leaves nothing in the pool; so are a server whose certificate
// is not trusted and a redirect loop. A raw image may hold any bytes.
func TestStackContentChecked(t *testing.T) {
	env, lv, _ := stackEntry(t)
	random := make([]byte, 3<<20+17)
	_, _ = io.ReadFull(mrand.NewChaCha8([32]byte{3}), random)
	sum := sha256.Sum256(random)
	mux := http.NewServeMux()
	mux.HandleFunc("/html", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		_, _ = io.WriteString(w, "<!DOCTYPE html>\n<html><body>Please sign in"+strings.Repeat(" ", 1<<20)+"</body></html>\n")
	})
	mux.HandleFunc("/loop", func(w http.ResponseWriter, r *http.Request) { http.Redirect(w, r, "/loop?again=1", http.StatusFound) })
	mux.HandleFunc("/random", func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write(random) })
	srv := newImageServer(t, func(w http.ResponseWriter, r *http.Request, _ int64) { mux.ServeHTTP(w, r) })
	tlsSrv := httptest.NewUnstartedServer(mux)
	tlsSrv.Config.ErrorLog = log.New(io.Discard, "", 0)
	tlsSrv.StartTLS()
	t.Cleanup(tlsSrv.Close)

	for _, tt := range []struct {
		name string
		img  imagecache.Image
		want errs.ErrorCode
		msg  []string
	}{
		{"HTML page with 200 for a qcow2", imagecache.Image{Key: "html", URL: srv.URL + "/html"}, errs.Permanent, []string{`"html"`, "qcow2", "<!DOCTYPE html>", "text/html"}},
		{"random bytes for a qcow2", imagecache.Image{Key: "rnd", URL: srv.URL + "/random"}, errs.Permanent, []string{`"rnd"`, "qcow2"}},
		{"untrusted TLS certificate", imagecache.Image{Key: "tls", URL: tlsSrv.URL + "/random", Format: "raw"}, errs.Permanent, []string{"certificate"}},
		{"redirect loop", imagecache.Image{Key: "loop", URL: srv.URL + "/loop"}, errs.Permanent, []string{"redirect"}},
		{"raw declared: any bytes", imagecache.Image{Key: "raw", URL: srv.URL + "/random", Format: "raw"}, errs.OK, nil},
		{"raw declared: even an HTML page", imagecache.Image{Key: "rawhtml", URL: srv.URL + "/html", Format: "raw"}, errs.OK, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			entry := testEntry()
			cleanupEntry(t, lv, env.Pool, entry)
			c := newTestCache(t, SSH(lv), entry, env.Pool, nil)
			start := time.Now()
			b, err := c.Ensure(ctxT(t, time.Minute), tt.img)
			t.Logf("after %s: %v", time.Since(start).Round(time.Millisecond), err)
			wantCode(t, err, tt.want)
			for _, m := range tt.msg {
				if !strings.Contains(err.Error(), m) {
					t.Errorf("error %q does not mention %q", err, m)
				}
			}
			if err != nil {
				assertClean(t, lv, env.Pool, entry)
				return
			}
			if tt.img.Key == "raw" && (b.Digest != hex.EncodeToString(sum[:]) || b.Format != "raw") {
				t.Errorf("Base %+v, want raw with sha256 %x", b, sum)
			}
			if left := ours(t, lv, env.Pool, entry); len(left) != 2 {
				t.Errorf("volumes after publish: %v", left)
			}
		})
	}
}
