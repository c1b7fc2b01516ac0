package egressproxy_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
	"github.com/go-logr/logr/funcr"
	"go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// recorder is a minimal Provider that records calls and returns scripted
// errors; memprovider is the full embedded provider, tested by the
// conformance suite.
type recorder struct {
	mu     sync.Mutex
	calls  []string
	err    error
	closed bool
	block  chan struct{} // when set, Get blocks until closed or ctx ends
	inGet  chan struct{} // when set, Get sends on it once it is blocking
}

func (r *recorder) note(op string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, op)
	return r.err
}

func (r *recorder) Create(ctx context.Context, s egressproxy.Spec) (egressproxy.Instance, error) {
	if err := r.note("create"); err != nil {
		return egressproxy.Instance{}, err
	}
	return egressproxy.Instance{Ref: s.Ref(), State: egressproxy.StateProvisioning, SpecDigest: s.Digest()}, nil
}

func (r *recorder) Get(ctx context.Context, ref egressproxy.Ref) (egressproxy.Instance, error) {
	if err := r.note("get"); err != nil {
		return egressproxy.Instance{}, err
	}
	if r.block != nil {
		if r.inGet != nil {
			r.inGet <- struct{}{}
		}
		select {
		case <-r.block:
			return egressproxy.Instance{}, errs.Errorf(egressproxy.Transient, "provider closed during call")
		case <-ctx.Done():
			return egressproxy.Instance{}, errs.FromContext(ctx.Err())
		}
	}
	return egressproxy.Instance{Ref: ref, State: egressproxy.StateRunning}, nil
}

func (r *recorder) Delete(ctx context.Context, ref egressproxy.Ref) error { return r.note("delete") }
func (r *recorder) List(ctx context.Context) ([]egressproxy.Instance, error) {
	return nil, r.note("list")
}
func (r *recorder) Check(ctx context.Context) (egressproxy.Health, error) {
	return egressproxy.Health{Reachable: true}, r.note("check")
}
func (r *recorder) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, "close")
	if !r.closed && r.block != nil {
		close(r.block)
	}
	r.closed = true
	return nil
}

func (r *recorder) callList() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.calls...)
}

func goodSpec() egressproxy.Spec {
	return egressproxy.Spec{Name: "proxy-a", UID: "uid-a"}
}

func TestBadSpecNeverReachesProvider(t *testing.T) {
	t.Parallel()
	r := &recorder{}
	c := driver.NewClient(r, nil)
	defer c.Close()
	for _, tt := range []struct {
		name  string
		spec  egressproxy.Spec
		field string
	}{
		{"bad name", egressproxy.Spec{Name: "Bad_Name", UID: "u"}, "Name"},
		{"no uid", egressproxy.Spec{Name: "ok"}, "UID"},
		{"port", egressproxy.Spec{Name: "ok", UID: "u", Port: 70000}, "Port"},
		{"image key", egressproxy.Spec{Name: "ok", UID: "u", ImageKey: "A"}, "ImageKey"},
		{"user data", egressproxy.Spec{Name: "ok", UID: "u", UserData: strings.Repeat("x", naming.MaxUserDataBytes+1)}, "UserData"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := c.Create(context.Background(), tt.spec)
			if !errors.Is(err, egressproxy.ErrPermanent) {
				t.Fatalf("err = %v, want Permanent", err)
			}
			var fe *egressproxy.FieldError
			if !errors.As(err, &fe) || fe.Field != tt.field {
				t.Fatalf("err %v does not name %s", err, tt.field)
			}
		})
	}
	for _, ref := range []egressproxy.Ref{{Name: "", UID: "u"}, {Name: "ok", UID: ""}} {
		if err := c.Delete(context.Background(), ref); !errors.Is(err, egressproxy.ErrPermanent) {
			t.Errorf("Delete(%+v) = %v, want Permanent", ref, err)
		}
		if _, err := c.Get(context.Background(), ref); !errors.Is(err, egressproxy.ErrPermanent) {
			t.Errorf("Get(%+v) = %v, want Permanent", ref, err)
		}
	}
	if calls := r.callList(); len(calls) != 0 {
		t.Fatalf("provider was called: %v", calls)
	}
}

