package health

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
	"time"

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/redact"
)

// maxEgressBody bounds how much of the egress URL's answer is read.
const maxEgressBody = 256

// egressTarget returns the parsed EgressURL and its CONNECT target
// (host:port, the scheme's port when the URL has none).
func egressTarget(raw string) (*url.URL, string, error) {
	bad := func(rule string) error {
		return &errs.FieldError{Field: "EgressURL", Value: redact.URL(raw), Rule: rule}
	}
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Hostname() == "" {
		return nil, "", bad("must be an http or https URL with a host")
	}
	if u.User != nil {
		return nil, "", bad("must not carry credentials")
	}
	port := u.Port()
	if port == "" {
		port = map[string]string{"http": "80", "https": "443"}[u.Scheme]
	}
	return u, net.JoinHostPort(u.Hostname(), port), nil
}

// fetchEgress GETs o.EgressURL through a second tunnel via proxy, within
// deadline, and returns the address it answered.
func fetchEgress(ctx context.Context, proxy string, o *ProbeOptions, deadline time.Time) (netip.Addr, error) {
	u, target, _ := egressTarget(o.EgressURL) // validated by Probe
	if !deadline.IsZero() {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, deadline)
		defer cancel()
	}
	var addr netip.Addr
	eo := ProbeOptions{
		Timeout:     -1, // the deadline above
		Username:    o.Username,
		Password:    o.Password,
		DialContext: o.DialContext,
		ProxyTLS:    o.ProxyTLS,
		Exchange: func(_ context.Context, conn net.Conn) error {
			a, err := getAddress(conn, u)
			addr = a
			return err
		},
	}
	if u.Scheme == "https" {
		eo.TLS = o.EgressTLS
		if eo.TLS == nil {
			eo.TLS = &tls.Config{MinVersion: tls.VersionTLS12}
		}
	}
	r := Probe(ctx, proxy, target, &eo)
	if !r.OK {
		return netip.Addr{}, r.Err
	}
	return addr, nil
}

// getAddress sends GET u through the tunnel conn and reads the address
// the answer's body names.
func getAddress(conn net.Conn, u *url.URL) (netip.Addr, error) {
	req := "GET " + u.RequestURI() + " HTTP/1.1\r\nHost: " + u.Host + "\r\nUser-Agent: egressproxy-health\r\nAccept: text/plain\r\nConnection: close\r\n\r\n"
	if _, err := io.WriteString(conn, req); err != nil {
		return netip.Addr{}, err
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		return netip.Addr{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxEgressBody))
	if err != nil {
		return netip.Addr{}, err
	}
	text := strings.TrimSpace(string(body))
	if resp.StatusCode != http.StatusOK {
		return netip.Addr{}, fmt.Errorf("the egress URL answered %s", resp.Status)
	}
	a, err := netip.ParseAddr(text)
	if err != nil || a.Zone() != "" {
		return netip.Addr{}, fmt.Errorf("the egress URL answered %s, not an address", quote(text))
	}
	return a.Unmap(), nil
}
