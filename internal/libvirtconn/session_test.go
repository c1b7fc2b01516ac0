package libvirtconn

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy/internal/testing/eventually"
	"github.com/egressproxy/egressproxy/internal/testing/sshtest"
	"github.com/egressproxy/egressproxy/sshconn"
)

func TestLibvirtDo(t *testing.T) {
	f := sshtest.NewFixture(t)
	lvd := startLibvirtd(t, "hyper-1")
	_, l := newSession(t, f, lvd, nil, nil)
	if l.Dead() {
		t.Error("Dead before first use")
	}
	for i := range 3 {
		h, err := hostname(context.Background(), l)
		if err != nil || h != "hyper-1" {
			t.Fatalf("call %d: %q, %v", i, h, err)
		}
	}
	if n := lvd.opens.Load(); n != 1 {
		t.Errorf("libvirt connection opened %d times, want 1 (shared)", n)
	}
	// fn's own errors come back unchanged.
	sentinel := errors.New("mine")
	if err := l.Do(context.Background(), func(*libvirt.Libvirt) error { return sentinel }); err != sentinel {
		t.Errorf("Do returned %v, want fn's error", err)
	}
	if l.Dead() {
		t.Error("fn's error marked the session dead")
	}
}

func TestLibvirtDoForbidden(t *testing.T) {
	f := sshtest.NewFixture(t)
	lvd := startLibvirtd(t, "h")
	f.Server.Refuse(lvd.Path)
	_, l := newSession(t, f, lvd, nil, nil)
	_, err := hostname(context.Background(), l)
	if errKind(err) != sshconn.KindForbidden {
		t.Fatalf("kind %v (err %v)", errKind(err), err)
	}
}

func TestLibvirtDoCtxLibvirtdHangs(t *testing.T) {
	f := sshtest.NewFixture(t)
	lvd := startLibvirtd(t, "h")
	p, l := newSession(t, f, lvd, nil, nil)
	if _, err := hostname(context.Background(), l); err != nil {
		t.Fatal(err)
	}
	lvd.hang.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := hostname(ctx, l)
	el := time.Since(start)
	if !errors.Is(err, context.DeadlineExceeded) || errKind(err) != sshconn.KindUnreachable {
		t.Fatalf("err %v kind %v", err, errKind(err))
	}
	if el > 2*time.Second {
		t.Errorf("Do returned after %v with a 300ms ctx", el)
	}
	// sshd answered the channel close: the SSH link survived.
	if p.Dead() {
		t.Error("the SSH link was killed although closing the channel sufficed")
	}
	lvd.hang.Store(false)
	if h, err := hostname(context.Background(), l); err != nil || h != "h" {
		t.Fatalf("next Do: %q %v", h, err)
	}
	// Cancel (not deadline) is returned wrapped too.
	lvd.hang.Store(true)
	cctx, ccancel := context.WithCancel(context.Background())
	lvd.whenHeld(t, ccancel)
	if _, err := hostname(cctx, l); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancel: %v", err)
	}
}

// A caller whose ctx ends on a frozen server returns at once; the shared
// link is torn down by liveness (keepalives unanswered), not by that
// caller's ctx, and the abandoned call's goroutine ends with it.
func TestLibvirtDoCtxServerFrozen(t *testing.T) {
	f := sshtest.NewFixture(t)
	lvd := startLibvirtd(t, "h")
	p, l := newSession(t, f, lvd, func(c *sshconn.Config) {
		c.KeepaliveInterval = 500 * time.Millisecond
		c.KeepaliveCount = 3
	}, nil)
	if _, err := hostname(context.Background(), l); err != nil {
		t.Fatal(err)
	}
	f.Server.Freeze()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := hostname(ctx, l)
	el := time.Since(start)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err %v", err)
	}
	t.Logf("Do with 300ms ctx on a frozen server returned after %v", el)
	if el > 2*time.Second {
		t.Errorf("Do returned after %v", el)
	}
	// Liveness declares the link dead (3 keepalives of 500ms unanswered).
	eventually.True(t, 10*time.Second, func() bool { return p.Dead() && l.Dead() },
		"the link of a frozen server is declared dead by its keepalives")
	t.Logf("declared dead %v after the freeze", time.Since(start))
	f.Server.Thaw()
	if h, err := hostname(context.Background(), l); err != nil || h != "h" {
		t.Fatalf("after thaw: %q %v", h, err)
	}
	if got := f.Server.Accepts(); got != 2 {
		t.Errorf("accepts %d, want 2 (fresh connection)", got)
	}
}

