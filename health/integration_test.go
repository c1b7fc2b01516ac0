//go:build integration

package health

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// httpExchange sends a GET through the tunnel and expects 200 from the
// loopback HTTP target behind it.
func httpExchange(ctx context.Context, c net.Conn) error {
	if _, err := io.WriteString(c, "GET /health HTTP/1.1\r\nHost: target\r\nConnection: close\r\n\r\n"); err != nil {
		return err
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || string(body) != "ok" {
		return fmt.Errorf("target answered %s %q", resp.Status, body)
	}
	return nil
}

func TestIntegrationProbeSquid(t *testing.T) {
	env := teststack.Require(t)
	target := echoServer(t)
	web := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	t.Cleanup(web.Close)
	tlsWeb := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	t.Cleanup(tlsWeb.Close)
	roots := tlsWeb.Client().Transport.(*http.Transport).TLSClientConfig.RootCAs
	denied := net.JoinHostPort("127.0.0.1", strconv.Itoa(env.SquidDeniedPort))
	webAddr := web.Listener.Addr().String()

	tests := []struct {
		name   string
		proxy  string
		target string
		opts   ProbeOptions
		ok     bool
		kind   Kind
		code   int
	}{
		{name: "open port, no proof", proxy: env.SquidAddr, target: target, ok: true, code: 200},
		{name: "open port, echo exchange", proxy: env.SquidAddr, target: target, opts: ProbeOptions{Exchange: lineExchange}, ok: true, code: 200},
		{name: "open port, HTTP through the tunnel", proxy: env.SquidAddr, target: webAddr, opts: ProbeOptions{Exchange: httpExchange}, ok: true, code: 200},
		{name: "open port, TLS handshake through the tunnel", proxy: env.SquidAddr, target: tlsWeb.Listener.Addr().String(),
			opts: ProbeOptions{TLS: &tls.Config{RootCAs: roots}}, ok: true, code: 200},
		{name: "auth port without credentials", proxy: env.SquidAuthAddr, target: target, kind: KindAuthRequired, code: 407},
		{name: "auth port with wrong password", proxy: env.SquidAuthAddr, target: target,
			opts: ProbeOptions{Username: env.SquidUser, Password: env.SquidPassword + "x"}, kind: KindAuthRequired, code: 407},
		{name: "auth port with the right credentials", proxy: env.SquidAuthAddr, target: target,
			opts: ProbeOptions{Username: env.SquidUser, Password: env.SquidPassword, Exchange: lineExchange}, ok: true, code: 200},
		{name: "denied port", proxy: env.SquidAddr, target: denied, kind: KindProxyStatus, code: 403},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			res := Probe(ctx, tt.proxy, tt.target, &tt.opts)
			t.Logf("kind=%v code=%d connect=%v firstByte=%v total=%v err=%v", res.Kind, res.StatusCode, res.Connect, res.FirstByte, res.Total, res.Err)
			if res.OK != tt.ok || res.Kind != tt.kind || res.StatusCode != tt.code {
				t.Fatalf("got ok=%v kind=%v code=%d err=%v; want ok=%v kind=%v code=%d",
					res.OK, res.Kind, res.StatusCode, res.Err, tt.ok, tt.kind, tt.code)
			}
			var pe *ProbeError
			if !tt.ok && (!errors.As(res.Err, &pe) || pe.Kind != tt.kind) {
				t.Fatalf("error %v: want a *ProbeError of kind %v", res.Err, tt.kind)
			}
			if res.OK && (res.Connect <= 0 || res.FirstByte <= 0 || res.Total < res.FirstByte) {
				t.Fatalf("latency not measured: %+v", res)
			}
		})
	}
	t.Run("unreachable target is a proxy error status", func(t *testing.T) {
		res := Probe(context.Background(), env.SquidAddr, closedAddr(t), &ProbeOptions{Timeout: 30 * time.Second})
		if res.OK || res.Kind != KindProxyStatus || res.StatusCode < 500 {
			t.Fatalf("got ok=%v kind=%v code=%d err=%v; want a 5xx proxy status", res.OK, res.Kind, res.StatusCode, res.Err)
		}
	})
}

func TestIntegrationTrackerRoundSquid(t *testing.T) {
	env := teststack.Require(t)
	target := echoServer(t)
	denied := net.JoinHostPort("127.0.0.1", strconv.Itoa(env.SquidDeniedPort))
	tr, err := NewTracker(&TrackerOptions{Rise: 2, Fall: 2, Grace: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	members := []Proxy{{ID: "open", Address: env.SquidAddr}, {ID: "auth", Address: env.SquidAuthAddr}, {ID: "booting"}}
	for i := 0; i < 2; i++ {
		res, err := tr.Round(context.Background(), members, &ProbeAllOptions{Target: target, Workers: 2,
			Probe: ProbeOptions{Timeout: 30 * time.Second, Exchange: lineExchange}})
		if err != nil || len(res) != 2 || !res[0].OK || res[1].Kind != KindAuthRequired {
			t.Fatalf("round %d: %+v, %v", i, res, err)
		}
	}
	want := map[string]State{"open": StateHealthy, "auth": StateUnhealthy, "booting": StateUnknown}
	for _, s := range tr.Snapshot() {
		if s.State != want[s.ID] {
			t.Errorf("%s: %v, want %v (last error %v)", s.ID, s.State, want[s.ID], s.LastErr)
		}
	}
	// Many probes through one squid at once: all succeed or all are denied.
	var proxies []Proxy
	for i := 0; i < 50; i++ {
		p := Proxy{ID: fmt.Sprint(i), Address: env.SquidAddr, Target: target}
		if i%5 == 0 {
			p.Target = denied
		}
		proxies = append(proxies, p)
	}
	for i, r := range ProbeAll(context.Background(), proxies, &ProbeAllOptions{Workers: 8, Probe: ProbeOptions{Timeout: 30 * time.Second}}) {
		if i%5 == 0 && (r.Kind != KindProxyStatus || r.StatusCode != 403) || i%5 != 0 && !r.OK {
			t.Errorf("%s via squid to %s: ok=%v kind=%v code=%d err=%v", r.ID, r.Target, r.OK, r.Kind, r.StatusCode, r.Err)
		}
	}
}
