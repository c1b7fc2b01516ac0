package obs

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/egressproxy/egressproxy/internal/errs"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

func record(t *testing.T, fn func(ctx context.Context, tr *sdktrace.TracerProvider)) []sdktrace.ReadOnlySpan {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	fn(context.Background(), tp)
	return rec.Ended()
}

func attrs(s sdktrace.ReadOnlySpan) map[attribute.Key]string {
	m := map[attribute.Key]string{}
	for _, kv := range s.Attributes() {
		m[kv.Key] = kv.Value.String()
	}
	return m
}

func TestStartSkipsEmptyAndBounds(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("é", 1<<19) // 1 MiB
	spans := record(t, func(ctx context.Context, tp *sdktrace.TracerProvider) {
		_, s := Start(ctx, tp.Tracer("t"), "x.Op", Attrs{Instance: "p1"}, attribute.String("x.empty", ""), attribute.String("x.long", long), attribute.String("x.bad", "a\xffb"), attribute.Int("x.n", 0))
		End(s, nil)
	})
	if len(spans) != 1 {
		t.Fatalf("%d spans", len(spans))
	}
	s := spans[0]
	got := attrs(s)
	if _, ok := got[KeyEntry]; ok {
		t.Errorf("empty entry attribute set: %v", got)
	}
	if _, ok := got[KeyVolume]; ok {
		t.Errorf("empty volume attribute set: %v", got)
	}
	if _, ok := got["x.empty"]; ok {
		t.Errorf("empty extra attribute set: %v", got)
	}
	if got[KeyInstance] != "p1" || got["x.n"] != "0" || got["x.bad"] != "a\uFFFDb" {
		t.Errorf("attributes %v", got)
	}
	if l := got["x.long"]; len(l) > MaxAttrLen || !utf8.ValidString(l) || !strings.HasSuffix(l, "…") {
		t.Errorf("long attribute: %d bytes, valid %v", len(l), utf8.ValidString(l))
	}
	if _, ok := got[KeyErrorType]; ok || s.Status().Code != codes.Unset || len(s.Events()) != 0 {
		t.Errorf("successful span: error.type %v, status %v, events %v", got[KeyErrorType], s.Status(), s.Events())
	}
}

func TestEndWithError(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		err  error
		want string
	}{
		{errs.Errorf(errs.NotFound, "no such proxy"), "NotFound"},
		{errs.Errorf(errs.Permanent, "bad"), "Permanent"},
		{fmt.Errorf("wrapped: %w", errs.Errorf(errs.Transient, "link")), "Transient"},
		{context.Canceled, "Canceled"},
		{fmt.Errorf("x: %w", context.DeadlineExceeded), "DeadlineExceeded"},
		{errors.New("unclassed"), ErrorTypeOther},
		{errors.New(strings.Repeat("\xff", 4096)), ErrorTypeOther},
	} {
		spans := record(t, func(ctx context.Context, tp *sdktrace.TracerProvider) {
			_, s := Start(ctx, tp.Tracer("t"), "x.Op", Attrs{})
			End(s, tt.err)
		})
		s := spans[0]
		if got := attrs(s)[KeyErrorType]; got != tt.want {
			t.Errorf("%v: error.type %q, want %q", tt.err, got, tt.want)
		}
		st := s.Status()
		if st.Code != codes.Error || st.Description == "" || len(st.Description) > MaxAttrLen || !utf8.ValidString(st.Description) {
			t.Errorf("%q: status %v", tt.want, st)
		}
		if len(s.Events()) != 1 || s.Events()[0].Name != "exception" {
			t.Errorf("%q: events %v, want one exception", tt.want, s.Events())
		}
	}
}

func TestErrorTypeOfNil(t *testing.T) {
	t.Parallel()
	if got := ErrorType(nil); got != "" {
		t.Fatalf("ErrorType(nil) = %q", got)
	}
}
