package basecache

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/sshconn"
	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

// deadlineRecorder is a transport that records the deadline of each
// request's context and fails the request (so fetch stops before libvirt).
type deadlineRecorder struct {
	mu        sync.Mutex
	deadlines []time.Time
}

var errRecorded = errors.New("recorded; no request sent")

func (d *deadlineRecorder) RoundTrip(r *http.Request) (*http.Response, error) {
	dl, ok := r.Context().Deadline()
	if !ok {
		dl = time.Time{}
	}
	d.mu.Lock()
	d.deadlines = append(d.deadlines, dl)
	d.mu.Unlock()
	return nil, errRecorded
}

// The HTTP deadline is the flight's own deadline (the TransferBudget
// counted from the start of the flight) minus HTTPGrace: time the flight
// spent before the GET (waiting for another writer's claim, removing
// debris) comes off the HTTP download, never off the grace. The flight is
// modelled by its context; no clock is read for the assertion.
func TestHTTPDeadlineIsFlightDeadlineMinusGrace(t *testing.T) {
	const budget, grace = 20 * time.Minute, time.Minute
	rec := &deadlineRecorder{}
	c, err := New(&fakeConn{}, Config{Entry: "e", Pool: "p", TransferBudget: budget, HTTPGrace: grace, HTTPClient: &http.Client{Transport: rec}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	for _, tt := range []struct {
		name string
		// left is what remains of the flight's budget when the GET starts.
		left time.Duration
	}{
		{"fresh flight", budget},
		{"after a 15 minute claim wait", budget - 15*time.Minute},
		{"grace and a little", grace + time.Second},
	} {
		t.Run(tt.name, func(t *testing.T) {
			flightDeadline := time.Now().Add(tt.left)
			ctx, cancel := context.WithDeadline(context.Background(), flightDeadline)
			defer cancel()
			rec.mu.Lock()
			rec.deadlines = nil
			rec.mu.Unlock()
			_, _, err := c.fetchOnce(ctx, okImage, c.BaseName(okImage), nil, sourcing{})
			if !errors.Is(err, errRecorded) {
				t.Fatalf("fetchOnce = %v, want the transport's error", err)
			}
			rec.mu.Lock()
			defer rec.mu.Unlock()
			if len(rec.deadlines) != 1 {
				t.Fatalf("%d requests", len(rec.deadlines))
			}
			if got, want := rec.deadlines[0], flightDeadline.Add(-grace); !got.Equal(want) {
				t.Fatalf("HTTP deadline is %s before the flight's, want %s (HTTPGrace)", flightDeadline.Sub(got), grace)
			}
		})
	}
	t.Run("less than the grace left", func(t *testing.T) {
		ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(grace/2))
		defer cancel()
		rec.mu.Lock()
		rec.deadlines = nil
		rec.mu.Unlock()
		_, _, err := c.fetchOnce(ctx, okImage, c.BaseName(okImage), nil, sourcing{})
		if errs.Code(err) != errs.Transient || !strings.Contains(err.Error(), "HTTPGrace") {
			t.Fatalf("fetchOnce = %v, want Transient naming HTTPGrace", err)
		}
		rec.mu.Lock()
		defer rec.mu.Unlock()
		if len(rec.deadlines) != 0 {
			t.Fatalf("a GET was sent with deadlines %v although the budget cannot hold it", rec.deadlines)
		}
	})
}

// textSink collects every log line (all verbosities), every error text and
// every recorded span's name, attributes, events and status, for a test to
// grep for secrets.
type textSink struct {
	mu    sync.Mutex
	lines []string
	rec   *tracetest.SpanRecorder
}

func newTextSink(t *testing.T) (*textSink, logr.Logger, trace.TracerProvider) {
	s := &textSink{rec: tracetest.NewSpanRecorder()}
	log := funcr.New(func(prefix, args string) {
		s.mu.Lock()
		s.lines = append(s.lines, prefix+" "+args)
		s.mu.Unlock()
	}, funcr.Options{Verbosity: 99})
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(s.rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return s, log, tp
}

func (s *textSink) add(text string) {
	s.mu.Lock()
	s.lines = append(s.lines, text)
	s.mu.Unlock()
}

// texts returns the log lines and errors added, then one text per span.
func (s *textSink) texts() []string {
	s.mu.Lock()
	out := slices.Clone(s.lines)
	s.mu.Unlock()
	for _, sp := range s.rec.Ended() {
		txt := "span " + sp.Name() + " status " + sp.Status().Description
		for _, a := range sp.Attributes() {
			txt += fmt.Sprintf(" %s=%s", a.Key, a.Value.String())
		}
		for _, ev := range sp.Events() {
			txt += " event " + ev.Name
			for _, a := range ev.Attributes {
				txt += fmt.Sprintf(" %s=%s", a.Key, a.Value.String())
			}
		}
		out = append(out, txt)
	}
	return out
}

// leaks returns the texts containing any of secrets.
func (s *textSink) leaks(secrets ...string) []string {
	var bad []string
	for _, txt := range s.texts() {
		for _, sec := range secrets {
			if strings.Contains(txt, sec) {
				bad = append(bad, txt)
				break
			}
		}
	}
	return bad
}

// GET failures (before libvirt is touched) print no secret of the URL:
// not the password, not a token in the query, not the signature of a
// presigned URL the server redirected to, in no error, log line or span.
func TestFetchGETFailuresHideSecrets(t *testing.T) {
	const pass, tok, sig = "pAsSw0rd-Secret1", "t0ken-Secret2", "s1gnature-Secret3"
	mux := http.NewServeMux()
	mux.HandleFunc("/404", func(w http.ResponseWriter, r *http.Request) { http.NotFound(w, r) })
	mux.HandleFunc("/presign", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/signed?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature="+sig, http.StatusFound)
	})
	mux.HandleFunc("/signed", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusForbidden) })
	mux.HandleFunc("/presign-loop", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/presign-loop?X-Amz-Signature="+sig, http.StatusFound)
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	closed := httptest.NewServer(mux)
	closed.Close() // connection refused: net/http's *url.Error carries the URL
	withCreds := func(base, path string) string {
		return strings.Replace(base, "http://", "http://op:"+pass+"@", 1) + path + "?v=1&token=" + tok
	}
	for _, tt := range []struct{ name, url string }{
		{"404", withCreds(srv.URL, "/404")},
		{"redirect to a presigned URL that is refused", withCreds(srv.URL, "/presign")},
		{"redirect loop", withCreds(srv.URL, "/presign-loop")},
		{"connection refused", withCreds(closed.URL, "/x")},
	} {
		t.Run(tt.name, func(t *testing.T) {
			sink, log, tp := newTextSink(t)
			c, err := New(&fakeConn{}, Config{Entry: "e", Pool: "p", Logger: log, TracerProvider: tp})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = c.Close() })
			img := imagecache.Image{Key: "k", URL: tt.url}
			_, err = c.fetch(context.Background(), img, c.BaseName(img), nil)
			if err == nil {
				t.Fatal("fetch succeeded")
			}
			sink.add("error: " + err.Error())
			sink.add(fmt.Sprintf("error %%+v: %+v", err))
			var ue *url.Error
			if errors.As(err, &ue) {
				sink.add("url.Error: " + ue.URL + " " + ue.Error())
			}
			if bad := sink.leaks(pass, tok, sig); len(bad) > 0 {
				t.Errorf("the secret is printed in:\n%s", strings.Join(bad, "\n"))
			}
			if !strings.Contains(err.Error(), "127.0.0.1") {
				t.Errorf("error %q does not name the host", err)
			}
			t.Logf("%v", err)
		})
	}
}

