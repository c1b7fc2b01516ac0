package kvm2

import (
	"context"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
)

// recordedSpan is what the span tests assert of one span.
type recordedSpan struct {
	name   string
	attrs  map[attribute.Key]string
	status codes.Code
	parent string // name of the parent span among the recorded ones, "" for none
}

func recorded(rec *tracetest.SpanRecorder) []recordedSpan {
	ended := rec.Ended()
	byID := map[string]string{}
	for _, s := range ended {
		byID[s.SpanContext().SpanID().String()] = s.Name()
	}
	var out []recordedSpan
	for _, s := range ended {
		r := recordedSpan{name: s.Name(), attrs: map[attribute.Key]string{}, status: s.Status().Code}
		if s.Parent().IsValid() {
			r.parent = byID[s.Parent().SpanID().String()]
		}
		for _, kv := range s.Attributes() {
			r.attrs[kv.Key] = kv.Value.String()
		}
		out = append(out, r)
	}
	return out
}

// openTraced opens the offline provider of lifecycle_test.go (no host, no
// key file: the first libvirt call fails before any network use) with a
// span recorder.
func openTraced(t *testing.T) (*provider, *tracetest.SpanRecorder) {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	c := validConfig()
	c.Images = map[string]imagecache.Image{"tiny": {URL: "http://127.0.0.1:1/tiny.qcow2"}}
	p, err := open(context.Background(), c, &Options{TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p, rec
}

func TestOpenWithBadConfigMakesNoSpan(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	c := validConfig()
	c.Pool = ""
	if p, err := open(context.Background(), c, &Options{TracerProvider: tp}); err == nil {
		p.Close()
		t.Fatal("Open accepted a config without a pool")
	}
	if n := len(rec.Ended()) + len(rec.Started()); n != 0 {
		t.Fatalf("Open with a bad config made %d spans", n)
	}
}

// Each public operation makes one span named kvm2.<Operation> with the
// entry, the instance and (Create, Delete) the overlay volume; libvirt work
// happens in kvm2.libvirt.* children. The error class is error.type, set only
// on failure.
func TestSpansOfPublicOperations(t *testing.T) {
	t.Parallel()
	vol := overlayVolume(domainName("lab-1", "a"))
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tt := range []struct {
		name     string
		call     func(ctx context.Context, p *provider) error
		close    bool // Close the provider first
		want     recordedSpan
		errType  string         // "" = success
		children []recordedSpan // kvm2.libvirt.* spans, in end order
	}{
		{name: "create bad name", call: func(ctx context.Context, p *provider) error {
			_, err := p.Create(ctx, egressproxy.Spec{Name: "Bad_Name", UID: "u"})
			return err
		}, want: recordedSpan{name: "kvm2.Create", attrs: map[attribute.Key]string{"egressproxy.entry": "lab-1", "egressproxy.instance": "Bad_Name", "egressproxy.volume": overlayVolume(domainName("lab-1", "Bad_Name"))}}, errType: "Permanent"},
		{name: "create without name", call: func(ctx context.Context, p *provider) error {
			_, err := p.Create(ctx, egressproxy.Spec{UID: "u"})
			return err
		}, want: recordedSpan{name: "kvm2.Create", attrs: map[attribute.Key]string{"egressproxy.entry": "lab-1"}}, errType: "Permanent"},
		{name: "get bad ref", call: func(ctx context.Context, p *provider) error {
			_, err := p.Get(ctx, egressproxy.Ref{Name: "a"})
			return err
		}, want: recordedSpan{name: "kvm2.Get", attrs: map[attribute.Key]string{"egressproxy.entry": "lab-1", "egressproxy.instance": "a"}}, errType: "Permanent"},
		{name: "get, host unusable", call: func(ctx context.Context, p *provider) error {
			_, err := p.Get(ctx, egressproxy.Ref{Name: "a", UID: "u"})
			return err
		}, want: recordedSpan{name: "kvm2.Get", attrs: map[attribute.Key]string{"egressproxy.entry": "lab-1", "egressproxy.instance": "a"}}, errType: "Permanent",
			children: []recordedSpan{{name: "kvm2.libvirt.Get", attrs: map[attribute.Key]string{"kvm2.domain": domainName("lab-1", "a"), "error.type": "Permanent"}, status: codes.Error, parent: "kvm2.Get"}}},
		{name: "get canceled", call: func(_ context.Context, p *provider) error {
			_, err := p.Get(canceled, egressproxy.Ref{Name: "a", UID: "u"})
			return err
		}, want: recordedSpan{name: "kvm2.Get", attrs: map[attribute.Key]string{"egressproxy.entry": "lab-1", "egressproxy.instance": "a"}}, errType: "Canceled",
			children: []recordedSpan{{name: "kvm2.libvirt.Get", attrs: map[attribute.Key]string{"kvm2.domain": domainName("lab-1", "a"), "error.type": "Canceled"}, status: codes.Error, parent: "kvm2.Get"}}},
		{name: "list, host unusable", call: func(ctx context.Context, p *provider) error {
			_, err := p.List(ctx)
			return err
		}, want: recordedSpan{name: "kvm2.List", attrs: map[attribute.Key]string{"egressproxy.entry": "lab-1"}}, errType: "Permanent",
			children: []recordedSpan{{name: "kvm2.libvirt.List", attrs: map[attribute.Key]string{"error.type": "Permanent"}, status: codes.Error, parent: "kvm2.List"}}},
		{name: "check, host unusable, is a health reason", call: func(ctx context.Context, p *provider) error {
			h, err := p.Check(ctx)
			if err == nil && h.Reachable {
				t.Error("offline Check reports Reachable")
			}
			return err
		}, want: recordedSpan{name: "kvm2.Check", attrs: map[attribute.Key]string{"egressproxy.entry": "lab-1"}},
			children: []recordedSpan{{name: "kvm2.libvirt.Check", attrs: map[attribute.Key]string{"kvm2.pool": "default", "error.type": "Permanent"}, status: codes.Error, parent: "kvm2.Check"}}},
		{name: "create after close", close: true, call: func(ctx context.Context, p *provider) error {
			_, err := p.Create(ctx, egressproxy.Spec{Name: "a", UID: "u"})
			return err
		}, want: recordedSpan{name: "kvm2.Create", attrs: map[attribute.Key]string{"egressproxy.entry": "lab-1", "egressproxy.instance": "a", "egressproxy.volume": vol}}, errType: "Permanent"},
		{name: "get after close", close: true, call: func(ctx context.Context, p *provider) error {
			_, err := p.Get(ctx, egressproxy.Ref{Name: "a", UID: "u"})
			return err
		}, want: recordedSpan{name: "kvm2.Get", attrs: map[attribute.Key]string{"egressproxy.entry": "lab-1", "egressproxy.instance": "a"}}, errType: "Permanent"},
		{name: "delete after close", close: true, call: func(ctx context.Context, p *provider) error {
			return p.Delete(ctx, egressproxy.Ref{Name: "a", UID: "u"})
		}, want: recordedSpan{name: "kvm2.Delete", attrs: map[attribute.Key]string{"egressproxy.entry": "lab-1", "egressproxy.instance": "a", "egressproxy.volume": vol}}, errType: "Permanent"},
		{name: "list after close", close: true, call: func(ctx context.Context, p *provider) error {
			_, err := p.List(ctx)
			return err
		}, want: recordedSpan{name: "kvm2.List", attrs: map[attribute.Key]string{"egressproxy.entry": "lab-1"}}, errType: "Permanent"},
		{name: "check after close", close: true, call: func(ctx context.Context, p *provider) error {
			_, err := p.Check(ctx)
			return err
		}, want: recordedSpan{name: "kvm2.Check", attrs: map[attribute.Key]string{"egressproxy.entry": "lab-1"}}, errType: "Permanent"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			p, rec := openTraced(t)
			if tt.close {
				if err := p.Close(); err != nil {
					t.Fatal(err)
				}
			}
			err := tt.call(context.Background(), p)
			if got := errs.Code(err).String(); tt.errType == "" && err != nil || tt.errType != "" && got != tt.errType {
				t.Fatalf("call returned %v (%s), want class %q", err, got, tt.errType)
			}
			want := tt.want
			if tt.errType != "" {
				want.attrs["error.type"] = tt.errType
				want.status = codes.Error
			}
			spans := recorded(rec)
			var children []recordedSpan
			var top *recordedSpan
			for i, s := range spans {
				switch {
				case strings.HasPrefix(s.name, "kvm2.libvirt."):
					children = append(children, s)
				case s.name == want.name && top == nil:
					top = &spans[i]
				default:
					t.Errorf("unexpected span %s", s.name)
				}
			}
			if top == nil {
				t.Fatalf("no %s span in %v", want.name, spans)
			}
			checkSpan(t, *top, want)
			if len(children) != len(tt.children) {
				t.Fatalf("libvirt spans %v, want %v", children, tt.children)
			}
			for i := range children {
				checkSpan(t, children[i], tt.children[i])
			}
		})
	}
}

func checkSpan(t *testing.T, got, want recordedSpan) {
	t.Helper()
	if got.name != want.name || got.status != want.status || got.parent != want.parent {
		t.Errorf("span %s status %v parent %q, want %s %v %q", got.name, got.status, got.parent, want.name, want.status, want.parent)
	}
	for k, v := range want.attrs {
		if got.attrs[k] != v {
			t.Errorf("span %s: %s = %q, want %q", got.name, k, got.attrs[k], v)
		}
	}
	for k, v := range got.attrs {
		if v == "" {
			t.Errorf("span %s: empty attribute %s", got.name, k)
		}
		if _, ok := want.attrs[k]; !ok && (strings.HasPrefix(string(k), "egressproxy.") || k == "error.type") {
			t.Errorf("span %s: unexpected attribute %s = %q", got.name, k, v)
		}
	}
}
