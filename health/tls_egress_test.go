package health

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// testCert returns a certificate for 127.0.0.1 (httptest's) and the pool
// that trusts it.
func testCert(t *testing.T) (tls.Certificate, *x509.CertPool) {
	t.Helper()
	s := httptest.NewTLSServer(http.NotFoundHandler())
	defer s.Close()
	roots := x509.NewCertPool()
	roots.AddCert(s.Certificate())
	return s.TLS.Certificates[0], roots
}

// tlsTunnel is tunnel behind a TLS handshake with cert.
func tlsTunnel(cert tls.Certificate, user, pass string) func(net.Conn) {
	inner := tunnel(user, pass)
	return func(c net.Conn) {
		tc := tls.Server(c, &tls.Config{Certificates: []tls.Certificate{cert}})
		if err := tc.Handshake(); err != nil {
			return
		}
		inner(tc)
	}
}

func TestProbeProxyTLS(t *testing.T) {
	cert, roots := testCert(t)
	target := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok") }))
	defer target.Close()
	addr := strings.TrimPrefix(target.URL, "http://")
	secure := startFake(t, tlsTunnel(cert, "u", "p"))
	plain := startFake(t, tunnel("", ""))
	silent := startFake(t, nil) // accepts, never answers the handshake
	trusted := &tls.Config{RootCAs: roots}
	ctx := context.Background()
	for _, tt := range []struct {
		name  string
		proxy string
		o     ProbeOptions
		want  Kind
	}{
		{"trusted, with credentials and a tunnel proof", secure.addr, ProbeOptions{ProxyTLS: trusted, Username: "u", Password: "p", Exchange: HTTPGet(addr, "ok")}, KindNone},
		{"trusted, wrong credentials", secure.addr, ProbeOptions{ProxyTLS: trusted, Username: "u", Password: "x"}, KindAuthRequired},
		{"untrusted certificate", secure.addr, ProbeOptions{ProxyTLS: &tls.Config{}, Username: "u", Password: "p"}, KindTLS},
		{"another name", secure.addr, ProbeOptions{ProxyTLS: &tls.Config{RootCAs: roots, ServerName: "proxy.invalid"}, Username: "u", Password: "p"}, KindTLS},
		{"a proxy without TLS", plain.addr, ProbeOptions{ProxyTLS: trusted}, KindTLS},
		{"a handshake that never ends", silent.addr, ProbeOptions{ProxyTLS: trusted, Timeout: 200 * time.Millisecond}, KindTimeout},
		{"plain CONNECT to the TLS proxy", secure.addr, ProbeOptions{Timeout: 2 * time.Second}, KindNetwork},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := Probe(ctx, tt.proxy, addr, &tt.o)
			if r.Kind != tt.want || r.OK != (tt.want == KindNone) {
				t.Fatalf("ok %v kind %v (%v), want %v", r.OK, r.Kind, r.Err, tt.want)
			}
			var pe *ProbeError
			if tt.want == KindTLS && (!errors.As(r.Err, &pe) || pe.Op != "handshake") {
				t.Errorf("error %v: want a *ProbeError of op handshake", r.Err)
			}
		})
	}
	if trusted.ServerName != "" {
		t.Errorf("Probe modified ProxyTLS: ServerName %q", trusted.ServerName)
	}
}