// Failures a retry cannot mend are Permanent, and an image whose first
// bytes are not of its format is refused before anything touches libvirt
// (fakeConn counts the calls; the bodies have no Content-Length, so no
// free-space query comes first): an untrusted certificate, a redirect
// loop, an HTML page served with 200 for a qcow2, random bytes for a
// qcow2, a body too short to be one. Raw accepts any bytes.
func TestGETAndContentChecks(t *testing.T) {
	mux := http.NewServeMux()
	chunked := func(h http.HandlerFunc) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusOK)
			w.(http.Flusher).Flush()
			h(w, r)
		}
	}
	mux.HandleFunc("/loop", func(w http.ResponseWriter, r *http.Request) { http.Redirect(w, r, "/loop", http.StatusFound) })
	mux.HandleFunc("/html", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		chunked(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.WriteString(w, "<!DOCTYPE html>\n<html><head><title>Sign in</title></head><body>\x00\xff"+strings.Repeat("x", 1<<20)+"</body></html>")
		})(w, r)
	})
	mux.HandleFunc("/short", chunked(func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "QF") }))
	mux.HandleFunc("/random", chunked(func(w http.ResponseWriter, r *http.Request) { _, _ = io.CopyN(w, mrand.NewChaCha8([32]byte{9}), 1<<20) }))
	mux.HandleFunc("/qcow2", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "QFI\xfb\x00\x00\x00\x03"+strings.Repeat("\x00", 1000))
	})
	plain := httptest.NewServer(mux)
	t.Cleanup(plain.Close)
	tlsSrv := httptest.NewUnstartedServer(mux)
	tlsSrv.Config.ErrorLog = log.New(io.Discard, "", 0) // the refused handshakes
	tlsSrv.StartTLS()
	t.Cleanup(tlsSrv.Close)
	_, port, _ := net.SplitHostPort(tlsSrv.Listener.Addr().String())

	for _, tt := range []struct {
		name   string
		url    string
		format string
		client *http.Client // nil: a default client
		want   errs.ErrorCode
		msg    []string
		// libvirt: whether the fetch may get as far as libvirt
		libvirt bool
	}{
		{name: "TLS certificate of an unknown authority", url: tlsSrv.URL + "/qcow2", want: errs.Permanent, msg: []string{"certificate"}},
		{name: "TLS certificate for another host name", url: "https://localhost:" + port + "/qcow2", client: tlsSrv.Client(), want: errs.Permanent, msg: []string{"certificate"}},
		{name: "redirect loop", url: plain.URL + "/loop", want: errs.Permanent, msg: []string{"redirect"}},
		{name: "HTML page for a qcow2", url: plain.URL + "/html", want: errs.Permanent, msg: []string{`image "k"`, "qcow2", `<!DOCTYPE html>\n<html>`, "text/html"}},
		{name: "random bytes for a qcow2", url: plain.URL + "/random", want: errs.Permanent, msg: []string{`image "k"`, "qcow2"}},
		{name: "two bytes for a qcow2", url: plain.URL + "/short", want: errs.Permanent, msg: []string{`image "k"`, "qcow2", `"QF"`}},
		{name: "qcow2 magic", url: plain.URL + "/qcow2", libvirt: true},
		{name: "HTML page declared raw", url: plain.URL + "/html", format: "raw", libvirt: true},
		{name: "random bytes declared raw", url: plain.URL + "/random", format: "raw", libvirt: true},
		{name: "TLS trusted", url: tlsSrv.URL + "/qcow2", client: tlsSrv.Client(), libvirt: true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := &fakeConn{err: errors.New("libvirt reached")}
			cfg := Config{Entry: "e", Pool: "p", HTTPClient: tt.client}
			c, err := New(f, cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = c.Close() })
			img := imagecache.Image{Key: "k", URL: tt.url, Format: tt.format}
			_, err = c.fetch(context.Background(), img, c.BaseName(img), nil)
			t.Logf("%v", err)
			if tt.libvirt {
				if f.calls.Load() == 0 || !strings.Contains(errString(err), "libvirt reached") {
					t.Fatalf("fetch = %v after %d libvirt calls; want it to pass the checks and reach libvirt", err, f.calls.Load())
				}
				return
			}
			if f.calls.Load() != 0 {
				t.Errorf("%d libvirt calls for a body that is refused", f.calls.Load())
			}
			wantCodeT(t, err, tt.want)
			for _, m := range tt.msg {
				if !strings.Contains(err.Error(), m) {
					t.Errorf("error %q does not mention %q", err, m)
				}
			}
			if !utf8.ValidString(err.Error()) || len(err.Error()) > 1000 {
				t.Errorf("error is not valid UTF-8 or too long (%d bytes)", len(err.Error()))
			}
		})
	}
}

