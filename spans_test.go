package egressproxy_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/memprovider"
)

// spanOf is what a test asserts of one recorded span.
type spanOf struct {
	name   string
	attrs  map[attribute.Key]string
	status codes.Code
	desc   string
	events []string
	parent bool // has a valid parent span
}

func spansOf(rec *tracetest.SpanRecorder) []spanOf {
	var out []spanOf
	for _, s := range rec.Ended() {
		so := spanOf{name: s.Name(), attrs: map[attribute.Key]string{}, status: s.Status().Code, desc: s.Status().Description, parent: s.Parent().IsValid()}
		for _, kv := range s.Attributes() {
			so.attrs[kv.Key] = kv.Value.String()
		}
		for _, ev := range s.Events() {
			so.events = append(so.events, ev.Name)
		}
		out = append(out, so)
	}
	return out
}

func newTracedClient(t *testing.T) (*egressproxy.Client, *memprovider.Control, *tracetest.SpanRecorder) {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	c := memprovider.New(&memprovider.Options{TracerProvider: tp})

	var p *memprovider.Control

	c.As(&p)
	t.Cleanup(func() { _ = c.Close() })
	return c, p, rec
}

// Every Client operation makes one span with a stable name and the
// convention's attributes; a failure sets error.type to its class, status
// Error and an exception event, a success none of them (status Unset).
func TestSpansPerOperationAndOutcome(t *testing.T) {
	t.Parallel()
	spec := goodSpec()
	missing := egressproxy.Ref{Name: "proxy-z", UID: "uid-z"}
	long := strings.Repeat("x", 1<<20)
	for _, tt := range []struct {
		name     string
		call     func(ctx context.Context, c *egressproxy.Client, p *memprovider.Control) error
		span     string
		instance string // "" = attribute absent
		errType  string // "" = success
	}{
		{"create", func(ctx context.Context, c *egressproxy.Client, _ *memprovider.Control) error {
			_, err := c.Create(ctx, spec)
			return err
		}, "egressproxy.Create", "proxy-a", ""},
		{"get", func(ctx context.Context, c *egressproxy.Client, _ *memprovider.Control) error {
			if _, err := c.Create(ctx, spec); err != nil { // a span of its own, skipped below
				return err
			}
			_, err := c.Get(ctx, spec.Ref())
			return err
		}, "egressproxy.Get", "proxy-a", ""},
		{"delete", func(ctx context.Context, c *egressproxy.Client, _ *memprovider.Control) error {
			return c.Delete(ctx, spec.Ref())
		}, "egressproxy.Delete", "proxy-a", ""},
		{"list", func(ctx context.Context, c *egressproxy.Client, _ *memprovider.Control) error {
			_, err := c.List(ctx)
			return err
		}, "egressproxy.List", "", ""},
		{"check", func(ctx context.Context, c *egressproxy.Client, _ *memprovider.Control) error {
			_, err := c.Check(ctx)
			return err
		}, "egressproxy.Check", "", ""},
		{"check unhealthy is no error", func(ctx context.Context, c *egressproxy.Client, p *memprovider.Control) error {
			p.InjectFault(memprovider.OpCheck, memprovider.Fault{Code: egressproxy.Transient, Reason: egressproxy.ReasonUnreachable, Times: 1})
			h, err := c.Check(ctx)
			if err == nil && h.Reachable {
				return errors.New("test: the injected fault did not make Check unhealthy")
			}
			return err
		}, "egressproxy.Check", "", ""},
		{"get missing", func(ctx context.Context, c *egressproxy.Client, _ *memprovider.Control) error {
			_, err := c.Get(ctx, missing)
			return err
		}, "egressproxy.Get", "proxy-z", "NotFound"},
		{"create invalid name", func(ctx context.Context, c *egressproxy.Client, _ *memprovider.Control) error {
			_, err := c.Create(ctx, egressproxy.Spec{Name: "Bad_Name", UID: "u"})
			return err
		}, "egressproxy.Create", "Bad_Name", "Permanent"},
		{"create without name", func(ctx context.Context, c *egressproxy.Client, _ *memprovider.Control) error {
			_, err := c.Create(ctx, egressproxy.Spec{UID: "u"})
			return err
		}, "egressproxy.Create", "", "Permanent"},
		{"create with a 1 MiB name", func(ctx context.Context, c *egressproxy.Client, _ *memprovider.Control) error {
			_, err := c.Create(ctx, egressproxy.Spec{Name: long, UID: "u"})
			return err
		}, "egressproxy.Create", long[:253] + "…", "Permanent"},
		{"delete invalid ref", func(ctx context.Context, c *egressproxy.Client, _ *memprovider.Control) error {
			return c.Delete(ctx, egressproxy.Ref{Name: "proxy-a"})
		}, "egressproxy.Delete", "proxy-a", "Permanent"},
		{"create transient", func(ctx context.Context, c *egressproxy.Client, p *memprovider.Control) error {
			p.InjectFault(memprovider.OpCreate, memprovider.Fault{Code: egressproxy.Transient, Times: 1})
			_, err := c.Create(ctx, spec)
			return err
		}, "egressproxy.Create", "proxy-a", "Transient"},
		{"list unclassed is transient", func(ctx context.Context, c *egressproxy.Client, p *memprovider.Control) error {
			p.InjectFault(memprovider.OpList, memprovider.Fault{Err: errors.New("backend bug"), Times: 1})
			_, err := c.List(ctx)
			return err
		}, "egressproxy.List", "", "Transient"},
		{"get canceled before", func(ctx context.Context, c *egressproxy.Client, _ *memprovider.Control) error {
			ctx, cancel := context.WithCancel(ctx)
			cancel()
			_, err := c.Get(ctx, spec.Ref())
			return err
		}, "egressproxy.Get", "proxy-a", "Canceled"},
		{"delete canceled in flight", func(ctx context.Context, c *egressproxy.Client, p *memprovider.Control) error {
			ctx, cancel := context.WithCancel(ctx)
			defer cancel()
			p.InjectFault(memprovider.OpDelete, memprovider.Fault{Delay: time.Hour, Waiting: cancel, Times: 1})
			return c.Delete(ctx, spec.Ref())
		}, "egressproxy.Delete", "proxy-a", "Canceled"},
		{"check past deadline", func(ctx context.Context, c *egressproxy.Client, _ *memprovider.Control) error {
			ctx, cancel := context.WithDeadline(ctx, time.Now().Add(-time.Second))
			defer cancel()
			_, err := c.Check(ctx)
			return err
		}, "egressproxy.Check", "", "DeadlineExceeded"},
		{"get after close", func(ctx context.Context, c *egressproxy.Client, _ *memprovider.Control) error {
			if err := c.Close(); err != nil {
				return err
			}
			_, err := c.Get(ctx, spec.Ref())
			return err
		}, "egressproxy.Get", "proxy-a", "Permanent"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			c, p, rec := newTracedClient(t)
			err := tt.call(context.Background(), c, p)
			if got := egressproxy.Code(err).String(); (tt.errType == "" && err != nil) || (tt.errType != "" && got != tt.errType) {
				t.Fatalf("call returned %v (%s), want class %q", err, got, tt.errType)
			}
			var got *spanOf
			for _, s := range spansOf(rec) {
				if s.name == tt.span {
					if got != nil {
						t.Fatalf("two %s spans", tt.span)
					}
					got = &s
				} else if s.name != "egressproxy.Close" && (tt.name != "get" || s.name != "egressproxy.Create") {
					t.Errorf("unexpected span %s", s.name)
				}
			}
			if got == nil {
				t.Fatalf("no %s span in %v", tt.span, spansOf(rec))
			}
			for k, v := range got.attrs {
				if v == "" {
					t.Errorf("empty attribute %s", k)
				}
			}
			if v, ok := got.attrs["egressproxy.instance"]; tt.instance == "" && ok || v != tt.instance {
				t.Errorf("egressproxy.instance = %q (set %v), want %q", v, ok, tt.instance)
			}
			if _, ok := got.attrs["egressproxy.entry"]; ok {
				t.Error("egressproxy.entry set, but the client knows no entry")
			}
			et, ok := got.attrs["error.type"]
			if tt.errType == "" {
				if ok || got.status != codes.Unset || len(got.events) != 0 {
					t.Errorf("successful span: error.type %q (set %v), status %v, events %v", et, ok, got.status, got.events)
				}
				return
			}
			if et != tt.errType {
				t.Errorf("error.type = %q, want %q", et, tt.errType)
			}
			if got.status != codes.Error || got.desc == "" || len(got.desc) > 256 || !utf8.ValidString(got.desc) {
				t.Errorf("status %v %q, want Error with a short description", got.status, got.desc)
			}
			if len(got.events) != 1 || got.events[0] != "exception" {
				t.Errorf("events %v, want one exception", got.events)
			}
		})
	}
}

// The client's span is a child of the caller's; Close makes one span, the
// first time only.
func TestSpanParentAndClose(t *testing.T) {
	t.Parallel()
	c, _, rec := newTracedClient(t)
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	ctx, parent := tp.Tracer("caller").Start(context.Background(), "reconcile")
	if _, err := c.List(ctx); err != nil {
		t.Fatal(err)
	}
	parent.End()
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, s := range rec.Ended() {
		names = append(names, s.Name())
		switch s.Name() {
		case "egressproxy.List":
			if s.Parent().SpanID() != parent.SpanContext().SpanID() {
				t.Errorf("egressproxy.List parent %v, want the caller's span", s.Parent().SpanID())
			}
		case "egressproxy.Close":
			if s.Status().Code != codes.Unset {
				t.Errorf("Close status %v", s.Status())
			}
		}
	}
	if want := "egressproxy.List,reconcile,egressproxy.Close"; strings.Join(names, ",") != want {
		t.Fatalf("spans %v, want %s", names, want)
	}
}
