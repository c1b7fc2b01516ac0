package sshconn

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/internal/testing/sshtest"
	"go.uber.org/goleak"
	"golang.org/x/crypto/ssh"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func newPool(t *testing.T, cfg Config) *Pool {
	t.Helper()
	p, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func TestValidate(t *testing.T) {
	t.Parallel()
	ok := Config{Addr: "127.0.0.1:22", User: "root", KeyFile: "/k", KnownHostsFile: "/kh"}
	tests := []struct {
		name  string
		edit  func(*Config)
		field string // "" = valid
	}{
		{"valid", func(*Config) {}, ""},
		{"no addr", func(c *Config) { c.Addr = "" }, "Addr"},
		{"addr without port", func(c *Config) { c.Addr = "host" }, "Addr"},
		{"addr bad port", func(c *Config) { c.Addr = "host:99999" }, "Addr"},
		{"addr empty host", func(c *Config) { c.Addr = ":22" }, "Addr"},
		{"no user", func(c *Config) { c.User = "" }, "User"},
		{"no key", func(c *Config) { c.KeyFile = "" }, "KeyFile"},
		{"no known_hosts", func(c *Config) { c.KnownHostsFile = "" }, "KnownHostsFile"},
		{"negative dial timeout", func(c *Config) { c.DialTimeout = -1 }, "DialTimeout"},
		{"negative keepalive", func(c *Config) { c.KeepaliveInterval = -1 }, "KeepaliveInterval"},
		{"negative count", func(c *Config) { c.KeepaliveCount = -1 }, "KeepaliveCount"},
		{"negative backoff", func(c *Config) { c.MaxRedialBackoff = -1 }, "MaxRedialBackoff"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := ok
			tc.edit(&c)
			err := c.Validate()
			if tc.field == "" {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate accepted %+v", c)
			}
			if KindOf(err) != KindConfig {
				t.Errorf("kind %v, want %v", KindOf(err), KindConfig)
			}
			if !strings.Contains(err.Error(), tc.field+":") {
				t.Errorf("error %q does not name field %s", err, tc.field)
			}
			if _, nerr := New(c); KindOf(nerr) != KindConfig {
				t.Errorf("New accepted invalid config: %v", nerr)
			}
		})
	}
}

// FuzzValidate: Validate never panics, and whatever it accepts has every
// required field and a usable host:port.
func FuzzValidate(f *testing.F) {
	f.Add("127.0.0.1:22", "root", "/k", "/kh", int64(0), 0)
	f.Add("host", "", "", "", int64(-1), -1)
	f.Add("[::1]:65536", "u", "k", "kh", int64(5), 3)
	f.Fuzz(func(t *testing.T, addr, user, key, kh string, d int64, n int) {
		c := Config{Addr: addr, User: user, KeyFile: key, KnownHostsFile: kh,
			DialTimeout: time.Duration(d), KeepaliveInterval: time.Duration(d), KeepaliveCount: n}
		err := c.Validate()
		if err != nil {
			if KindOf(err) != KindConfig {
				t.Fatalf("kind %v", KindOf(err))
			}
			return
		}
		if user == "" || key == "" || kh == "" || d < 0 || n < 0 {
			t.Fatalf("accepted %+v", c)
		}
		if _, _, err := net.SplitHostPort(addr); err != nil {
			t.Fatalf("accepted addr %q: %v", addr, err)
		}
	})
}

func TestKindString(t *testing.T) {
	t.Parallel()
	seen := map[string]bool{}
	for k := KindUnknown; k <= KindClosed; k++ {
		s := k.String()
		if s == "" || seen[s] || strings.HasPrefix(s, "Kind(") {
			t.Errorf("bad or duplicate name %q for %d", s, int(k))
		}
		seen[s] = true
	}
	if KindOf(errors.New("x")) != KindUnknown || KindOf(nil) != KindUnknown {
		t.Error("KindOf of a foreign error is not KindUnknown")
	}
}