// A libvirtd restart drops the libvirt connection; the next Do reconnects
// by itself, on the first try.
func TestLibvirtReconnectAfterLibvirtdRestart(t *testing.T) {
	f := sshtest.NewFixture(t)
	lvd := startLibvirtd(t, "h")
	p, l := newSession(t, f, lvd, nil, nil)
	if _, err := hostname(context.Background(), l); err != nil {
		t.Fatal(err)
	}
	lvd.DropAll()
	eventually.True(t, 5*time.Second, l.Dead, "the session is seen dead after libvirtd dropped it")
	if p.Dead() {
		t.Error("SSH link dead after a libvirtd restart")
	}
	if h, err := hostname(context.Background(), l); err != nil || h != "h" {
		t.Fatalf("first Do after restart: %q %v", h, err)
	}
	if n := lvd.opens.Load(); n != 2 {
		t.Errorf("opens %d, want 2", n)
	}
	if got := f.Server.Accepts(); got != 1 {
		t.Errorf("accepts %d, want 1 (SSH link reused)", got)
	}
}

// A call that is running when the connection drops fails as unreachable;
// the next one succeeds.
func TestLibvirtCallInterrupted(t *testing.T) {
	f := sshtest.NewFixture(t)
	lvd := startLibvirtd(t, "h")
	_, l := newSession(t, f, lvd, nil, nil)
	if _, err := hostname(context.Background(), l); err != nil {
		t.Fatal(err)
	}
	lvd.hang.Store(true)
	lvd.whenHeld(t, lvd.DropAll)
	_, err := hostname(context.Background(), l)
	if errKind(err) != sshconn.KindUnreachable || !errors.Is(err, libvirt.ErrInterrupted) {
		t.Fatalf("interrupted call: %v (kind %v)", err, errKind(err))
	}
	lvd.hang.Store(false)
	if _, err := hostname(context.Background(), l); err != nil {
		t.Fatalf("next Do: %v", err)
	}
}

// libvirtd accepting the connection but never answering ConnectOpen: the
// connect is bounded by the Do's ctx too.
func TestLibvirtConnectHangs(t *testing.T) {
	f := sshtest.NewFixture(t)
	lvd := startLibvirtd(t, "h")
	_, l := newSession(t, f, lvd, nil, nil)
	lvd.hangOpen.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := hostname(ctx, l)
	if !errors.Is(err, context.DeadlineExceeded) || errKind(err) != sshconn.KindUnreachable {
		t.Fatalf("err %v kind %v", err, errKind(err))
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Errorf("Do returned after %v", el)
	}
	lvd.hangOpen.Store(false)
	if h, err := hostname(context.Background(), l); err != nil || h != "h" {
		t.Fatalf("next Do: %q %v", h, err)
	}
}

