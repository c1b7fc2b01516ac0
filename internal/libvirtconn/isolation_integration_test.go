//go:build integration

package libvirtconn

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// TestIntegrationCancelIsolated: callers whose contexts end mid-call (1–8 ms
// budgets, or cancelled at once) must not harm the 20 other callers sharing
// the pooled session: their calls keep succeeding and the session is never
// reconnected.
func TestIntegrationCancelIsolated(t *testing.T) {
	env := teststack.Require(t)
	_, l := stackLibvirt(t, env, stackConfig(env))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := hostname(ctx, l); err != nil {
		t.Fatalf("first Do: %v", err)
	}
	first := l.currentSession()

	const bystanders, cancellers = 20, 4
	run := 4 * time.Second
	if testing.Short() {
		run = time.Second
	}
	stop := make(chan struct{})
	var okCalls, failed, abandoned, cancelledOK atomic.Int64
	var firstErr atomic.Value
	var wg sync.WaitGroup
	for range bystanders {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				cctx, ccancel := context.WithTimeout(ctx, 30*time.Second)
				_, err := hostname(cctx, l)
				ccancel()
				if err != nil {
					failed.Add(1)
					firstErr.CompareAndSwap(nil, err)
					continue
				}
				okCalls.Add(1)
			}
		})
	}
	for i := range cancellers {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(i), 1))
			for {
				select {
				case <-stop:
					return
				default:
				}
				budget := time.Duration(1+r.IntN(8)) * time.Millisecond
				cctx, ccancel := context.WithTimeout(ctx, budget)
				if r.IntN(4) == 0 {
					ccancel() // cancelled before or while it starts
				}
				err := l.Do(cctx, func(v *libvirt.Libvirt) error {
					_, _, err := v.ConnectListAllDomains(1, libvirt.ConnectListDomainsActive|libvirt.ConnectListDomainsInactive)
					if err == nil {
						_, err = v.ConnectGetCapabilities()
					}
					return err
				})
				ccancel()
				switch {
				case err == nil:
					cancelledOK.Add(1)
				case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled):
					abandoned.Add(1)
				default:
					failed.Add(1)
					firstErr.CompareAndSwap(nil, err)
				}
			}
		})
	}
	time.Sleep(run)
	close(stop)
	wg.Wait()
	t.Logf("bystander calls ok %d; canceller calls abandoned %d, finished %d; failures %d",
		okCalls.Load(), abandoned.Load(), cancelledOK.Load(), failed.Load())
	if n := failed.Load(); n > 0 {
		t.Errorf("%d calls failed beside callers that cancel; first: %v", n, firstErr.Load())
	}
	if abandoned.Load() == 0 {
		t.Errorf("no call was abandoned: the test did not exercise cancellation")
	}
	if okCalls.Load() == 0 {
		t.Errorf("no bystander call succeeded")
	}
	if s := l.currentSession(); s != first {
		t.Errorf("the shared session was replaced while only callers' contexts ended")
	}
	if l.Dead() {
		t.Errorf("session reported dead after cancellations")
	}
}

func (s *Session) currentSession() *rpcConn {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cur
}