func TestDialErrors(t *testing.T) {
	f := newFixture(t)
	other := sshtest.Signer(t, sshtest.GenEd25519(t)).PublicKey()
	closedPort := func() string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		a := ln.Addr().String()
		_ = ln.Close()
		return a
	}()
	tests := []struct {
		name      string
		edit      func(*Config)
		want      Kind
		noNetwork bool
	}{
		{"ok", func(*Config) {}, KindUnknown, false},
		{"unknown host", func(c *Config) {
			c.KnownHostsFile = sshtest.WriteKnownHosts(t, f.dir, "kh-other-host", "10.9.9.9:22", f.srv.HostKeys[0].PublicKey())
		}, KindHostUnknown, false},
		{"empty known_hosts", func(c *Config) {
			c.KnownHostsFile = sshtest.WriteKnownHosts(t, f.dir, "kh-empty", f.srv.Addr)
		}, KindHostUnknown, false},
		{"missing known_hosts", func(c *Config) {
			c.KnownHostsFile = filepath.Join(f.dir, "nope")
		}, KindHostUnknown, true},
		{"host key mismatch", func(c *Config) {
			c.KnownHostsFile = sshtest.WriteKnownHosts(t, f.dir, "kh-mismatch", f.srv.Addr, other)
		}, KindHostKeyMismatch, false},
		{"missing key file", func(c *Config) { c.KeyFile = filepath.Join(f.dir, "missing") }, KindKeyUnreadable, true},
		{"garbage key file", func(c *Config) {
			p := filepath.Join(f.dir, "garbage")
			if err := os.WriteFile(p, []byte("not a key"), 0o600); err != nil {
				t.Fatal(err)
			}
			c.KeyFile = p
		}, KindKeyUnreadable, true},
		{"auth refused", func(c *Config) { c.KeyFile = sshtest.WriteKey(t, f.dir, "unauthorized", sshtest.GenEd25519(t)) }, KindAuthRefused, false},
		{"unreachable", func(c *Config) {
			c.Addr = closedPort
			c.KnownHostsFile = sshtest.WriteKnownHosts(t, f.dir, "kh-closed", closedPort, f.srv.HostKeys[0].PublicKey())
		}, KindUnreachable, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := f.config()
			tc.edit(&cfg)
			p := newPool(t, cfg)
			before := f.srv.Accepts()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			c, err := p.Client(ctx)
			if tc.want == KindUnknown {
				if err != nil {
					t.Fatalf("Client: %v", err)
				}
				if _, _, err := c.SendRequest("keepalive@openssh.com", true, nil); err != nil {
					t.Fatalf("request on the client: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("Client succeeded")
			}
			if got := KindOf(err); got != tc.want {
				t.Fatalf("kind %v, want %v (err: %v)", got, tc.want, err)
			}
			if (tc.want == KindHostUnknown || tc.want == KindHostKeyMismatch) && !tc.noNetwork &&
				!strings.Contains(err.Error(), "SHA256:") {
				t.Errorf("host key error does not show the presented key: %v", err)
			}
			if tc.noNetwork && f.srv.Accepts() != before {
				t.Errorf("the server was contacted although the failure is local")
			}
			if !p.Dead() {
				t.Errorf("Dead() false after a failed dial")
			}
			if _, err := p.Dedicated(ctx); KindOf(err) != tc.want {
				t.Errorf("Dedicated kind %v, want %v", KindOf(err), tc.want)
			}
		})
	}
}

// A server offering ecdsa first and ed25519 must be accepted when
// known_hosts pins only the ed25519 key (and vice versa).
func TestHostKeyAlgorithmFromKnownHosts(t *testing.T) {
	ec := sshtest.Signer(t, sshtest.GenECDSA(t))
	ed := sshtest.Signer(t, sshtest.GenEd25519(t))
	f := newFixture(t, ec, ed)
	for _, tc := range []struct {
		name string
		pin  ssh.PublicKey
	}{{"ed25519", ed.PublicKey()}, {"ecdsa", ec.PublicKey()}} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := f.config()
			cfg.KnownHostsFile = sshtest.WriteKnownHosts(t, f.dir, "kh-"+tc.name, f.srv.Addr, tc.pin)
			p := newPool(t, cfg)
			if _, err := p.Client(context.Background()); err != nil {
				t.Fatalf("Client: %v", err)
			}
		})
	}
}

