package basecache

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/sshconn"
)

func newTracedFake(t *testing.T, f *fakeConn) (*Cache, *tracetest.SpanRecorder) {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	c, err := New(f, Config{Entry: "e", Pool: "p", TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c, rec
}

// The public operations each make one span with the entry and, once the
// image is valid, its base volume; error.type is the class of the error
// returned, status Error on failure only.
func TestSpansOfPublicOperations(t *testing.T) {
	t.Parallel()
	down := func() *fakeConn {
		return &fakeConn{err: &sshconn.Error{Kind: sshconn.KindUnreachable, Err: errors.New("link dead")}}
	}
	vol := "base-e--deb.12.qcow2"
	for _, tt := range []struct {
		name    string
		conn    *fakeConn
		close   bool
		call    func(ctx context.Context, c *Cache) error
		span    string
		volume  string // "" = attribute absent
		errType string // "" = success
	}{
		{"ensure bad image", &fakeConn{}, false, func(ctx context.Context, c *Cache) error {
			_, err := c.Ensure(ctx, imagecache.Image{Key: "x"})
			return err
		}, "imagecache.Ensure", "", "Permanent"},
		{"ensure, libvirt down", down(), false, func(ctx context.Context, c *Cache) error {
			_, err := c.Ensure(ctx, okImage)
			return err
		}, "imagecache.Ensure", vol, "Transient"},
		{"ensure canceled", &fakeConn{gate: make(chan struct{})}, false, func(ctx context.Context, c *Cache) error {
			ctx, cancel := context.WithCancel(ctx)
			cancel()
			_, err := c.Ensure(ctx, okImage)
			return err
		}, "imagecache.Ensure", vol, "Canceled"},
		{"ensure after close", &fakeConn{}, true, func(ctx context.Context, c *Cache) error {
			_, err := c.Ensure(ctx, okImage)
			return err
		}, "imagecache.Ensure", vol, "Permanent"},
		{"verify bad image", &fakeConn{}, false, func(ctx context.Context, c *Cache) error {
			_, err := c.Verify(ctx, imagecache.Image{Key: "x"})
			return err
		}, "imagecache.Verify", "", "Permanent"},
		{"verify, no base", &fakeConn{}, false, func(ctx context.Context, c *Cache) error {
			_, err := c.Verify(ctx, okImage)
			return err
		}, "imagecache.Verify", vol, "NotFound"},
		{"verify, libvirt down", down(), false, func(ctx context.Context, c *Cache) error {
			_, err := c.Verify(ctx, okImage)
			return err
		}, "imagecache.Verify", vol, "Transient"},
		{"evict bad key", &fakeConn{}, false, func(ctx context.Context, c *Cache) error {
			return c.Evict(ctx, imagecache.Image{Key: "A"})
		}, "imagecache.Evict", "", "Permanent"},
		{"evict, libvirt down", down(), false, func(ctx context.Context, c *Cache) error {
			return c.Evict(ctx, okImage)
		}, "imagecache.Evict", vol, "Transient"},
		{"evict after close", &fakeConn{}, true, func(ctx context.Context, c *Cache) error {
			return c.Evict(ctx, okImage)
		}, "imagecache.Evict", "", "Permanent"},
		{"list, empty pool", &fakeConn{}, false, func(ctx context.Context, c *Cache) error {
			_, err := c.List(ctx)
			return err
		}, "imagecache.List", "", ""},
		{"list, libvirt down", down(), false, func(ctx context.Context, c *Cache) error {
			_, err := c.List(ctx)
			return err
		}, "imagecache.List", "", "Transient"},
		{"list after close", &fakeConn{}, true, func(ctx context.Context, c *Cache) error {
			_, err := c.List(ctx)
			return err
		}, "imagecache.List", "", "Permanent"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c, rec := newTracedFake(t, tt.conn)
			if tt.close {
				if err := c.Close(); err != nil {
					t.Fatal(err)
				}
			}
			err := tt.call(context.Background(), c)
			if got := errs.Code(err).String(); tt.errType == "" && err != nil || tt.errType != "" && got != tt.errType {
				t.Fatalf("call returned %v (%s), want class %q", err, got, tt.errType)
			}
			_ = c.Close() // the flight of a canceled Ensure has ended
			spans := rec.Ended()
			if len(spans) != 1 || spans[0].Name() != tt.span {
				var names []string
				for _, s := range spans {
					names = append(names, s.Name())
				}
				t.Fatalf("spans %v, want one %s", names, tt.span)
			}
			s := spans[0]
			attrs := map[attribute.Key]string{}
			for _, kv := range s.Attributes() {
				if kv.Value.String() == "" {
					t.Errorf("empty attribute %s", kv.Key)
				}
				attrs[kv.Key] = kv.Value.String()
			}
			if attrs["egressproxy.entry"] != "e" {
				t.Errorf("egressproxy.entry = %q", attrs["egressproxy.entry"])
			}
			if v, ok := attrs["egressproxy.volume"]; v != tt.volume || tt.volume == "" && ok {
				t.Errorf("egressproxy.volume = %q (set %v), want %q", v, ok, tt.volume)
			}
			et, ok := attrs["error.type"]
			if tt.errType == "" {
				if ok || s.Status().Code != codes.Unset || len(s.Events()) != 0 {
					t.Errorf("successful span: error.type %q, status %v, %d events", et, s.Status(), len(s.Events()))
				}
				return
			}
			if et != tt.errType || s.Status().Code != codes.Error || s.Status().Description == "" || len(s.Events()) != 1 {
				t.Errorf("failed span: error.type %q, status %v, %d events", et, s.Status(), len(s.Events()))
			}
		})
	}
}

// A fetch refused by the server ends imagecache.Fetch with the class and
// the URL redacted in the attribute, the status and the exception; no
// upload span starts.
func TestFetchSpanOnHTTPFailure(t *testing.T) {
	t.Parallel()
	const pass = "pAsSw0rd-Secret9"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { http.NotFound(w, r) }))
	t.Cleanup(srv.Close)
	c, rec := newTracedFake(t, &fakeConn{})
	img := imagecache.Image{Key: "deb.12", URL: strings.Replace(srv.URL, "http://", "http://op:"+pass+"@", 1) + "/x.qcow2"}
	if _, err := c.fetch(context.Background(), img, c.BaseName(img), nil); errs.Code(err) != errs.Permanent {
		t.Fatalf("fetch = %v, want Permanent", err)
	}
	spans := rec.Ended()
	if len(spans) != 1 || spans[0].Name() != "imagecache.Fetch" {
		t.Fatalf("%d spans, want one imagecache.Fetch", len(spans))
	}
	s := spans[0]
	attrs := map[attribute.Key]string{}
	for _, kv := range s.Attributes() {
		attrs[kv.Key] = kv.Value.String()
	}
	if attrs["egressproxy.volume"] != "base-e--deb.12.qcow2" || attrs["egressproxy.entry"] != "e" || attrs["error.type"] != "Permanent" {
		t.Errorf("attributes %v", attrs)
	}
	if u := attrs["url.full"]; !strings.HasPrefix(u, "http://") || !strings.HasSuffix(u, "/x.qcow2") || strings.Contains(u, pass) {
		t.Errorf("url.full = %q", u)
	}
	texts := []string{s.Status().Description}
	for _, ev := range s.Events() {
		for _, kv := range ev.Attributes {
			texts = append(texts, kv.Value.String())
		}
	}
	for _, txt := range texts {
		if strings.Contains(txt, pass) {
			t.Errorf("the password is in %q", txt)
		}
	}
	if s.Status().Code != codes.Error || !strings.Contains(s.Status().Description, "404") {
		t.Errorf("status %v", s.Status())
	}
}
