//go:build integration

package basecache

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
)

// An image server as operators use them: HTTP basic auth from the URL's
// userinfo plus a token in the query, and a redirect to a presigned URL.
// Failed and successful fetches on the real stack print none of the
// secrets: not in an error, not in any log line of any verbosity, not in
// any span (name, attributes, events, status). And the secrets are still
// sent: redaction changes only what is printed.
func TestStackSecretsNeverPrinted(t *testing.T) {
	env, lv, entry := stackEntry(t)
	img := makeQcow2(t, t.TempDir(), 4)
	const user, pass, tok, sig = "op", "pAsSw0rd-S3cret", "t0ken-S3cret", "s1gnature-S3cret"
	var authorized atomic.Int64
	mux := http.NewServeMux()
	authOK := func(r *http.Request) bool {
		u, p, ok := r.BasicAuth()
		return ok && u == user && p == pass && r.URL.Query().Get("token") == tok
	}
	mux.HandleFunc("/img.qcow2", func(w http.ResponseWriter, r *http.Request) {
		if !authOK(r) {
			http.Error(w, "bad credentials", http.StatusForbidden)
			return
		}
		authorized.Add(1)
		http.ServeFile(w, r, img.path)
	})
	mux.HandleFunc("/half.qcow2", func(w http.ResponseWriter, r *http.Request) {
		if !authOK(r) {
			http.Error(w, "bad credentials", http.StatusForbidden)
			return
		}
		authorized.Add(1)
		serveHalfThen(img, func(http.ResponseWriter, *http.Request) { panic(http.ErrAbortHandler) })(w, r, 0)
	})
	mux.HandleFunc("/presign", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/signed.qcow2?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature="+sig, http.StatusFound)
	})
	mux.HandleFunc("/signed.qcow2", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("X-Amz-Signature") != sig {
			http.Error(w, "SignatureDoesNotMatch", http.StatusForbidden)
			return
		}
		f, err := os.Open(img.path)
		if err != nil {
			panic(err)
		}
		defer f.Close()
		w.Header().Set("Content-Length", strconv.FormatInt(img.size, 10))
		_, _ = io.Copy(w, f)
	})
	srv := newImageServer(t, func(w http.ResponseWriter, r *http.Request, _ int64) { mux.ServeHTTP(w, r) })
	withCreds := func(path, token string) string {
		return strings.Replace(srv.URL, "http://", "http://"+user+":"+pass+"@", 1) + path + "?v=1&token=" + token
	}

	sink, log, tp := newTextSink(t)
	c := newTestCache(t, SSH(lv), entry, env.Pool, func(cfg *Config) {
		cfg.Logger, cfg.TracerProvider = log, tp
		cfg.ProgressInterval = time.Millisecond // every progress line too
	})
	for _, tt := range []struct {
		name string
		img  imagecache.Image
		want errs.ErrorCode
	}{
		{"body fails mid-upload", imagecache.Image{Key: "half", URL: withCreds("/half.qcow2", tok)}, errs.Transient},
		{"wrong token", imagecache.Image{Key: "wrong", URL: withCreds("/img.qcow2", tok+"-old")}, errs.Permanent},
		{"digest mismatch", imagecache.Image{Key: "sha", URL: withCreds("/img.qcow2", tok), SHA256: strings.Repeat("0", 64)}, errs.Permanent},
		{"success", imagecache.Image{Key: "ok", URL: withCreds("/img.qcow2", tok), SHA256: img.sha256}, errs.OK},
		{"success via a presigned redirect", imagecache.Image{Key: "presigned", URL: withCreds("/presign", tok)}, errs.OK},
	} {
		t.Run(tt.name, func(t *testing.T) {
			b, err := c.Ensure(ctxT(t, time.Minute), tt.img)
			wantCode(t, err, tt.want)
			if err != nil {
				sink.add("Ensure error: " + err.Error())
				sink.add(fmt.Sprintf("Ensure error %%+v: %+v", err))
				t.Logf("%v", err)
			} else if b.Digest != img.sha256 {
				t.Fatalf("Base %+v, want digest %s", b, img.sha256)
			}
			sink.add(fmt.Sprintf("image printed: %v %+v %#v", tt.img, tt.img, tt.img))
		})
	}
	// A cache hit and the other calls print nothing secret either.
	if _, err := c.Ensure(ctxT(t, time.Minute), imagecache.Image{Key: "ok", URL: withCreds("/img.qcow2", tok)}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Verify(ctxT(t, time.Minute), imagecache.Image{Key: "ok", URL: withCreds("/img.qcow2", tok)}); err != nil {
		t.Fatal(err)
	}
	if err := c.Evict(ctxT(t, time.Minute), imagecache.Image{Key: "presigned", URL: withCreds("/presign", tok)}); err != nil {
		t.Fatal(err)
	}
	if n := authorized.Load(); n != 3 {
		t.Errorf("the server saw the credentials %d times, want 3 (half, sha, ok): redaction must not change the request", n)
	}
	texts := sink.texts()
	if len(texts) < 20 {
		t.Fatalf("only %d texts captured; the sink is not wired", len(texts))
	}
	var spans int
	for _, s := range texts {
		if strings.HasPrefix(s, "span ") {
			spans++
		}
	}
	if bad := sink.leaks(pass, tok, sig); len(bad) > 0 {
		t.Errorf("a secret is printed in %d of %d texts:\n%s", len(bad), len(texts), strings.Join(bad, "\n"))
	}
	// What is printed still says where the image comes from.
	var named bool
	for _, s := range texts {
		named = named || strings.Contains(s, "REDACTED@127.0.0.1")
	}
	if !named {
		t.Error("no text names the image server's host")
	}
	t.Logf("%d texts checked (%d spans)", len(texts), spans)
}