func TestLibvirtDedicated(t *testing.T) {
	f := sshtest.NewFixture(t)
	lvd := startLibvirtd(t, "h")
	p, l := newSession(t, f, lvd, nil, nil)
	d, err := l.Dedicated(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if h, err := d.L.ConnectGetHostname(); err != nil || h != "h" {
		t.Fatalf("dedicated call: %q %v", h, err)
	}
	if err := d.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	// Close tears the SSH connection down through the pool's Kill (dead
	// first, then the TCP connection), not by closing the client alone.
	select {
	case <-p.Done(d.client):
	default:
		t.Error("the dedicated SSH connection is not Done when Close returns")
	}
	if _, err := d.L.ConnectGetHostname(); err == nil {
		t.Error("call after Close succeeded")
	}

	// Kill aborts a blocked call at once.
	d2, err := l.Dedicated(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	lvd.hang.Store(true)
	lvd.whenHeld(t, d2.Kill)
	start := time.Now()
	if _, err := d2.L.ConnectGetHostname(); err == nil {
		t.Error("blocked call succeeded after Kill")
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Errorf("Kill took %v to abort the call", el)
	}
	_ = d2.Close()
	if got := f.Server.Accepts(); got != 2 {
		t.Errorf("accepts %d, want 2 dedicated connections", got)
	}
}

// An abandoned call whose libvirtd never answers: after ProbeAfter the
// session is probed, the probe goes unanswered too, and the session (not
// the SSH link, whose sshd still answers) is torn down, ending the call's
// goroutine. A libvirtd that answers the probe keeps its session.
func TestLibvirtAbandonedCallProbe(t *testing.T) {
	f := sshtest.NewFixture(t)
	lvd := startLibvirtd(t, "h")
	p := newPool(t, sshConfig(f))
	l := New(p, Config{Socket: lvd.Path, URI: "test:///default",
		ProbeAfter: 200 * time.Millisecond, ProbeTimeout: 200 * time.Millisecond}, nil)
	t.Cleanup(func() { _ = l.Close() })
	if _, err := hostname(context.Background(), l); err != nil {
		t.Fatal(err)
	}
	lvd.hang.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := hostname(ctx, l); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err %v", err)
	}
	if l.Dead() {
		t.Fatal("session torn down by a caller's deadline")
	}
	eventually.True(t, 10*time.Second, l.Dead, "a session whose libvirtd answers nothing is torn down after its probe")
	if p.Dead() {
		t.Error("the SSH link was killed although closing the channel sufficed")
	}
	lvd.hang.Store(false)
	if h, err := hostname(context.Background(), l); err != nil || h != "h" {
		t.Fatalf("next Do: %q %v", h, err)
	}
}

// A call whose ctx has already ended is not started: its fast reply must
// not win against the caller's cancellation on a loaded machine.
func TestLibvirtDoCancelledBeforeCall(t *testing.T) {
	f := sshtest.NewFixture(t)
	lvd := startLibvirtd(t, "h")
	_, l := newSession(t, f, lvd, nil, nil)
	if _, err := hostname(context.Background(), l); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for range 200 {
		ran := false
		err := l.Do(ctx, func(*libvirt.Libvirt) error { ran = true; return nil })
		if !errors.Is(err, context.Canceled) || ran {
			t.Fatalf("Do with a cancelled ctx: err %v, fn ran %v", err, ran)
		}
	}
}

// With the server frozen, Session.Close, Dedicated.Close and Pool.Close
// return within about a second each; calls after Close fail as closed.
func TestCloseWithFrozenServer(t *testing.T) {
	f := sshtest.NewFixture(t)
	lvd := startLibvirtd(t, "h")
	p, l := newSession(t, f, lvd, nil, nil)
	if _, err := hostname(context.Background(), l); err != nil {
		t.Fatal(err)
	}
	d, err := l.Dedicated(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	f.Server.Freeze()
	defer f.Server.Thaw()
	start := time.Now()
	_ = l.Close()
	_ = d.Close()
	_ = p.Close()
	el := time.Since(start)
	t.Logf("Session.Close+Dedicated.Close+Pool.Close with a frozen server: %v", el)
	if el > 3*time.Second {
		t.Errorf("closing took %v with a frozen server", el)
	}
	if err := l.Do(context.Background(), func(*libvirt.Libvirt) error { return nil }); errKind(err) != sshconn.KindClosed {
		t.Errorf("Do after Close: %v", err)
	}
	if _, err := l.Dedicated(context.Background()); errKind(err) != sshconn.KindClosed {
		t.Errorf("Dedicated after Close: %v", err)
	}
	if !l.Dead() {
		t.Error("closed Session not Dead")
	}
}

// Close ends every call in flight promptly, dials included: against a host
// that accepts TCP and never speaks SSH, a Do and a Dedicated blocked in
// the handshake return within a second of Session.Close (or Pool.Close)
// with an error, not at their dial timeout.
func TestCloseEndsDialsInFlight(t *testing.T) {
	t.Parallel()
	f := sshtest.NewFixture(t)
	for _, closeWhat := range []string{"session", "pool"} {
		t.Run("close "+closeWhat, func(t *testing.T) {
			t.Parallel()
			addr, spoke := sshtest.SilentServer(t)
			cfg := sshConfig(f)
			cfg.Address = addr
			cfg.DialTimeout = 30 * time.Second
			p, err := sshconn.New(cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			l := New(p, Config{Socket: "/nonexistent", URI: "test:///default"}, nil)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			type result struct {
				what string
				err  error
				at   time.Time
			}
			res := make(chan result, 2)
			go func() { _, err := hostname(ctx, l); res <- result{"Do", err, time.Now()} }()
			go func() {
				d, err := l.Dedicated(ctx)
				if d != nil {
					_ = d.Close()
				}
				res <- result{"Dedicated", err, time.Now()}
			}()
			for range 2 { // both are in the handshake
				select {
				case <-spoke:
				case <-time.After(10 * time.Second):
					t.Fatal("the dials never reached the server")
				}
			}
			closed := time.Now()
			if closeWhat == "session" {
				_ = l.Close()
				_ = p.Close()
			} else {
				_ = p.Close()
				_ = l.Close()
			}
			for range 2 {
				select {
				case r := <-res:
					after := r.at.Sub(closed)
					t.Logf("%s returned %v after Close: %v", r.what, after.Round(time.Millisecond), r.err)
					if r.err == nil {
						t.Errorf("%s succeeded against a silent server", r.what)
					}
					if after > time.Second {
						t.Errorf("%s returned %v after Close, want < 1s", r.what, after)
					}
				case <-time.After(10 * time.Second):
					t.Fatal("a call still blocked 10s after Close")
				}
			}
		})
	}
}
