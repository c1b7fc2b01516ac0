//go:build integration

package kvm2

import (
	"context"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// TestIntegrationFrozenSSHD: with sshd and its session processes stopped
// (SIGSTOP), a Check returns within its context budget, Close returns
// within a second, and after SIGCONT a new provider is reachable again.
func TestIntegrationFrozenSSHD(t *testing.T) {
	cfg := stackConfig(t)
	p, err := open(context.Background(), cfg, &Options{Logger: testr.New(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if h := checkT(t, p); !h.Reachable {
		t.Fatalf("Check before freezing: %+v", h)
	}
	pid, err := strconv.Atoi(teststack.Run(t, "sshd-pid"))
	if err != nil {
		t.Fatal(err)
	}
	frozen := append([]int{pid}, teststack.Descendants(pid)...)
	thaw := func() {
		for _, p := range frozen {
			_ = syscall.Kill(p, syscall.SIGCONT)
		}
	}
	t.Cleanup(thaw)
	for _, p := range frozen {
		if err := syscall.Kill(p, syscall.SIGSTOP); err != nil {
			t.Logf("SIGSTOP %d: %v", p, err)
		}
	}
	t.Logf("froze sshd tree %v", frozen)

	const budget = 2 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), budget)
	start := time.Now()
	h, err := p.Check(ctx)
	took := time.Since(start)
	cancel()
	t.Logf("Check with sshd frozen: %v after %v (health %+v)", err, took.Round(time.Millisecond), h)
	if took > budget+2*time.Second {
		t.Errorf("Check took %v with a %v budget", took, budget)
	}
	if err == nil && h.Reachable {
		t.Error("Check reachable with sshd frozen")
	}
	if err != nil && errs.Code(err) != errs.DeadlineExceeded {
		t.Errorf("Check error code %v, want DeadlineExceeded", errs.Code(err))
	}
	start = time.Now()
	if err := p.Close(); err != nil {
		t.Logf("Close: %v", err)
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("Close took %v with sshd frozen, want under 1s", d)
	}
	thaw()
	q := openT(t, cfg, testr.New(t))
	if h := checkT(t, q); !h.Reachable {
		t.Errorf("Check after SIGCONT: %+v", h)
	}
}

// TestIntegrationSpans: every libvirt batch makes a kvm2.libvirt.* span with
// the domain, and Create's span names the overlay volume.
func TestIntegrationSpans(t *testing.T) {
	e := newLifecycleEnv(t)
	p, rec, _ := tracedProvider(t, e)
	ctx := ctxT(t)
	spec := egressproxy.Spec{Name: "traced", UID: "uid-t"}
	if _, err := p.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Get(ctx, spec.Ref()); err != nil {
		t.Fatal(err)
	}
	if err := p.Delete(ctx, spec.Ref()); err != nil {
		t.Fatal(err)
	}
	attrs := map[string]map[string]string{}
	for _, s := range rec.Ended() {
		m := map[string]string{}
		for _, kv := range s.Attributes() {
			m[string(kv.Key)] = kv.Value.String()
		}
		attrs[s.Name()] = m
	}
	dn := domainName(e.cfg.Entry, "traced")
	for _, want := range []struct{ span, key, val string }{
		{"kvm2.Create", "egressproxy.volume", overlayVolume(dn)},
		{"kvm2.libvirt.Create", "kvm2.domain", dn},
		{"kvm2.libvirt.Get", "kvm2.domain", dn},
		{"kvm2.libvirt.InterfaceAddresses", "kvm2.domain", dn},
		{"kvm2.libvirt.Delete", "kvm2.domain", dn},
	} {
		if got := attrs[want.span][want.key]; got != want.val {
			t.Errorf("span %s attribute %s = %q, want %q (spans: %v)", want.span, want.key, got, want.val, attrs)
		}
	}
}
