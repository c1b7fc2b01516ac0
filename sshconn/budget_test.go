package sshconn

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/internal/errs"
)

// Our own budgets (DialTimeout, CallTimeout) are not the caller's deadline:
// a caller without a deadline must never see context.DeadlineExceeded
// (which provider classes as the caller's DeadlineExceeded), but a
// *TimeoutError naming the budget, KindUnreachable. The caller's own
// deadline still comes back as context.DeadlineExceeded. Each case runs
// several times: the handshake's connection deadline and DialTimeout's
// timer fire at the same instant, and which is seen first must not matter.

func TestDialTimeoutIsNotTheCallersDeadline(t *testing.T) {
	f := newFixture(t)
	f.srv.Freeze() // TCP accepts, the SSH handshake gets no answer
	defer f.srv.Thaw()
	cfg := f.config()
	cfg.DialTimeout = 150 * time.Millisecond
	cfg.MaxRedialBackoff = time.Millisecond
	p := newPool(t, cfg)
	for i := range 8 {
		_, err := p.Dedicated(context.Background()) // no backoff between attempts
		var te *TimeoutError
		if !errors.As(err, &te) || te.Budget != "DialTimeout" || te.After != 150*time.Millisecond {
			t.Fatalf("attempt %d: %v, want a *TimeoutError of DialTimeout 150ms", i, err)
		}
		if errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("attempt %d: %v matches context.DeadlineExceeded; the caller had no deadline", i, err)
		}
		if KindOf(err) != KindUnreachable || !strings.Contains(err.Error(), "no answer within DialTimeout (150ms)") {
			t.Fatalf("attempt %d: %v (kind %v), want unreachable naming DialTimeout", i, err, KindOf(err))
		}
	}
	// The shared link's dial reports the same.
	if _, err := p.Client(context.Background()); !errors.As(err, new(*TimeoutError)) || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Client: %v, want a *TimeoutError", err)
	}
}

func TestDialCallersDeadlineIsKept(t *testing.T) {
	f := newFixture(t)
	f.srv.Freeze()
	defer f.srv.Thaw()
	cfg := f.config()
	cfg.DialTimeout = 10 * time.Second
	p := newPool(t, cfg)
	for i := range 4 {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		_, err := p.Dedicated(ctx)
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) || errors.As(err, new(*TimeoutError)) || KindOf(err) != KindUnreachable {
			t.Fatalf("attempt %d: %v (kind %v), want the caller's context.DeadlineExceeded, unreachable", i, err, KindOf(err))
		}
	}
}

func TestCallTimeoutIsNotTheCallersDeadline(t *testing.T) {
	f := newFixture(t)
	lvd := startLibvirtd(t, "h")
	p := newPool(t, f.config())
	l := NewLibvirt(p, LibvirtConfig{Socket: lvd.Path, URI: "test:///default",
		CallTimeout: 200 * time.Millisecond})
	t.Cleanup(func() { _ = l.Close() })
	if _, err := hostname(context.Background(), l); err != nil {
		t.Fatal(err)
	}
	lvd.hang.Store(true)
	for i := range 4 {
		_, err := hostname(context.Background(), l)
		var te *TimeoutError
		if !errors.As(err, &te) || te.Budget != "CallTimeout" || errors.Is(err, context.DeadlineExceeded) || KindOf(err) != KindUnreachable {
			t.Fatalf("call %d: %v (kind %v), want a *TimeoutError of CallTimeout, unreachable, not context.DeadlineExceeded", i, err, KindOf(err))
		}
	}
	// A caller's deadline shorter than CallTimeout is the caller's.
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := hostname(ctx, l); !errors.Is(err, context.DeadlineExceeded) || errors.As(err, new(*TimeoutError)) {
		t.Fatalf("with the caller's deadline: %v", err)
	}
	if p.Dead() {
		t.Error("abandoned calls tore the SSH link down")
	}
	lvd.hang.Store(false)
}

func TestContextError(t *testing.T) {
	t.Parallel()
	if err := ContextError(context.Background()); err != nil {
		t.Fatalf("live context: %v", err)
	}
	ctx, cancel := WithBudget(context.Background(), "DialTimeout", time.Millisecond)
	defer cancel()
	<-ctx.Done()
	var te *TimeoutError
	if err := ContextError(ctx); !errors.As(err, &te) || te.Budget != "DialTimeout" || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("budget ran out: %v", err)
	}
	// The caller cancels before the budget: Canceled.
	parent, cancelParent := context.WithCancel(context.Background())
	ctx2, cancel2 := WithBudget(parent, "CallTimeout", time.Hour)
	defer cancel2()
	cancelParent()
	if err := ContextError(ctx2); !errors.Is(err, context.Canceled) {
		t.Fatalf("caller canceled: %v", err)
	}
	// The caller's earlier deadline: DeadlineExceeded.
	parent3, cancel3 := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel3()
	ctx3, cancel4 := WithBudget(parent3, "CallTimeout", time.Hour)
	defer cancel4()
	<-ctx3.Done()
	if err := ContextError(ctx3); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("caller's deadline: %v", err)
	}
}

// A dial the caller cancels mid-handshake is the caller's cancellation,
// not the host's failure: it matches context.Canceled (errs.Canceled),
// is not KindUnreachable (which kvm2 and imagecache take for a dead link),
// and its text says the handshake was canceled, without the "i/o timeout"
// of the connection deadline the cancel sets to cut the handshake. The
// pool does not back off for it (Dead stays false).
func TestDialCanceledIsNotUnreachable(t *testing.T) {
	f := newFixture(t)
	f.srv.Freeze() // TCP accepts, the SSH handshake gets no answer
	defer f.srv.Thaw()
	cfg := f.config()
	cfg.DialTimeout = 10 * time.Second
	p := newPool(t, cfg)
	dials := map[string]func(context.Context) error{
		"Dedicated": func(ctx context.Context) error { _, err := p.Dedicated(ctx); return err },
		"Client":    func(ctx context.Context) error { _, err := p.Client(ctx); return err },
	}
	for name, dial := range dials {
		for i := range 4 {
			ctx, cancel := context.WithCancel(context.Background())
			time.AfterFunc(100*time.Millisecond, cancel)
			err := dial(ctx)
			cancel()
			msg := fmt.Sprint(err)
			if !errors.Is(err, context.Canceled) || errs.Code(err) != errs.Canceled || KindOf(err) == KindUnreachable {
				t.Fatalf("%s %d: %v (kind %v, code %v), want the caller's context.Canceled, not unreachable", name, i, err, KindOf(err), errs.Code(err))
			}
			if !strings.Contains(msg, "ssh handshake "+cfg.Addr+": canceled") || strings.Contains(msg, "unreachable") || strings.Contains(msg, "i/o timeout") {
				t.Fatalf("%s %d: %q, want it to say the handshake was canceled, nothing of a network failure", name, i, msg)
			}
		}
	}
	if p.Dead() {
		t.Error("canceled dials made the pool back off as if the host had failed")
	}
	// Canceled before the dial: the same words.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := p.Client(ctx); !errors.Is(err, context.Canceled) || !strings.Contains(fmt.Sprint(err), "dial "+cfg.Addr+": canceled: context canceled") {
		t.Fatalf("Client with a canceled context: %v", err)
	}
}