func TestForbiddenChannel(t *testing.T) {
	f := newFixture(t)
	lv := startLibvirtd(t, "h")
	f.srv.Refuse(lv.Path)
	p := newPool(t, f.config())
	ctx := context.Background()
	_, err := p.DialUnix(ctx, lv.Path)
	if KindOf(err) != KindForbidden {
		t.Fatalf("kind %v, want forbidden (err: %v)", KindOf(err), err)
	}
	var oce *ssh.OpenChannelError
	if !errors.As(err, &oce) {
		t.Errorf("error does not wrap *ssh.OpenChannelError: %v", err)
	}
	// OpenSSH refuses a socket nobody listens on the same way (a libvirtd
	// restarting): the text names both causes.
	if !strings.Contains(err.Error(), "not running") {
		t.Errorf("error %q does not say the daemon may not be running", err)
	}
	if p.Dead() {
		t.Error("a refused channel marked the link dead")
	}
	// A missing socket is refused the same way by the server.
	if _, err := p.DialUnix(ctx, lv.Path+".missing"); KindOf(err) != KindForbidden {
		t.Errorf("missing socket: kind %v", KindOf(err))
	}
}

func TestKeepaliveDeclaresDeadWhenFrozen(t *testing.T) {
	const iv, count = 100 * time.Millisecond, 3
	f := newFixture(t)
	cfg := f.config()
	cfg.KeepaliveInterval, cfg.KeepaliveCount = iv, count
	p := newPool(t, cfg)
	c1, err := p.Client(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * iv)
	if p.Dead() {
		t.Fatal("healthy link declared dead")
	}
	if f.srv.Keepalives() < 2 {
		t.Errorf("server saw %d keepalives in %v", f.srv.Keepalives(), 3*iv)
	}
	f.srv.Freeze()
	frozenAt := time.Now()
	for !p.Dead() {
		if time.Since(frozenAt) > 10*iv*count {
			t.Fatalf("not dead %v after freezing", time.Since(frozenAt))
		}
		time.Sleep(5 * time.Millisecond)
	}
	detect := time.Since(frozenAt)
	t.Logf("dead %v after freeze (limit %v)", detect, iv*count)
	if detect > iv*count+time.Second {
		t.Errorf("dead after %v, want within %v (+slack)", detect, iv*count)
	}
	// The dead client fails fast; the pool redials once the server answers.
	if _, err := c1.Dial("unix", "/nonexistent"); err == nil {
		t.Error("dead client still dials")
	}
	f.srv.Thaw()
	c2, err := p.Client(context.Background())
	if err != nil {
		t.Fatalf("redial: %v", err)
	}
	if c2 == c1 {
		t.Error("redial returned the dead client")
	}
	if p.Dead() {
		t.Error("Dead() true after redial")
	}
}

func TestCloseWithFrozenServer(t *testing.T) {
	f := newFixture(t)
	lvd := startLibvirtd(t, "h")
	p := newPool(t, f.config())
	l := NewLibvirt(p, LibvirtConfig{Socket: lvd.Path})
	if err := l.Do(context.Background(), func(*libvirt.Libvirt) error { return nil }); err != nil {
		t.Fatal(err)
	}
	d, err := l.Dedicated(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	f.srv.Freeze()
	defer f.srv.Thaw()
	start := time.Now()
	_ = l.Close()
	_ = d.Close()
	_ = p.Close()
	el := time.Since(start)
	t.Logf("Libvirt.Close+DedicatedConn.Close+Pool.Close with a frozen server: %v", el)
	if el > 3*time.Second {
		t.Errorf("closing took %v with a frozen server", el)
	}
	if _, err := p.Client(context.Background()); KindOf(err) != KindClosed {
		t.Errorf("Client after Close: %v", err)
	}
	if err := l.Do(context.Background(), func(*libvirt.Libvirt) error { return nil }); KindOf(err) != KindClosed {
		t.Errorf("Do after Close: %v", err)
	}
	if !p.Dead() || !l.Dead() {
		t.Error("closed pool/libvirt not Dead")
	}
}

func TestPoolCloseFrozenReturnsFast(t *testing.T) {
	f := newFixture(t)
	p := newPool(t, f.config())
	if _, err := p.Client(context.Background()); err != nil {
		t.Fatal(err)
	}
	f.srv.Freeze()
	defer f.srv.Thaw()
	start := time.Now()
	if err := p.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if el := time.Since(start); el > time.Second {
		t.Errorf("Close took %v", el)
	}
}

func TestRedialAfterDeath(t *testing.T) {
	tests := []struct {
		name string
		kill func(*fixture, *Pool)
	}{
		{"Kill", func(_ *fixture, p *Pool) { p.Kill(errors.New("test")) }},
		{"server drops connection", func(f *fixture, _ *Pool) { f.srv.DropAll() }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			p := newPool(t, f.config())
			c1, err := p.Client(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			tc.kill(f, p)
			deadline := time.Now().Add(5 * time.Second)
			for !p.Dead() && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond)
			}
			if !p.Dead() {
				t.Fatal("link not dead")
			}
			start := time.Now()
			c2, err := p.Client(context.Background())
			if err != nil {
				t.Fatalf("redial: %v", err)
			}
			t.Logf("redial took %v", time.Since(start))
			if c1 == c2 {
				t.Fatal("same client after death")
			}
			if _, _, err := c2.SendRequest("keepalive@openssh.com", true, nil); err != nil {
				t.Fatalf("new client: %v", err)
			}
			if got := f.srv.Accepts(); got != 2 {
				t.Errorf("server accepted %d connections, want 2", got)
			}
		})
	}
}