func wantCodeT(t *testing.T, err error, code errs.ErrorCode) {
	t.Helper()
	if got := errs.Code(err); got != code {
		t.Fatalf("error class = %v, want %v; err = %v", got, code, err)
	}
}

// The cause of a failed upload is the side that failed first; a libvirt
// failure is never reported as a failure reading the image.
func TestUploadCause(t *testing.T) {
	body := errors.New("unexpected EOF")
	closed := errors.New("http: read on closed response body")
	lv := errors.New("procedure interrupted while awaiting response")
	drain := fmt.Errorf("waiting for libvirt to write 9 bytes: %w", libvirt.Error{Code: uint32(libvirt.ErrNoStorageVol), Message: "Storage volume not found"})
	for _, tt := range []struct {
		name    string
		f       meterFailure
		call    error
		want    string // "" : nil
		wantErr error  // must be in the chain
	}{
		{"success", meterFailure{}, nil, "", nil},
		{"body failed, the call returned its error", meterFailure{err: body, from: fromSource}, body, "reading the image after 9 bytes", body},
		{"body failed, the call returned nil", meterFailure{err: body, from: fromSource}, nil, "reading the image after 9 bytes", body},
		{"link killed, then the closed body failed a Read", meterFailure{err: closed, from: fromSource, late: true}, lv, "upload v after 9 bytes: procedure interrupted", lv},
		{"the drain's libvirt call failed", meterFailure{err: drain, from: fromLibvirt}, drain, "libvirt failed: waiting for libvirt", drain},
		{"the drain was stopped because the call failed", meterFailure{err: errDrainStopped, from: fromLibvirt, late: true}, lv, "upload v after 9 bytes: procedure interrupted", lv},
		{"more than the pool holds", meterFailure{err: errors.New("the image is larger than the 5 bytes free in pool p"), from: fromGuard}, nil, "upload v after 9 bytes: the image is larger", nil},
		{"call failed alone", meterFailure{}, lv, "upload v after 9 bytes: procedure interrupted", lv},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := uploadCause("v", 9, tt.f, tt.call)
			if tt.want == "" {
				if err != nil {
					t.Fatalf("uploadCause = %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("uploadCause = %v, want it to say %q", err, tt.want)
			}
			if tt.f.from != fromSource && strings.Contains(err.Error(), "reading the image") {
				t.Fatalf("a libvirt failure reported as reading the image: %v", err)
			}
			if tt.wantErr != nil && !errors.Is(err, tt.wantErr) {
				t.Fatalf("%v does not wrap %v", err, tt.wantErr)
			}
		})
	}
}

