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

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/testing/eventually"
	"github.com/egressproxy/egressproxy/internal/testing/sshtest"
	"go.uber.org/goleak"
	"golang.org/x/crypto/ssh"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func newPool(t *testing.T, cfg Config) *Pool {
	t.Helper()
	return newPoolWith(t, cfg, nil)
}

func newPoolWith(t *testing.T, cfg Config, opts *Options) *Pool {
	t.Helper()
	p, err := New(cfg, opts)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// errKind is the Kind of the *Error in err's chain, or KindUnknown.
func errKind(err error) Kind {
	var e *Error
	if errors.As(err, &e) {
		return e.Kind
	}
	return KindUnknown
}

// fieldsOf lists the fields err's *errs.FieldErrors name, in order.
func fieldsOf(err error) []string {
	var got []string
	for _, fe := range errs.FieldErrors(err) {
		got = append(got, fe.Field)
	}
	return got
}

func TestValidate(t *testing.T) {
	t.Parallel()
	ok := Config{Address: "127.0.0.1:22", User: "root", KeyFile: "/k", KnownHostsFile: "/kh"}
	tests := []struct {
		name  string
		edit  func(*Config)
		field string // "" = valid
	}{
		{"valid", func(*Config) {}, ""},
		{"no address", func(c *Config) { c.Address = "" }, "Address"},
		{"address without port", func(c *Config) { c.Address = "host" }, "Address"},
		{"address bad port", func(c *Config) { c.Address = "host:99999" }, "Address"},
		{"address empty host", func(c *Config) { c.Address = ":22" }, "Address"},
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
			p, err := New(c, nil)
			if tc.field == "" {
				if err != nil {
					t.Fatalf("New: %v", err)
				}
				_ = p.Close()
				return
			}
			if err == nil {
				t.Fatalf("New accepted %+v", c)
			}
			if errKind(err) != KindConfig {
				t.Errorf("kind %v, want %v", errKind(err), KindConfig)
			}
			if got := fieldsOf(err); len(got) != 1 || got[0] != tc.field {
				t.Errorf("fields %v, want [%s] (err %v)", got, tc.field, err)
			}
		})
	}
}