// Failed dials are spaced by the backoff: calls arriving during the backoff
// whose deadline ends before it fail at once with the latest dial error,
// without contacting the server; a call that can wait waits it out and
// dials again. No assertion depends on the scheduler being fast: the first
// dial has a generous deadline, the backoff (10s) dwarfs the quick calls'
// deadlines (1s), and the wait-out case shortens the backoff by hand.
func TestRedialBackoff(t *testing.T) {
	f := newFixture(t)
	cfg := f.config()
	cfg.KeyFile = sshtest.WriteKey(t, f.dir, "unauthorized", sshtest.GenEd25519(t))
	cfg.MaxRedialBackoff = 10 * time.Second
	p := newPool(t, cfg)
	p.mu.Lock()
	p.failures = 10 // the next failed dial backs off MaxRedialBackoff
	p.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := p.Client(ctx); KindOf(err) != KindAuthRefused {
		t.Fatalf("first call: kind %v (err %v)", KindOf(err), err)
	}
	for i := range 4 {
		qctx, qcancel := context.WithTimeout(context.Background(), time.Second)
		_, err := p.Client(qctx)
		qcancel()
		if KindOf(err) != KindAuthRefused || !strings.Contains(err.Error(), "backing off") {
			t.Fatalf("call %d during the backoff: kind %v (err %v)", i, KindOf(err), err)
		}
	}
	if got := f.srv.Accepts(); got != 1 {
		t.Errorf("server contacted %d times by 5 calls within one backoff, want 1", got)
	}
	// A call that can wait waits the backoff out and dials again.
	p.mu.Lock()
	p.retryAt = time.Now().Add(200 * time.Millisecond)
	p.mu.Unlock()
	if _, err := p.Client(ctx); KindOf(err) != KindAuthRefused {
		t.Fatalf("kind %v", KindOf(err))
	}
	if got := f.srv.Accepts(); got != 2 {
		t.Errorf("server contacted %d times, want 2", got)
	}
}

func TestDialUnixCtxCancelWhenFrozen(t *testing.T) {
	f := newFixture(t)
	lvd := startLibvirtd(t, "h")
	p := newPool(t, f.config())
	if _, err := p.Client(context.Background()); err != nil {
		t.Fatal(err)
	}
	f.srv.Freeze()
	defer f.srv.Thaw()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := p.DialUnix(ctx, lvd.Path)
	if !errors.Is(err, context.DeadlineExceeded) || KindOf(err) != KindUnreachable {
		t.Fatalf("err %v (kind %v)", err, KindOf(err))
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Errorf("DialUnix returned after %v", el)
	}
}

func newLibvirt(t *testing.T, f *fixture, lvd *fakeLibvirtd, edit func(*Config)) (*Pool, *Libvirt) {
	t.Helper()
	cfg := f.config()
	if edit != nil {
		edit(&cfg)
	}
	p := newPool(t, cfg)
	l := NewLibvirt(p, LibvirtConfig{Socket: lvd.Path, URI: "test:///default"})
	t.Cleanup(func() { _ = l.Close() })
	return p, l
}

func hostname(ctx context.Context, l *Libvirt) (string, error) {
	var h string
	err := l.Do(ctx, func(v *libvirt.Libvirt) error {
		var err error
		h, err = v.ConnectGetHostname()
		return err
	})
	if err != nil {
		return "", err // an abandoned fn may still write h
	}
	return h, nil
}