// classify: the pool's absence or a stopped pool needs a human
// (Permanent); a lost session, a volume gone and libvirt's passing states
// are Transient; an ended context gives its code.
func TestClassifyLibvirtSide(t *testing.T) {
	c := newFake(t, &fakeConn{})
	lerr := func(code libvirt.ErrorNumber, msg string) error {
		return fmt.Errorf("upload v after 9 bytes: libvirt failed: %w", libvirt.Error{Code: uint32(code), Message: msg})
	}
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tt := range []struct {
		name string
		ctx  context.Context
		err  error
		want errs.ErrorCode
		msg  string
	}{
		{"pool not found", context.Background(), lerr(libvirt.ErrNoStoragePool, "Storage pool not found: no storage pool with matching name 'p'"), errs.Permanent, "storage pool p"},
		{"pool not active", context.Background(), lerr(libvirt.ErrOperationInvalid, "Requested operation is not valid: storage pool 'p' is not active"), errs.Permanent, "start it"},
		{"pool busy", context.Background(), lerr(libvirt.ErrOperationInvalid, "internal error: pool 'p' has asynchronous jobs running."), errs.Transient, "asynchronous"},
		{"volume gone", context.Background(), lerr(libvirt.ErrNoStorageVol, "Storage volume not found"), errs.Transient, "Storage volume"},
		{"session lost", context.Background(), fmt.Errorf("upload v: %w", &sshconn.Error{Kind: sshconn.KindUnreachable, Err: errors.New("connection reset by peer")}), errs.Transient, "reset"},
		{"ctx ended", ended, lerr(libvirt.ErrOperationInvalid, "Requested operation is not valid: storage pool 'p' is not active"), errs.Canceled, "not active"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := c.classify(tt.ctx, tt.err)
			if errs.Code(err) != tt.want || !strings.Contains(err.Error(), tt.msg) {
				t.Fatalf("classify = %v (%v), want %v naming %q", err, errs.Code(err), tt.want, tt.msg)
			}
		})
	}
}
