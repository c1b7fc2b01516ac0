package libvirtconn

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/internal/budget"
	"github.com/egressproxy/egressproxy/internal/testing/sshtest"
	"github.com/egressproxy/egressproxy/sshconn"
)

// CallTimeout is not the caller's deadline: a caller without a deadline
// never sees context.DeadlineExceeded (which the module classes as the
// caller's DeadlineExceeded) but a *budget.TimeoutError naming it,
// KindUnreachable. The caller's own deadline still comes back as
// context.DeadlineExceeded.
func TestCallTimeoutIsNotTheCallersDeadline(t *testing.T) {
	f := sshtest.NewFixture(t)
	lvd := startLibvirtd(t, "h")
	p := newPool(t, sshConfig(f))
	l := New(p, Config{Socket: lvd.Path, URI: "test:///default", CallTimeout: 200 * time.Millisecond}, nil)
	t.Cleanup(func() { _ = l.Close() })
	if _, err := hostname(context.Background(), l); err != nil {
		t.Fatal(err)
	}
	lvd.hang.Store(true)
	for i := range 4 {
		_, err := hostname(context.Background(), l)
		var te *budget.TimeoutError
		if !errors.As(err, &te) || te.Budget != "CallTimeout" || errors.Is(err, context.DeadlineExceeded) || errKind(err) != sshconn.KindUnreachable {
			t.Fatalf("call %d: %v (kind %v), want a *budget.TimeoutError of CallTimeout, unreachable, not context.DeadlineExceeded", i, err, errKind(err))
		}
	}
	// A caller's deadline shorter than CallTimeout is the caller's.
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := hostname(ctx, l); !errors.Is(err, context.DeadlineExceeded) || errors.As(err, new(*budget.TimeoutError)) {
		t.Fatalf("with the caller's deadline: %v", err)
	}
	if p.Dead() {
		t.Error("abandoned calls tore the SSH link down")
	}
	lvd.hang.Store(false)
}
