package health

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// echoServer serves a loopback TCP target that echoes every line back.
func echoServer(tb testing.TB) string {
	tb.Helper()
	return startFake(tb, func(c net.Conn) { io.Copy(c, c) }).addr
}

// lineExchange writes "ping\n" through the tunnel and expects "ping\n" back.
func lineExchange(ctx context.Context, c net.Conn) error {
	if _, err := io.WriteString(c, "ping\n"); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if line != "ping\n" {
		return errors.New("unexpected echo " + line)
	}
	return nil
}

func TestProbeClassifies(t *testing.T) {
	t.Parallel()
	const target = "example.test:443"
	short := 300 * time.Millisecond
	tests := []struct {
		name   string
		proxy  func(t *testing.T) string // returns the proxy address
		target string
		opts   ProbeOptions
		ok     bool
		kind   Kind
		code   int
		op     string
	}{
		{name: "200", proxy: fake(reply("HTTP/1.1 200 Connection established\r\n\r\n")), ok: true, code: 200},
		{name: "204 with headers and LF endings", proxy: fake(reply("HTTP/1.0 204 OK\nVia: x\nX-Long: " + strings.Repeat("a", 3000) + "\n\n")), ok: true, code: 204},
		{name: "interim 100 then 200", proxy: fake(reply("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\n")), ok: true, code: 200},
		{name: "refused", proxy: func(t *testing.T) string { return closedAddr(t) }, kind: KindRefused, op: "dial"},
		{name: "timeout no answer", proxy: fake(nil), opts: ProbeOptions{Timeout: short}, kind: KindTimeout, op: "read"},
		{name: "malformed status line", proxy: fake(reply("HTTP/1.1 2OO OK\r\n\r\n")), kind: KindMalformed, op: "read"},
		{name: "not http", proxy: fake(reply("SSH-2.0-OpenSSH_9.2\r\n")), kind: KindMalformed, op: "read"},
		{name: "truncated head", proxy: fake(replyClose("HTTP/1.1 200 OK\r\nVia: x\r\n")), kind: KindMalformed, op: "read"},
		{name: "closed without answer", proxy: fake(replyClose("")), kind: KindNetwork, op: "read"},
		{name: "407", proxy: fake(reply("HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=\"p\"\r\nContent-Length: 5\r\n\r\nhello")), kind: KindAuthRequired, code: 407, op: "read"},
		{name: "403", proxy: fake(reply("HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")), kind: KindProxyStatus, code: 403, op: "read"},
		{name: "503 without reason", proxy: fake(reply("HTTP/1.1 503\r\n\r\n")), kind: KindProxyStatus, code: 503, op: "read"},
		{name: "101 is not success", proxy: fake(reply("HTTP/1.1 101 Switching Protocols\r\n\r\n")), kind: KindProxyStatus, code: 101, op: "read"},
		{name: "200 then dead tunnel, TLS proof", proxy: fake(replyClose("HTTP/1.1 200 Connection established\r\n\r\n")),
			opts: ProbeOptions{TLS: &tls.Config{}}, kind: KindTunnelFailed, code: 200, op: "tunnel"},
		{name: "200 then dead tunnel, exchange proof", proxy: fake(replyClose("HTTP/1.1 200 Connection established\r\n\r\n")),
			opts: ProbeOptions{Exchange: lineExchange}, kind: KindTunnelFailed, code: 200, op: "tunnel"},
		{name: "200 then silent tunnel, exchange proof", proxy: fake(reply("HTTP/1.1 200 Connection established\r\n\r\n")),
			opts: ProbeOptions{Exchange: lineExchange, Timeout: short}, kind: KindTunnelFailed, code: 200, op: "tunnel"},
		{name: "bytes after head reach the exchange", proxy: fake(reply("HTTP/1.1 200 OK\r\n\r\nping\n")),
			opts: ProbeOptions{Exchange: func(ctx context.Context, c net.Conn) error {
				line, err := bufio.NewReader(c).ReadString('\n')
				if err != nil || line != "ping\n" {
					return errors.New("buffered bytes lost")
				}
				return nil
			}}, ok: true, code: 200},
		{name: "dns", proxy: func(*testing.T) string { return "proxy.example.test:3128" },
			opts: ProbeOptions{DialContext: (&net.Dialer{Resolver: &net.Resolver{PreferGo: true,
				Dial: func(context.Context, string, string) (net.Conn, error) { return nil, errors.New("no DNS in tests") }}}).DialContext},
			kind: KindDNS, op: "dial"},
		{name: "dial timeout", proxy: func(*testing.T) string { return "192.0.2.1:3128" },
			opts: ProbeOptions{Timeout: short, DialContext: blockingDialer{}.DialContext}, kind: KindTimeout, op: "dial"},
		{name: "bad proxy address", proxy: func(*testing.T) string { return "no-port" }, kind: KindBadInput, op: "input"},
		{name: "empty proxy address", proxy: func(*testing.T) string { return "" }, kind: KindBadInput, op: "input"},
		{name: "target with CRLF", proxy: fake(nil), target: "a:1\r\nX: y", kind: KindBadInput, op: "input"},
		{name: "target without port", proxy: fake(nil), target: "example.test", kind: KindBadInput, op: "input"},
		{name: "username with colon", proxy: fake(nil), opts: ProbeOptions{Username: "a:b"}, kind: KindBadInput, op: "input"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			proxy := tt.proxy(t)
			tgt := tt.target
			if tgt == "" {
				tgt = target
			}
			opts := tt.opts
			start := time.Now()
			res := Probe(context.Background(), proxy, tgt, &opts)
			if time.Since(start) > 5*time.Second {
				t.Errorf("probe took %v", time.Since(start))
			}
			if res.OK != tt.ok || res.Kind != tt.kind || res.StatusCode != tt.code {
				t.Fatalf("got ok=%v kind=%v code=%d err=%v; want ok=%v kind=%v code=%d",
					res.OK, res.Kind, res.StatusCode, res.Err, tt.ok, tt.kind, tt.code)
			}
			if tt.ok {
				if res.Err != nil {
					t.Fatalf("ok result with error %v", res.Err)
				}
				if res.Connect <= 0 || res.FirstByte < res.Connect || res.Total < res.FirstByte {
					t.Fatalf("latencies not ordered: connect %v first byte %v total %v", res.Connect, res.FirstByte, res.Total)
				}
				return
			}
			var pe *ProbeError
			if !errors.As(res.Err, &pe) || pe.Kind != tt.kind || pe.Op != tt.op || pe.StatusCode != tt.code {
				t.Fatalf("error %#v: want a *ProbeError of kind %v, op %q, code %d", res.Err, tt.kind, tt.op, tt.code)
			}
			if res.Total <= 0 {
				t.Fatalf("Total not measured: %v", res.Total)
			}
		})
	}
}