func TestErrorsWrappedOnceWithOpAndInstance(t *testing.T) {
	t.Parallel()
	cause := errs.Errorf(egressproxy.NotFound, "domain missing")
	r := &recorder{err: cause}
	c := driver.NewClient(r, nil)
	defer c.Close()
	_, err := c.Get(context.Background(), egressproxy.Ref{Name: "proxy-a", UID: "u"})
	var op *egressproxy.OpError
	if !errors.As(err, &op) || op.Op != "get" || op.Instance != "proxy-a" {
		t.Fatalf("err = %#v, want OpError get proxy-a", err)
	}
	if !errors.Is(err, egressproxy.ErrNotFound) || egressproxy.Code(err) != egressproxy.NotFound {
		t.Fatalf("class lost: %v", err)
	}
	if got := err.Error(); got != "egressproxy get proxy-a: domain missing" || strings.Count(got, "egressproxy") != 1 {
		t.Fatalf("message = %q", got)
	}
}

// TestSpecDigestAndConflictPassThrough: the client hands the provider's
// SpecDigest back unchanged and keeps ErrSpecConflict (and its Permanent
// class) visible through its wrapping.
func TestSpecDigestAndConflictPassThrough(t *testing.T) {
	t.Parallel()
	r := &recorder{}
	c := driver.NewClient(r, nil)
	defer c.Close()
	inst, err := c.Create(context.Background(), goodSpec())
	if err != nil || inst.SpecDigest != goodSpec().Digest() {
		t.Fatalf("Create = %+v, %v; want SpecDigest %s", inst, err, goodSpec().Digest())
	}
	r.err = errs.Errorf(egressproxy.Permanent, "instance proxy-a exists with another spec: %w", egressproxy.ErrSpecConflict)
	_, err = c.Create(context.Background(), goodSpec())
	var op *egressproxy.OpError
	if !errors.As(err, &op) || op.Op != "create" || !errors.Is(err, egressproxy.ErrSpecConflict) ||
		!errors.Is(err, egressproxy.ErrPermanent) || egressproxy.Code(err) != egressproxy.Permanent {
		t.Fatalf("err = %v (code %v), want an OpError that is ErrSpecConflict and Permanent", err, egressproxy.Code(err))
	}
}

func TestUnclassedErrorBecomesTransient(t *testing.T) {
	t.Parallel()
	r := &recorder{err: io.ErrUnexpectedEOF}
	c := driver.NewClient(r, nil)
	defer c.Close()
	err := c.Delete(context.Background(), egressproxy.Ref{Name: "a", UID: "u"})
	if egressproxy.Code(err) != egressproxy.Transient || !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("err = %v (code %v)", err, egressproxy.Code(err))
	}
}

func TestContextEndedBeforeCall(t *testing.T) {
	t.Parallel()
	r := &recorder{}
	c := driver.NewClient(r, nil)
	defer c.Close()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := c.List(ctx)
	if egressproxy.Code(err) != egressproxy.Canceled || !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v", err)
	}
	if len(r.callList()) != 0 {
		t.Fatal("provider called with a dead context")
	}
}

func TestCallsAfterCloseRefused(t *testing.T) {
	t.Parallel()
	r := &recorder{}
	c := driver.NewClient(r, nil)
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	_, err := c.Create(context.Background(), goodSpec())
	if !errors.Is(err, egressproxy.ErrClosed) || !errors.Is(err, egressproxy.ErrPermanent) {
		t.Fatalf("err = %v, want ErrClosed/Permanent", err)
	}
	if _, err := c.Check(context.Background()); !errors.Is(err, egressproxy.ErrClosed) {
		t.Fatalf("Check after close: %v", err)
	}
	if got := r.callList(); len(got) != 1 || got[0] != "close" {
		t.Fatalf("calls = %v, want exactly one close", got)
	}
}

