package sshconn

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/internal/budget"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/testing/sshtest"
)

// Our own budget (DialTimeout) is not the caller's deadline:
// a caller without a deadline must never see context.DeadlineExceeded
// (which provider classes as the caller's DeadlineExceeded), but a
// *budget.TimeoutError naming the budget, KindUnreachable. The caller's own
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
		var te *budget.TimeoutError
		if !errors.As(err, &te) || te.Budget != "DialTimeout" || te.After != 150*time.Millisecond {
			t.Fatalf("attempt %d: %v, want a *budget.TimeoutError of DialTimeout 150ms", i, err)
		}
		if errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("attempt %d: %v matches context.DeadlineExceeded; the caller had no deadline", i, err)
		}
		if errKind(err) != KindUnreachable || !strings.Contains(err.Error(), "no answer within DialTimeout (150ms)") {
			t.Fatalf("attempt %d: %v (kind %v), want unreachable naming DialTimeout", i, err, errKind(err))
		}
	}
	// The shared link's dial reports the same.
	if _, err := p.Client(context.Background()); !errors.As(err, new(*budget.TimeoutError)) || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Client: %v, want a *budget.TimeoutError", err)
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
		if !errors.Is(err, context.DeadlineExceeded) || errors.As(err, new(*budget.TimeoutError)) || errKind(err) != KindUnreachable {
			t.Fatalf("attempt %d: %v (kind %v), want the caller's context.DeadlineExceeded, unreachable", i, err, errKind(err))
		}
	}
}

// A dial the caller cancels mid-handshake is the caller's cancellation,
// not the host's failure: it matches context.Canceled (errs.Canceled),
// is not KindUnreachable (which kvm2 and imagecache take for a dead link),
// and its text says the handshake was canceled, without the "i/o timeout"
// of the connection deadline the cancel sets to cut the handshake. The
// pool does not back off for it (Dead stays false).
func TestDialCanceledIsNotUnreachable(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	addr, spoke := sshtest.SilentServer(t) // the SSH handshake gets no answer
	cfg := f.config()
	cfg.Address = addr
	cfg.DialTimeout = 10 * time.Second
	p := newPool(t, cfg)
	dials := map[string]func(context.Context) error{
		"Dedicated": func(ctx context.Context) error { _, err := p.Dedicated(ctx); return err },
		"Client":    func(ctx context.Context) error { _, err := p.Client(ctx); return err },
	}
	for name, dial := range dials {
		for i := range 4 {
			ctx, cancel := context.WithCancel(context.Background())
			go func() {
				<-spoke // the client wrote its banner: it is in the handshake
				cancel()
			}()
			err := dial(ctx)
			cancel()
			msg := fmt.Sprint(err)
			if !errors.Is(err, context.Canceled) || errs.Code(err) != errs.Canceled || errKind(err) == KindUnreachable {
				t.Fatalf("%s %d: %v (kind %v, code %v), want the caller's context.Canceled, not unreachable", name, i, err, errKind(err), errs.Code(err))
			}
			if msg != "sshconn "+cfg.Address+": ssh handshake: canceled: context canceled" || strings.Contains(msg, "unreachable") || strings.Contains(msg, "i/o timeout") {
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
	if _, err := p.Client(ctx); !errors.Is(err, context.Canceled) || fmt.Sprint(err) != "sshconn "+cfg.Address+": dial: canceled: context canceled" {
		t.Fatalf("Client with a canceled context: %v", err)
	}
}
