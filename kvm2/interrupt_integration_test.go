//go:build integration

// External test package: it uses internal/benchutil's RPC counter (see
// rpccount_integration_test.go).
package kvm2_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/go-logr/logr/testr"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/testing/benchutil"
	"github.com/egressproxy/egressproxy/kvm2"
)

// interruption is one way a Create can be cut short.
type interruption string

const (
	byCancel interruption = "cancel" // the caller cancels its context
	byClose  interruption = "close"  // the embedder closes the provider
	byLink   interruption = "link"   // every SSH link to the host dies
)

// TestIntegrationCreateConvergesAfterInterruption interrupts a (cache-hit)
// Create at every RPC boundary — just before each of its calls reaches
// libvirtd, and just after libvirtd answered it but before the answer
// reaches the provider — by cancelling its context, closing the provider, or
// killing the SSH link. After each, Create is called again with the same
// spec (on a fresh provider when the old one was closed): it must yield an
// active instance with its overlay (backed by the base) and its seed (with
// the spec's user-data), Get must agree, and Delete must leave only the
// base.
// interruptShortPerKind is how many boundaries per interruption kind a
// -short run samples.
const interruptShortPerKind = 4

func TestIntegrationCreateConvergesAfterInterruption(t *testing.T) {
	cfg := kvm2.LifecycleConfigT(t)
	rc, err := benchutil.NewRPCCounter(t.TempDir(), cfg.LibvirtSocket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rc.Close() })
	cfg.LibvirtSocket = rc.Path()
	sshd := kvm2.SSHDPidT(t)

	open := func(t *testing.T) *egressproxy.Client {
		t.Helper()
		p, err := kvm2.Open(context.Background(), cfg, &kvm2.Options{Logger: testr.NewWithOptions(t, testr.Options{Verbosity: 1})})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = p.Close() })
		return p
	}
	ctxT := func(t *testing.T) context.Context {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		t.Cleanup(cancel)
		return ctx
	}
	connected := func(t *testing.T) *egressproxy.Client {
		t.Helper()
		p := open(t)
		if _, err := p.List(ctxT(t)); err != nil { // dials and connects
			t.Fatalf("List: %v", err)
		}
		return p
	}

	// Warm the base, then count the calls of a cache-hit Create on a
	// connected provider: the boundaries to interrupt at.
	ctx := ctxT(t)
	p := open(t)
	warm := egressproxy.Spec{Name: "warm", UID: "uid-warm"}
	if _, err := p.Create(ctx, warm); err != nil {
		t.Fatalf("warm Create: %v", err)
	}
	if err := p.Delete(ctx, warm.Ref()); err != nil {
		t.Fatal(err)
	}
	_ = p.Close()
	p = connected(t)
	probe := egressproxy.Spec{Name: "probe", UID: "uid-probe", UserData: "#cloud-config\n"}
	rc.Take()
	if _, err := p.Create(ctx, probe); err != nil {
		t.Fatalf("probe Create: %v", err)
	}
	calls := rc.Take()
	if err := p.Delete(ctx, probe.Ref()); err != nil {
		t.Fatal(err)
	}
	_ = p.Close()
	t.Logf("cache-hit Create on a connected provider: %d RPCs: %s", len(calls), benchutil.Summary(calls))
	if len(calls) == 0 {
		t.Fatal("Create made no RPC")
	}

	// -short (make test's stress runs) samples interruptShortPerKind
	// boundaries per kind from a logged seed; the full table runs
	// otherwise (make stress, a plain go test). EGRESSPROXY_INTERRUPT_SEED
	// replays a sample.
	sampled := func(how interruption, k int, after bool) bool { return true }
	if testing.Short() {
		seed := uint64(time.Now().UnixNano())
		if v := os.Getenv("EGRESSPROXY_INTERRUPT_SEED"); v != "" {
			if n, err := strconv.ParseUint(v, 10, 64); err == nil {
				seed = n
			}
		}
		t.Logf("-short: %d boundaries per interruption kind, sampled with EGRESSPROXY_INTERRUPT_SEED=%d", interruptShortPerKind, seed)
		r := rand.New(rand.NewPCG(seed, 0))
		pick := map[string]bool{}
		for _, how := range []interruption{byCancel, byClose, byLink} {
			for _, i := range r.Perm(2 * len(calls))[:min(interruptShortPerKind, 2*len(calls))] {
				pick[fmt.Sprintf("%s/%d/%v", how, i/2+1, i%2 == 1)] = true
			}
		}
		sampled = func(how interruption, k int, after bool) bool { return pick[fmt.Sprintf("%s/%d/%v", how, k, after)] }
	}
	var cases, retriesNeeded int
	for _, how := range []interruption{byCancel, byClose, byLink} {
		for k := 1; k <= len(calls); k++ {
			for _, after := range []bool{false, true} {
				if !sampled(how, k, after) {
					continue
				}
				phase := "before"
				if after {
					phase = "after"
				}
				name := fmt.Sprintf("%s/%02d-%s-%s", how, k, phase, strings.TrimSuffix(benchutil.Summary(calls[k-1:k]), "×1"))
				t.Run(name, func(t *testing.T) {
					cases++
					spec := egressproxy.Spec{
						Name:     fmt.Sprintf("i-%s-%d-%s", how, k, phase),
						UID:      fmt.Sprintf("uid-%s-%d-%s", how, k, phase),
						UserData: fmt.Sprintf("#cloud-config\n# %s\n", name),
					}
					p := connected(t)
					cctx, cancel := context.WithCancel(ctxT(t))
					defer cancel()
					returned := make(chan struct{})
					var fired atomic.Bool
					waitReturned := func() {
						select {
						case <-returned:
						case <-time.After(30 * time.Second):
							t.Errorf("interrupted Create still running 30s after the %s", how)
						}
					}
					rc.Arm(benchutil.Interrupt{Call: k, AfterReply: after, Act: func(uint32) bool {
						fired.Store(true)
						switch how {
						case byCancel:
							cancel()
							waitReturned()
						case byClose:
							_ = p.Close()
							waitReturned()
						case byLink:
							if err := kvm2.KillSSHSessions(t, sshd); err != nil {
								t.Errorf("kill the link: %v", err)
							}
							return true
						}
						return false
					}})
					_, err := p.Create(cctx, spec)
					close(returned)
					rc.Disarm()
					if !fired.Load() {
						t.Fatalf("the interrupt at call %d never acted (Create: %v)", k, err)
					}
					t.Logf("interrupted Create: %v (code %v)", err, errs.Code(err))
					switch c := errs.Code(err); {
					case err == nil:
						// The last answer may be all that was held.
					case how == byCancel && c != errs.Canceled:
						t.Errorf("cancelled Create: code %v, want Canceled", c)
					case how == byClose && !(c == errs.Permanent && errors.Is(err, errs.ErrClosed)) && c != errs.Transient:
						t.Errorf("Create interrupted by Close: code %v, want ErrClosed (Permanent) or Transient", c)
					case how == byLink && c != errs.Transient:
						t.Errorf("Create whose link died: code %v, want Transient", c)
					}

					q := p
					if how == byClose {
						q = open(t)
					}
					rctx := ctxT(t)
					var inst egressproxy.Instance
					for attempt := 1; ; attempt++ {
						inst, err = q.Create(rctx, spec)
						if err == nil || errs.Code(err) != errs.Transient || attempt == 3 {
							break
						}
						retriesNeeded++
						t.Logf("retried Create %d: transient: %v", attempt, err)
					}
					if err != nil {
						t.Fatalf("retried Create: %v (code %v)", err, errs.Code(err))
					}
					if inst.State != egressproxy.StateProvisioning {
						t.Errorf("retried Create returned state %s, want Provisioning (active, no address)", inst.State)
					}
					got, err := q.Get(rctx, spec.Ref())
					if err != nil || got.State != egressproxy.StateProvisioning || !got.CreatedAt.Equal(inst.CreatedAt) {
						t.Errorf("Get = %+v, %v; want Provisioning, created %v", got, err, inst.CreatedAt)
					}
					h := kvm2.SettledHostInstanceT(t, cfg, spec.Name)
					if !h.Defined || h.State != libvirt.DomainRunning {
						t.Errorf("domain defined %v state %d, want running", h.Defined, h.State)
					}
					if !h.Overlay || h.OverlayBacking != h.BasePath {
						t.Errorf("overlay present %v backed by %q, want backed by the base %q", h.Overlay, h.OverlayBacking, h.BasePath)
					}
					if !h.Seed || h.UserData != spec.UserData {
						t.Errorf("seed present %v with user-data %q, want %q", h.Seed, h.UserData, spec.UserData)
					}
					if err := q.Delete(rctx, spec.Ref()); err != nil {
						t.Fatalf("Delete: %v", err)
					}
					kvm2.AssertInstanceGoneT(t, cfg, spec.Name, " after Delete")
				})
			}
		}
	}
	kvm2.AssertOnlyBasesT(t, cfg, " after every case")
	t.Logf("%d interruptions (%d boundaries × before/after × cancel/close/link); %d retries needed a second attempt", cases, len(calls), retriesNeeded)
}