func TestCloseEndsCallsInFlight(t *testing.T) {
	t.Parallel()
	r := &recorder{block: make(chan struct{}), inGet: make(chan struct{})}
	c := driver.NewClient(r, nil)
	done := make(chan error, 1)
	go func() {
		_, err := c.Get(context.Background(), egressproxy.Ref{Name: "a", UID: "u"})
		done <- err
	}()
	<-r.inGet // the Get is in flight
	closed := make(chan struct{})
	go func() { c.Close(); close(closed) }()
	select {
	case err := <-done:
		if !errors.Is(err, egressproxy.ErrTransient) {
			t.Fatalf("in-flight Get = %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("in-flight call not released by Close")
	}
	<-closed
}

func TestOneSpanAndOneLogLinePerOperation(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := trace.NewTracerProvider(trace.WithSpanProcessor(rec))
	var buf bytes.Buffer
	var mu sync.Mutex
	log := funcr.New(func(prefix, args string) {
		mu.Lock()
		defer mu.Unlock()
		buf.WriteString(args + "\n")
	}, funcr.Options{Verbosity: 1})
	r := &recorder{}
	c := driver.NewClient(r, &egressproxy.Options{Logger: log, TracerProvider: tp})
	ctx := context.Background()
	c.Create(ctx, goodSpec())
	c.Get(ctx, goodSpec().Ref())
	r.mu.Lock()
	r.err = errs.Errorf(egressproxy.Permanent, "refused")
	r.mu.Unlock()
	c.Delete(ctx, goodSpec().Ref())
	c.Close()

	spans := rec.Ended()
	var names []string
	for _, s := range spans {
		names = append(names, s.Name())
	}
	want := []string{"egressproxy.Create", "egressproxy.Get", "egressproxy.Delete", "egressproxy.Close"}
	if strings.Join(names, ",") != strings.Join(want, ",") {
		t.Fatalf("spans = %v, want %v", names, want)
	}
	if spans[2].Status().Code.String() != "Error" {
		t.Fatalf("failed op span status = %v", spans[2].Status())
	}
	mu.Lock()
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	mu.Unlock()
	if len(lines) != 3 {
		t.Fatalf("log lines = %d, want 3:\n%s", len(lines), buf.String())
	}
	if !strings.Contains(lines[2], `"op"="delete"`) || !strings.Contains(lines[2], `"code"="Permanent"`) {
		t.Fatalf("failure line = %s", lines[2])
	}
}

// Expected outcomes of a reconcile loop — a missing instance, input that
// fails validation, the caller's own cancellation, a closed client — log at
// V(1); Transient failures, which a retry answers, at Info (V(0), not
// Error); failures someone must act on log at Error.
func TestLogLevelsOfOutcomes(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var lines []string
	log := funcr.New(func(_, args string) {
		mu.Lock()
		defer mu.Unlock()
		lines = append(lines, args)
	}, funcr.Options{Verbosity: 1})
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	bad := goodSpec()
	bad.Name = "Not A Name"
	for _, tc := range []struct {
		name  string
		err   error
		call  func(c *egressproxy.Client) error
		level string // "v1", "info" (V(0), not Error) or "error"
	}{
		{"not found", errs.Errorf(egressproxy.NotFound, "no such instance"), func(c *egressproxy.Client) error { _, err := c.Get(context.Background(), goodSpec().Ref()); return err }, "v1"},
		{"validation", nil, func(c *egressproxy.Client) error { _, err := c.Create(context.Background(), bad); return err }, "v1"},
		{"caller cancelled", nil, func(c *egressproxy.Client) error { _, err := c.Get(cancelled, goodSpec().Ref()); return err }, "v1"},
		{"closed", nil, func(c *egressproxy.Client) error {
			c.Close()
			_, err := c.Get(context.Background(), goodSpec().Ref())
			return err
		}, "v1"},
		{"transient", errs.Errorf(egressproxy.Transient, "host unreachable"), func(c *egressproxy.Client) error { _, err := c.Get(context.Background(), goodSpec().Ref()); return err }, "info"},
		{"permanent", errs.Errorf(egressproxy.Permanent, "name taken"), func(c *egressproxy.Client) error { _, err := c.Get(context.Background(), goodSpec().Ref()); return err }, "error"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mu.Lock()
			lines = nil
			mu.Unlock()
			c := driver.NewClient(&recorder{err: tc.err}, &egressproxy.Options{Logger: log})
			defer c.Close()
			if err := tc.call(c); err == nil {
				t.Fatal("the call succeeded")
			}
			mu.Lock()
			defer mu.Unlock()
			if len(lines) != 1 {
				t.Fatalf("want one line, got %d: %v", len(lines), lines)
			}
			l := lines[0]
			got := "info"
			switch {
			case strings.Contains(l, `"error"=`):
				got = "error"
			case strings.Contains(l, `"level"=1`):
				got = "v1"
			}
			if got != tc.level {
				t.Fatalf("logged at %s, want %s: %s", got, tc.level, l)
			}
		})
	}
}