// FuzzValidate: New's validation never panics, and whatever it accepts has
// every required field and a usable host:port.
func FuzzValidate(f *testing.F) {
	f.Add("127.0.0.1:22", "root", "/k", "/kh", int64(0), 0)
	f.Add("host", "", "", "", int64(-1), -1)
	f.Add("[::1]:65536", "u", "k", "kh", int64(5), 3)
	f.Fuzz(func(t *testing.T, addr, user, key, kh string, d int64, n int) {
		c := Config{Address: addr, User: user, KeyFile: key, KnownHostsFile: kh,
			DialTimeout: time.Duration(d), KeepaliveInterval: time.Duration(d), KeepaliveCount: n}
		p, err := New(c, nil)
		if err != nil {
			if errKind(err) != KindConfig {
				t.Fatalf("kind %v", errKind(err))
			}
			return
		}
		_ = p.Close()
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
			c.Address = closedPort
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
			if got := errKind(err); got != tc.want {
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
			if _, err := p.Dedicated(ctx); errKind(err) != tc.want {
				t.Errorf("Dedicated kind %v, want %v", errKind(err), tc.want)
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
	sock := sshtest.UnixSocket(t)
	f.srv.Refuse(sock)
	p := newPool(t, f.config())
	ctx := context.Background()
	c, err := p.Client(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = p.DialUnix(ctx, c, sock)
	if errKind(err) != KindForbidden {
		t.Fatalf("kind %v, want forbidden (err: %v)", errKind(err), err)
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
	if _, err := p.DialUnix(ctx, c, sock+".missing"); errKind(err) != KindForbidden {
		t.Errorf("missing socket: kind %v", errKind(err))
	}
	// The socket itself opens.
	conn, err := p.DialUnix(ctx, c, sshtest.UnixSocket(t))
	if err != nil {
		t.Fatalf("DialUnix: %v", err)
	}
	_ = conn.Close()
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
	// Answered keepalives for longer than the limit keep the link alive.
	eventually.True(t, 10*time.Second, func() bool { return f.srv.Keepalives() > count+1 },
		"the server sees more than %d keepalives", count+1)
	if p.Dead() {
		t.Fatal("healthy link declared dead")
	}
	f.srv.Freeze()
	frozenAt := time.Now()
	select {
	case <-p.Done(c1):
	case <-time.After(10 * iv * count):
		t.Fatalf("not dead %v after freezing", time.Since(frozenAt))
	}
	detect := time.Since(frozenAt)
	if !p.Dead() {
		t.Error("Dead() false although the shared connection is Done")
	}
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

// With the server frozen, Kill of a dedicated connection and Close of the
// pool (with a channel open on the shared connection) return at once, and
// every connection is Done.
func TestCloseWithFrozenServer(t *testing.T) {
	f := newFixture(t)
	sock := sshtest.UnixSocket(t)
	p := newPool(t, f.config())
	ctx := context.Background()
	shared, err := p.Client(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ch, err := p.DialUnix(ctx, shared, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	d1, err := p.Dedicated(ctx)
	if err != nil {
		t.Fatal(err)
	}
	d2, err := p.Dedicated(ctx)
	if err != nil {
		t.Fatal(err)
	}
	f.srv.Freeze()
	defer f.srv.Thaw()
	start := time.Now()
	p.Kill(d1, nil)
	_ = p.Close()
	el := time.Since(start)
	t.Logf("Kill of a dedicated connection and Pool.Close with a frozen server: %v", el)
	if el > 1500*time.Millisecond {
		t.Errorf("closing took %v with a frozen server", el)
	}
	for name, c := range map[string]*ssh.Client{"shared": shared, "killed dedicated": d1, "open dedicated": d2} {
		select {
		case <-p.Done(c):
		default:
			t.Errorf("the %s connection is not Done after Close", name)
		}
	}
	if _, err := p.Client(ctx); errKind(err) != KindClosed {
		t.Errorf("Client after Close: %v", err)
	}
	if _, err := p.Dedicated(ctx); errKind(err) != KindClosed {
		t.Errorf("Dedicated after Close: %v", err)
	}
	if _, err := p.DialUnix(ctx, shared, sock); errKind(err) != KindClosed {
		t.Errorf("DialUnix after Close: %v", err)
	}
	if !p.Dead() {
		t.Error("closed pool not Dead")
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
		kill func(*fixture, *Pool, *ssh.Client)
	}{
		{"Kill", func(_ *fixture, p *Pool, c *ssh.Client) { p.Kill(c, errors.New("test")) }},
		{"server drops connection", func(f *fixture, _ *Pool, _ *ssh.Client) { f.srv.DropAll() }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			p := newPool(t, f.config())
			c1, err := p.Client(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			tc.kill(f, p, c1)
			select {
			case <-p.Done(c1):
			case <-time.After(5 * time.Second):
				t.Fatal("link not dead")
			}
			if !p.Dead() {
				t.Fatal("Dead() false although the shared connection is Done")
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
	if _, err := p.Client(ctx); errKind(err) != KindAuthRefused {
		t.Fatalf("first call: kind %v (err %v)", errKind(err), err)
	}
	for i := range 4 {
		qctx, qcancel := context.WithTimeout(context.Background(), time.Second)
		_, err := p.Client(qctx)
		qcancel()
		if errKind(err) != KindAuthRefused || !strings.Contains(err.Error(), "backing off") {
			t.Fatalf("call %d during the backoff: kind %v (err %v)", i, errKind(err), err)
		}
	}
	if got := f.srv.Accepts(); got != 1 {
		t.Errorf("server contacted %d times by 5 calls within one backoff, want 1", got)
	}
	// A call that can wait waits the backoff out and dials again.
	p.mu.Lock()
	p.retryAt = time.Now().Add(200 * time.Millisecond)
	p.mu.Unlock()
	if _, err := p.Client(ctx); errKind(err) != KindAuthRefused {
		t.Fatalf("kind %v", errKind(err))
	}
	if got := f.srv.Accepts(); got != 2 {
		t.Errorf("server contacted %d times, want 2", got)
	}
}

func TestDialUnixCtxCancelWhenFrozen(t *testing.T) {
	f := newFixture(t)
	sock := sshtest.UnixSocket(t)
	p := newPool(t, f.config())
	c, err := p.Client(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	f.srv.Freeze()
	defer f.srv.Thaw()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = p.DialUnix(ctx, c, sock)
	if !errors.Is(err, context.DeadlineExceeded) || errKind(err) != KindUnreachable {
		t.Fatalf("err %v (kind %v)", err, errKind(err))
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Errorf("DialUnix returned after %v", el)
	}
}

// Close ends every dial in flight promptly: against a host that accepts TCP
// and never speaks SSH, a Client and a Dedicated blocked in the handshake
// return within a second of Close with KindClosed, not at their dial
// timeout.
func TestCloseEndsDialsInFlight(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	addr, spoke := sshtest.SilentServer(t)
	cfg := f.config()
	cfg.Address = addr
	cfg.DialTimeout = 30 * time.Second
	p, err := New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	type result struct {
		what string
		err  error
		at   time.Time
	}
	res := make(chan result, 2)
	go func() { _, err := p.Client(ctx); res <- result{"Client", err, time.Now()} }()
	go func() { _, err := p.Dedicated(ctx); res <- result{"Dedicated", err, time.Now()} }()
	for range 2 { // both are in the handshake
		select {
		case <-spoke:
		case <-time.After(10 * time.Second):
			t.Fatal("the dials never reached the server")
		}
	}
	closed := time.Now()
	_ = p.Close()
	for range 2 {
		select {
		case r := <-res:
			after := r.at.Sub(closed)
			t.Logf("%s returned %v after Close: %v", r.what, after.Round(time.Millisecond), r.err)
			if errKind(r.err) != KindClosed {
				t.Errorf("%s: %v (kind %v), want KindClosed", r.what, r.err, errKind(r.err))
			}
			if after > time.Second {
				t.Errorf("%s returned %v after Close, want < 1s", r.what, after)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a call still blocked 10s after Close")
		}
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
// link.kill, Pool.Close or Pool.Kill fails this test.
func TestCloseOrderDeadBeforeConnClose(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := context.Background()
	for _, how := range []string{"Kill shared", "Kill dedicated", "Close shared", "Close dedicated"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			p := newPool(t, f.config())
			var c *closeOrderConn
			p.wrapConn = func(nc net.Conn) net.Conn { // one dial below
				c = &closeOrderConn{Conn: nc, deadSeen: make(chan bool, 1)}
				return c
			}
			dial := p.Client
			if strings.HasSuffix(how, "dedicated") {
				dial = p.Dedicated
			}
			client, err := dial(ctx)
			if err != nil {
				t.Fatal(err)
			}
			c.isDead = p.lookup(client).isDead
			if strings.HasPrefix(how, "Kill") {
				p.Kill(client, nil)
			} else {
				_ = p.Close()
			}
			select {
			case dead := <-c.deadSeen:
				if !dead {
					t.Error("the TCP connection was closed before the link was declared dead")
				}
			case <-time.After(5 * time.Second):
				t.Error("the TCP connection was never closed")
			}
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
	if errKind(err) != KindHostKeyMismatch {
		t.Fatalf("kind %v, want host key mismatch (err %v)", errKind(err), err)
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