func TestLibvirtDo(t *testing.T) {
	f := newFixture(t)
	lvd := startLibvirtd(t, "hyper-1")
	_, l := newLibvirt(t, f, lvd, nil)
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
	f := newFixture(t)
	lvd := startLibvirtd(t, "h")
	f.srv.Refuse(lvd.Path)
	_, l := newLibvirt(t, f, lvd, nil)
	_, err := hostname(context.Background(), l)
	if KindOf(err) != KindForbidden {
		t.Fatalf("kind %v (err %v)", KindOf(err), err)
	}
}

func TestLibvirtDoCtxLibvirtdHangs(t *testing.T) {
	f := newFixture(t)
	lvd := startLibvirtd(t, "h")
	p, l := newLibvirt(t, f, lvd, nil)
	if _, err := hostname(context.Background(), l); err != nil {
		t.Fatal(err)
	}
	lvd.hang.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := hostname(ctx, l)
	el := time.Since(start)
	if !errors.Is(err, context.DeadlineExceeded) || KindOf(err) != KindUnreachable {
		t.Fatalf("err %v kind %v", err, KindOf(err))
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
	time.AfterFunc(100*time.Millisecond, ccancel)
	if _, err := hostname(cctx, l); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancel: %v", err)
	}
}

// A caller whose ctx ends on a frozen server returns at once; the shared
// link is torn down by liveness (keepalives unanswered), not by that
// caller's ctx, and the abandoned call's goroutine ends with it.
func TestLibvirtDoCtxServerFrozen(t *testing.T) {
	f := newFixture(t)
	lvd := startLibvirtd(t, "h")
	p, l := newLibvirt(t, f, lvd, func(c *Config) {
		c.KeepaliveInterval = 500 * time.Millisecond
		c.KeepaliveCount = 3
	})
	if _, err := hostname(context.Background(), l); err != nil {
		t.Fatal(err)
	}
	f.srv.Freeze()
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
	deadline := time.Now().Add(10 * time.Second)
	for !(p.Dead() && l.Dead()) && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if !p.Dead() || !l.Dead() {
		t.Fatal("link of a frozen server not declared dead by its keepalives")
	}
	t.Logf("declared dead %v after the freeze", time.Since(start))
	f.srv.Thaw()
	if h, err := hostname(context.Background(), l); err != nil || h != "h" {
		t.Fatalf("after thaw: %q %v", h, err)
	}
	if got := f.srv.Accepts(); got != 2 {
		t.Errorf("accepts %d, want 2 (fresh connection)", got)
	}
}

// A libvirtd restart drops the libvirt connection; the next Do reconnects
// by itself, on the first try.
func TestLibvirtReconnectAfterLibvirtdRestart(t *testing.T) {
	f := newFixture(t)
	lvd := startLibvirtd(t, "h")
	p, l := newLibvirt(t, f, lvd, nil)
	if _, err := hostname(context.Background(), l); err != nil {
		t.Fatal(err)
	}
	lvd.DropAll()
	deadline := time.Now().Add(5 * time.Second)
	for !l.Dead() && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if !l.Dead() {
		t.Fatal("session not seen dead after libvirtd dropped it")
	}
	if p.Dead() {
		t.Error("SSH link dead after a libvirtd restart")
	}
	if h, err := hostname(context.Background(), l); err != nil || h != "h" {
		t.Fatalf("first Do after restart: %q %v", h, err)
	}
	if n := lvd.opens.Load(); n != 2 {
		t.Errorf("opens %d, want 2", n)
	}
	if got := f.srv.Accepts(); got != 1 {
		t.Errorf("accepts %d, want 1 (SSH link reused)", got)
	}
}

// A call that is running when the connection drops fails as unreachable;
// the next one succeeds.
func TestLibvirtCallInterrupted(t *testing.T) {
	f := newFixture(t)
	lvd := startLibvirtd(t, "h")
	_, l := newLibvirt(t, f, lvd, nil)
	if _, err := hostname(context.Background(), l); err != nil {
		t.Fatal(err)
	}
	lvd.hang.Store(true)
	time.AfterFunc(100*time.Millisecond, lvd.DropAll)
	_, err := hostname(context.Background(), l)
	if KindOf(err) != KindUnreachable || !errors.Is(err, libvirt.ErrInterrupted) {
		t.Fatalf("interrupted call: %v (kind %v)", err, KindOf(err))
	}
	lvd.hang.Store(false)
	if _, err := hostname(context.Background(), l); err != nil {
		t.Fatalf("next Do: %v", err)
	}
}