// blockingDialer never connects: it waits for the dial context to end.
type blockingDialer struct{}

func (blockingDialer) DialContext(ctx context.Context, _, _ string) (net.Conn, error) {
	<-ctx.Done()
	return nil, &net.OpError{Op: "dial", Net: "tcp", Err: ctx.Err()}
}

func fake(handle func(net.Conn)) func(t *testing.T) string {
	return func(t *testing.T) string { return startFake(t, handle).addr }
}

func TestProbeTunnelProofThroughRealTunnel(t *testing.T) {
	t.Parallel()
	proxy := startFake(t, tunnel("", "")).addr
	srv := httptest.NewTLSServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	t.Cleanup(srv.Close)
	pool := srv.Client().Transport.(*http.Transport).TLSClientConfig.RootCAs
	tests := []struct {
		name   string
		target string
		opts   ProbeOptions
		ok     bool
		kind   Kind
	}{
		{name: "tls handshake", target: srv.Listener.Addr().String(), opts: ProbeOptions{TLS: &tls.Config{RootCAs: pool}}, ok: true},
		{name: "tls wrong name", target: srv.Listener.Addr().String(), opts: ProbeOptions{TLS: &tls.Config{RootCAs: pool, ServerName: "other.test"}}, kind: KindTunnelFailed},
		{name: "tls then exchange", target: srv.Listener.Addr().String(), opts: ProbeOptions{TLS: &tls.Config{RootCAs: pool},
			Exchange: func(ctx context.Context, c net.Conn) error {
				if _, ok := c.(*tls.Conn); !ok {
					return errors.New("exchange did not get the TLS connection")
				}
				_, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
				if err != nil {
					return err
				}
				resp, err := http.ReadResponse(bufio.NewReader(c), nil)
				if err != nil {
					return err
				}
				resp.Body.Close()
				if resp.StatusCode != 200 {
					return errors.New(resp.Status)
				}
				return nil
			}}, ok: true},
		{name: "echo exchange", target: echoServer(t), opts: ProbeOptions{Exchange: lineExchange}, ok: true},
		{name: "unreachable target", target: closedAddr(t), kind: KindProxyStatus},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res := Probe(context.Background(), proxy, tt.target, &tt.opts)
			if res.OK != tt.ok || res.Kind != tt.kind {
				t.Fatalf("got ok=%v kind=%v err=%v; want ok=%v kind=%v", res.OK, res.Kind, res.Err, tt.ok, tt.kind)
			}
		})
	}
}

