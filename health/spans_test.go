package health

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

func errorType(s sdktrace.ReadOnlySpan) (string, bool) {
	for _, kv := range s.Attributes() {
		if kv.Key == "error.type" {
			return kv.Value.AsString(), true
		}
	}
	return "", false
}

// health.Round and health.ProbeAll follow the span convention: error.type
// and status Error only on failure — a Round without a target is the
// caller's mistake (Permanent), a ProbeAll whose context ended is Canceled;
// a round that ran, whatever the proxies answered, is Unset.
func TestSpanStatusAndErrorType(t *testing.T) {
	t.Parallel()
	good := startFake(t, reply("HTTP/1.1 200 OK\r\n\r\n")).addr
	denied := startFake(t, reply("HTTP/1.1 403 Forbidden\r\n\r\n")).addr
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	tr, err := NewTracker(&TrackerOptions{TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	members := []Proxy{{ID: "good", Address: good}, {ID: "denied", Address: denied}}
	if _, err := tr.Round(context.Background(), members, &ProbeAllOptions{Target: "example.test:443"}); err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Round(context.Background(), members, &ProbeAllOptions{}); err == nil {
		t.Fatal("Round without a target: no error")
	}
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	ProbeAll(canceled, []Proxy{{ID: "good", Address: good}}, &ProbeAllOptions{Target: "example.test:443", TracerProvider: tp})

	type outcome struct {
		name    string
		errType string
		status  codes.Code
	}
	want := []outcome{
		{"health.ProbeAll", "", codes.Unset}, {"health.Round", "", codes.Unset},
		{"health.Round", "Permanent", codes.Error},
		{"health.ProbeAll", "Canceled", codes.Error},
	}
	spans := rec.Ended()
	if len(spans) != len(want) {
		t.Fatalf("%d spans, want %d", len(spans), len(want))
	}
	for i, s := range spans {
		et, ok := errorType(s)
		got := outcome{s.Name(), et, s.Status().Code}
		if got != want[i] || ok != (want[i].errType != "") {
			t.Errorf("span %d = %+v (error.type set %v), want %+v", i, got, ok, want[i])
		}
		if (got.status == codes.Error) != (len(s.Events()) == 1) {
			t.Errorf("span %d %s: %d events with status %v", i, s.Name(), len(s.Events()), got.status)
		}
	}
}