// libvirtd accepting the connection but never answering ConnectOpen: the
// connect is bounded by the Do's ctx too.
func TestLibvirtConnectHangs(t *testing.T) {
	f := newFixture(t)
	lvd := startLibvirtd(t, "h")
	_, l := newLibvirt(t, f, lvd, nil)
	lvd.hangOpen.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := hostname(ctx, l)
	if !errors.Is(err, context.DeadlineExceeded) || KindOf(err) != KindUnreachable {
		t.Fatalf("err %v kind %v", err, KindOf(err))
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
	f := newFixture(t)
	lvd := startLibvirtd(t, "h")
	_, l := newLibvirt(t, f, lvd, nil)
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
	if _, err := d.L.ConnectGetHostname(); err == nil {
		t.Error("call after Close succeeded")
	}

	// Kill aborts a blocked call at once.
	d2, err := l.Dedicated(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	lvd.hang.Store(true)
	time.AfterFunc(100*time.Millisecond, d2.Kill)
	start := time.Now()
	if _, err := d2.L.ConnectGetHostname(); err == nil {
		t.Error("blocked call succeeded after Kill")
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Errorf("Kill took %v to abort the call", el)
	}
	_ = d2.Close()
	if got := f.srv.Accepts(); got != 2 {
		t.Errorf("accepts %d, want 2 dedicated connections", got)
	}
}

// An abandoned call whose libvirtd never answers: after ProbeAfter the
// session is probed, the probe goes unanswered too, and the session (not
// the SSH link, whose sshd still answers) is torn down, ending the call's
// goroutine. A libvirtd that answers the probe keeps its session.
func TestLibvirtAbandonedCallProbe(t *testing.T) {
	f := newFixture(t)
	lvd := startLibvirtd(t, "h")
	p := newPool(t, f.config())
	l := NewLibvirt(p, LibvirtConfig{Socket: lvd.Path, URI: "test:///default",
		ProbeAfter: 200 * time.Millisecond, ProbeTimeout: 200 * time.Millisecond})
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
	deadline := time.Now().Add(10 * time.Second)
	for !l.Dead() && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if !l.Dead() {
		t.Fatal("a session whose libvirtd answers nothing was not torn down after its probe")
	}
	if p.Dead() {
		t.Error("the SSH link was killed although closing the channel sufficed")
	}
	lvd.hang.Store(false)
	if h, err := hostname(context.Background(), l); err != nil || h != "h" {
		t.Fatalf("next Do: %q %v", h, err)
	}
}

// silentServer accepts TCP connections and never says anything (a host
// whose sshd hangs before its banner, or a black-holing middlebox).
func silentServer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var conns []net.Conn
	var mu sync.Mutex
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		<-done
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	return ln.Addr().String()
}

// Close ends every call in flight promptly, dials included: against a host
// that accepts TCP and never speaks SSH, a Do, a Dedicated and a Pool.Client
// blocked in the handshake return within a second of Close with KindClosed,
// not at their dial timeout.
func TestCloseEndsDialsInFlight(t *testing.T) {
	f := newFixture(t)
	addr := silentServer(t)
	for _, closeWhat := range []string{"libvirt", "pool"} {
		t.Run("close "+closeWhat, func(t *testing.T) {
			cfg := f.config()
			cfg.Addr = addr
			cfg.DialTimeout = 30 * time.Second
			p, err := New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			l := NewLibvirt(p, LibvirtConfig{Socket: "/nonexistent", URI: "test:///default"})
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			type result struct {
				what string
				err  error
				at   time.Time
			}
			res := make(chan result, 3)
			go func() { _, err := hostname(ctx, l); res <- result{"Do", err, time.Now()} }()
			go func() {
				d, err := l.Dedicated(ctx)
				if d != nil {
					_ = d.Close()
				}
				res <- result{"Dedicated", err, time.Now()}
			}()
			go func() { _, err := p.Client(ctx); res <- result{"Pool.Client", err, time.Now()} }()
			time.Sleep(300 * time.Millisecond) // all three are in the handshake
			closed := time.Now()
			if closeWhat == "libvirt" {
				_ = l.Close()
				_ = p.Close()
			} else {
				_ = p.Close()
				_ = l.Close()
			}
			for range 3 {
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

// closeOrderConn records, at the first Close of a link's TCP connection,
// whether the link had already been declared dead.
type closeOrderConn struct {
	net.Conn
	once     sync.Once
	deadSeen chan bool // one value: isDead() at the first Close
	isDead   func() bool
}

func (c *closeOrderConn) Close() error {
	c.once.Do(func() { c.deadSeen <- c.isDead() })
	return c.Conn.Close()
}

// The close rule: a link is declared dead (waiters released, and every
// reader that fails afterwards sees it dead, so its error is classified as
// the link's death) before its TCP connection is closed, and that before
// anything that may wait (ssh.Client.Close). Reversing either step in
// link.kill, Pool.Close, Pool.Kill or DedicatedConn.Close fails this test.
func TestCloseOrderDeadBeforeConnClose(t *testing.T) {
	f := newFixture(t)
	lvd := startLibvirtd(t, "h")
	var mu sync.Mutex
	var conns []*closeOrderConn
	testWrapConn = func(c net.Conn) net.Conn {
		oc := &closeOrderConn{Conn: c, deadSeen: make(chan bool, 1)}
		mu.Lock()
		conns = append(conns, oc)
		mu.Unlock()
		return oc
	}
	t.Cleanup(func() { testWrapConn = nil })
	last := func() *closeOrderConn {
		mu.Lock()
		defer mu.Unlock()
		return conns[len(conns)-1]
	}
	check := func(t *testing.T, c *closeOrderConn) {
		t.Helper()
		select {
		case dead := <-c.deadSeen:
			if !dead {
				t.Error("the TCP connection was closed before the link was declared dead")
			}
		case <-time.After(5 * time.Second):
			t.Error("the TCP connection was never closed")
		}
	}
	ctx := context.Background()
	for _, how := range []string{"Pool.Kill", "Pool.Close", "DedicatedConn.Close", "DedicatedConn.Kill"} {
		t.Run(how, func(t *testing.T) {
			p, l := newLibvirt(t, f, lvd, nil)
			var c *closeOrderConn
			link := func(lk *link) {
				c = last()
				c.isDead = lk.isDead
			}
			switch how {
			case "DedicatedConn.Close", "DedicatedConn.Kill":
				d, err := l.Dedicated(ctx)
				if err != nil {
					t.Fatal(err)
				}
				link(d.link)
				if how == "DedicatedConn.Kill" {
					d.Kill()
				}
				_ = d.Close()
			default:
				if _, err := hostname(ctx, l); err != nil {
					t.Fatal(err)
				}
				p.mu.Lock()
				lk := p.cur
				p.mu.Unlock()
				link(lk)
				switch how {
				case "Pool.Kill":
					p.Kill(nil)
				case "Pool.Close":
					_ = p.Close()
				}
			}
			check(t, c)
		})
	}
}

// A host that now presents only a key of another type than the one pinned
// (pinned ed25519, host offers ECDSA only: a rebuilt host, or an
// interception) is a host key mismatch, as OpenSSH reports it ("remote host
// identification has changed"), never a network fault.
func TestHostKeyOfAnotherTypeIsMismatch(t *testing.T) {
	ec := sshtest.Signer(t, sshtest.GenECDSA(t))
	f := newFixture(t, ec) // the server has only an ECDSA host key
	cfg := f.config()
	cfg.KnownHostsFile = sshtest.WriteKnownHosts(t, f.dir, "kh-ed", f.srv.Addr, sshtest.Signer(t, sshtest.GenEd25519(t)).PublicKey())
	p := newPool(t, cfg)
	_, err := p.Client(context.Background())
	if KindOf(err) != KindHostKeyMismatch {
		t.Fatalf("kind %v, want host key mismatch (err %v)", KindOf(err), err)
	}
	t.Logf("%v", err)
	// A host still presenting the pinned type is unaffected.
	f2 := newFixture(t, ec, sshtest.Signer(t, sshtest.GenEd25519(t)))
	cfg2 := f2.config()
	cfg2.KnownHostsFile = sshtest.WriteKnownHosts(t, f2.dir, "kh-ec", f2.srv.Addr, ec.PublicKey())
	if _, err := newPool(t, cfg2).Client(context.Background()); err != nil {
		t.Fatalf("pinned ECDSA on a host with ECDSA and ed25519: %v", err)
	}
}

// A call whose ctx has already ended is not started: its fast reply must
// not win against the caller's cancellation on a loaded machine.
func TestLibvirtDoCancelledBeforeCall(t *testing.T) {
	f := newFixture(t)
	lvd := startLibvirtd(t, "h")
	_, l := newLibvirt(t, f, lvd, nil)
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