func TestProbeEgressAddress(t *testing.T) {
	var answer atomic.Value // what the echo server answers; "": the asker's address
	answer.Store("")
	echo := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		if a := answer.Load().(string); a != "" {
			host = a
		}
		io.WriteString(w, host+"\n")
	}))
	defer echo.Close()
	cert, roots := testCert(t)
	tlsEcho := httptest.NewUnstartedServer(echo.Config.Handler)
	tlsEcho.TLS = &tls.Config{Certificates: []tls.Certificate{cert}}
	tlsEcho.Config.ErrorLog = log.New(io.Discard, "", 0) // the untrusted case's handshake error
	tlsEcho.StartTLS()
	defer tlsEcho.Close()
	proxy := startFake(t, tunnel("u", "p"))
	target := strings.TrimPrefix(echo.URL, "http://")
	ctx := context.Background()
	creds := ProbeOptions{Username: "u", Password: "p"}
	probe := func(edit func(*ProbeOptions)) Result {
		o := creds
		edit(&o)
		return Probe(ctx, proxy.addr, target, &o)
	}

	r := probe(func(o *ProbeOptions) { o.EgressURL = echo.URL })
	if !r.OK || r.EgressErr != nil || r.EgressAddress != netip.MustParseAddr("127.0.0.1") {
		t.Fatalf("egress over http: ok %v, %v, %v", r.OK, r.EgressAddress, r.EgressErr)
	}
	r = probe(func(o *ProbeOptions) { o.EgressURL, o.EgressTLS = tlsEcho.URL+"/ip", &tls.Config{RootCAs: roots} })
	if !r.OK || r.EgressErr != nil || !r.EgressAddress.IsValid() {
		t.Fatalf("egress over https: ok %v, %v, %v", r.OK, r.EgressAddress, r.EgressErr)
	}
	// An https echo server the probe does not trust: no address, the
	// probe still OK.
	r = probe(func(o *ProbeOptions) { o.EgressURL = tlsEcho.URL })
	if !r.OK || r.EgressAddress.IsValid() || r.EgressErr == nil {
		t.Fatalf("untrusted https echo: ok %v, %v, %v; want OK without an address", r.OK, r.EgressAddress, r.EgressErr)
	}
	answer.Store("::ffff:192.0.2.9")
	if r = probe(func(o *ProbeOptions) { o.EgressURL = echo.URL }); r.EgressAddress != netip.MustParseAddr("192.0.2.9") {
		t.Errorf("a mapped address: %v, want 192.0.2.9", r.EgressAddress)
	}
	answer.Store("<html>not an address</html>")
	r = probe(func(o *ProbeOptions) { o.EgressURL = echo.URL })
	var pe *ProbeError
	if !r.OK || r.EgressAddress.IsValid() || !errors.As(r.EgressErr, &pe) || pe.Kind != KindTunnelFailed || !strings.Contains(r.EgressErr.Error(), "not an address") {
		t.Fatalf("an echo server answering HTML: ok %v, %v, %v; want OK and a tunnel-failed EgressErr", r.OK, r.EgressAddress, r.EgressErr)
	}
	// The fetch uses the probe's credentials: without them it is not made.
	r = probe(func(o *ProbeOptions) { o.Username, o.Password, o.EgressURL = "", "", echo.URL })
	if r.OK || r.Kind != KindAuthRequired || r.EgressErr != nil {
		t.Fatalf("failed probe: kind %v, egress err %v; want 407 and no fetch", r.Kind, r.EgressErr)
	}
	for _, bad := range []string{"ftp://x/", "http:///ip", "http://user:hunter22@echo.example/", "://"} {
		r = probe(func(o *ProbeOptions) { o.EgressURL = bad })
		if r.Kind != KindBadInput || strings.Contains(r.Err.Error(), "hunter22") {
			t.Errorf("EgressURL %q: kind %v, %v; want bad input, no password", bad, r.Kind, r.Err)
		}
	}
	if s := (ProbeOptions{EgressURL: "http://u:hunter22@x/", ProxyTLS: &tls.Config{}}).String(); strings.Contains(s, "hunter22") || !strings.Contains(s, "ProxyTLS:set") {
		t.Errorf("String: %s", s)
	}
}

// The tracker keeps each proxy's egress address and reports a change once,
// as an event of its own: the echo server first reports the proxy's real
// address, then another; rounds that learn the same address, or none (the
// echo server answers no address), report nothing and change no health.
func TestTrackerEgressChange(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var answer atomic.Value
	answer.Store("")
	echo := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		if a := answer.Load().(string); a != "" {
			host = a
		}
		io.WriteString(w, host)
	}))
	defer echo.Close()
	proxy := startFake(t, tunnel("", ""))
	type event struct {
		to, previous netip.Addr
		state        State
	}
	var events []event
	tr, err := NewTracker(&TrackerOptions{Rise: 1, Fall: 1, OnEgressChange: func(s Status, previous netip.Addr) {
		events = append(events, event{s.EgressAddress, previous, s.State})
	}})
	if err != nil {
		t.Fatal(err)
	}
	round := func() {
		t.Helper()
		res, err := tr.Round(ctx, []Proxy{{ID: "a", Address: proxy.addr}}, &ProbeAllOptions{Target: strings.TrimPrefix(echo.URL, "http://"), Probe: ProbeOptions{EgressURL: echo.URL}})
		if err != nil || !res[0].OK {
			t.Fatalf("round: %+v, %v", res, err)
		}
	}
	loopback, other := netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("192.0.2.77")
	round()
	round()
	if len(events) != 1 || events[0].to != loopback || events[0].previous.IsValid() {
		t.Fatalf("after two rounds at one address: events %+v, want one, learning 127.0.0.1", events)
	}
	answer.Store(other.String())
	round()
	answer.Store("no address")
	round()
	answer.Store(other.String())
	round()
	if len(events) != 2 || events[1].to != other || events[1].previous != loopback || events[1].state != StateHealthy {
		t.Fatalf("events %+v, want a second one from 127.0.0.1 to 192.0.2.77 while healthy", events)
	}
	if st, _ := tr.Get("a"); st.EgressAddress != other || st.State != StateHealthy || st.Failures != 0 || st.EgressSince.IsZero() {
		t.Errorf("status %+v, want egress 192.0.2.77 (with its time), healthy, no failures", st)
	}
	// Forgotten and seen again: the first address it learns is news, not a change.
	tr.Remove("a")
	round()
	if len(events) != 3 || events[2].previous.IsValid() {
		t.Errorf("after Remove: events %+v, want a third, without a previous address", events)
	}
}