func TestProbeCredentials(t *testing.T) {
	t.Parallel()
	proxy := startFake(t, tunnel("alice", "s3cret:with colon")).addr
	target := echoServer(t)
	tests := []struct {
		name       string
		user, pass string
		ok         bool
		kind       Kind
	}{
		{name: "none", kind: KindAuthRequired},
		{name: "wrong", user: "alice", pass: "nope", kind: KindAuthRequired},
		{name: "right", user: "alice", pass: "s3cret:with colon", ok: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res := Probe(context.Background(), proxy, target, &ProbeOptions{Username: tt.user, Password: tt.pass, Exchange: lineExchange})
			if res.OK != tt.ok || res.Kind != tt.kind {
				t.Fatalf("got ok=%v kind=%v err=%v; want ok=%v kind=%v", res.OK, res.Kind, res.Err, tt.ok, tt.kind)
			}
		})
	}
}

func TestProbeHonoursContext(t *testing.T) {
	t.Parallel()
	silent := startFake(t, nil).addr
	silentTunnel := startFake(t, reply("HTTP/1.1 200 OK\r\n\r\n")).addr
	blockExchange := func(ctx context.Context, c net.Conn) error {
		_, err := c.Read(make([]byte, 1))
		return err
	}
	tests := []struct {
		name   string
		proxy  string
		opts   ProbeOptions
		ctx    func() (context.Context, context.CancelFunc)
		kind   Kind
		cancel time.Duration // cancel after this long (0: never)
	}{
		{name: "canceled while waiting for the answer", proxy: silent, opts: ProbeOptions{Timeout: time.Hour},
			ctx: func() (context.Context, context.CancelFunc) { return context.WithCancel(context.Background()) }, cancel: 50 * time.Millisecond, kind: KindCanceled},
		{name: "canceled during the tunnel proof", proxy: silentTunnel, opts: ProbeOptions{Timeout: time.Hour, Exchange: blockExchange},
			ctx: func() (context.Context, context.CancelFunc) { return context.WithCancel(context.Background()) }, cancel: 50 * time.Millisecond, kind: KindCanceled},
		{name: "context deadline shorter than timeout", proxy: silent, opts: ProbeOptions{Timeout: time.Hour},
			ctx: func() (context.Context, context.CancelFunc) {
				return context.WithTimeout(context.Background(), 50*time.Millisecond)
			}, kind: KindTimeout},
		{name: "negative timeout leaves only the context", proxy: silent, opts: ProbeOptions{Timeout: -1},
			ctx: func() (context.Context, context.CancelFunc) {
				return context.WithTimeout(context.Background(), 50*time.Millisecond)
			}, kind: KindTimeout},
		{name: "already canceled: nothing dialed", proxy: closedAddr(t),
			ctx: func() (context.Context, context.CancelFunc) {
				ctx, cancel := context.WithCancel(context.Background())
				cancel()
				return ctx, cancel
			}, kind: KindCanceled},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := tt.ctx()
			defer cancel()
			if tt.cancel > 0 {
				timer := time.AfterFunc(tt.cancel, cancel)
				defer timer.Stop()
			}
			start := time.Now()
			res := Probe(ctx, tt.proxy, "example.test:443", &tt.opts)
			if d := time.Since(start); d > 5*time.Second {
				t.Fatalf("probe returned after %v", d)
			}
			if res.Kind != tt.kind || res.OK {
				t.Fatalf("got ok=%v kind=%v err=%v; want kind=%v", res.OK, res.Kind, res.Err, tt.kind)
			}
		})
	}
}

func TestKindStrings(t *testing.T) {
	t.Parallel()
	seen := map[string]Kind{}
	for k := KindNone; k < kindCount; k++ {
		s := k.String()
		if s == "" || strings.HasPrefix(s, "kind(") {
			t.Errorf("Kind %d has no name", k)
		}
		if prev, dup := seen[s]; dup {
			t.Errorf("Kinds %d and %d share the name %q", prev, k, s)
		}
		seen[s] = k
	}
	if got := Kind(200).String(); got != "kind(200)" {
		t.Errorf("unknown kind string %q", got)
	}
}
