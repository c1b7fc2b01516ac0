//go:build integration

package kvm2

import (
	"context"
	"testing"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/go-logr/logr/testr"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

// TestIntegrationSpanTree: a cold Create makes the span tree of
// docs/observability.md — kvm2.Create over the domain lookup (NotFound: it
// does not exist yet), imagecache.Ensure → Fetch → Upload and Verify, and
// the libvirt batch that makes the instance — and a Get of a missing
// instance fails as NotFound in both its span and its libvirt child.
func TestIntegrationSpanTree(t *testing.T) {
	e := newLifecycleEnv(t)
	p, rec, tp := tracedProvider(t, e)
	ctx := ctxT(t)
	entry := e.cfg.Entry
	dn := domainName(entry, "tree")
	overlay := overlayVolume(dn)
	type kv = map[attribute.Key]string

	if _, err := p.Create(ctx, egressproxy.Spec{Name: "tree", UID: "uid-tree"}); err != nil {
		t.Fatal(err)
	}
	assertTree(t, rec, []recordedSpan{
		{name: "kvm2.libvirt.Create.lookup", parent: "kvm2.Create", status: codes.Error, attrs: kv{"kvm2.domain": dn, "error.type": "NotFound"}},
		{name: "imagecache.Upload", parent: "imagecache.Fetch", attrs: kv{"egressproxy.entry": entry, "egressproxy.volume": e.baseVol}},
		{name: "imagecache.Verify", parent: "imagecache.Fetch", attrs: kv{"egressproxy.entry": entry, "egressproxy.volume": e.baseVol}},
		{name: "imagecache.Fetch", parent: "imagecache.Ensure", attrs: kv{"egressproxy.entry": entry, "egressproxy.volume": e.baseVol}},
		{name: "imagecache.Ensure", parent: "kvm2.Create", attrs: kv{"egressproxy.entry": entry, "egressproxy.volume": e.baseVol}},
		{name: "kvm2.libvirt.Create", parent: "kvm2.Create", attrs: kv{"kvm2.domain": dn, "egressproxy.volume": overlay}},
		{name: "kvm2.Create", attrs: kv{"egressproxy.entry": entry, "egressproxy.instance": "tree", "egressproxy.volume": overlay}},
	})

	rec2 := tracetest.NewSpanRecorder()
	tp.RegisterSpanProcessor(rec2)
	tp.UnregisterSpanProcessor(rec)
	if _, err := p.Get(ctx, egressproxy.Ref{Name: "missing", UID: "u"}); errs.Code(err) != errs.NotFound {
		t.Fatalf("Get of a missing instance = %v, want NotFound", err)
	}
	assertTree(t, rec2, []recordedSpan{
		{name: "kvm2.libvirt.Get", parent: "kvm2.Get", status: codes.Error, attrs: kv{"kvm2.domain": domainName(entry, "missing"), "error.type": "NotFound"}},
		{name: "kvm2.Get", status: codes.Error, attrs: kv{"egressproxy.entry": entry, "egressproxy.instance": "missing", "error.type": "NotFound"}},
	})
}

// assertTree checks the spans rec ended, in end order, against want.
func assertTree(t *testing.T, rec *tracetest.SpanRecorder, want []recordedSpan) {
	t.Helper()
	got := recorded(rec)
	if len(got) != len(want) {
		var names []string
		for _, s := range got {
			names = append(names, s.name+"<-"+s.parent)
		}
		t.Fatalf("spans %v, want %d", names, len(want))
	}
	for i := range want {
		checkSpan(t, got[i], want[i])
	}
}

// tracedProvider opens e's provider with an in-memory span recorder on its
// own TracerProvider; provider and TracerProvider are closed when the test
// ends.
func tracedProvider(t *testing.T, e *lifecycleEnv) (*provider, *tracetest.SpanRecorder, *sdktrace.TracerProvider) {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	p, err := open(context.Background(), e.cfg, &Options{Logger: testr.New(t), TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p, rec, tp
}
