package memprovider

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"time"

	"github.com/egressproxy/egressproxy/internal/guestconf"
	"github.com/egressproxy/egressproxy/internal/loopback"
)

// proxyServer is a minimal HTTP CONNECT proxy on one loopback listener. Its
// goroutines are counted in the provider's WaitGroup; shutdown closes the
// listener and every connection without waiting (Close waits).
type proxyServer struct {
	p      *provider
	name   string
	guest  *guestconf.Config // the description it enforces; nil: none
	ln     net.Listener
	port   int
	ctx    context.Context // cancelled by shutdown: aborts dials
	cancel context.CancelFunc

	mu     sync.Mutex
	closed bool
	conns  map[net.Conn]struct{}
}

// startProxy listens on the proxy address, port 0, and serves CONNECT as g describes
// (TLS only when g has a certificate). Called with p.mu held (it does not
// take it).
func (p *provider) startProxy(name string, g *guestconf.Config) (*proxyServer, error) {
	ln, err := net.Listen("tcp", netip.AddrPortFrom(p.proxyAddr(), 0).String())
	if err != nil {
		return nil, err
	}
	port := ln.Addr().(*net.TCPAddr).Port
	if g != nil && g.Certificate != nil {
		ln = tls.NewListener(ln, &tls.Config{Certificates: []tls.Certificate{*g.Certificate}, MinVersion: tls.VersionTLS12})
	}
	ctx, cancel := context.WithCancel(context.Background())
	ps := &proxyServer{
		p:      p,
		name:   name,
		guest:  g,
		ln:     ln,
		port:   port,
		ctx:    ctx,
		cancel: cancel,
		conns:  map[net.Conn]struct{}{},
	}
	p.proxies.Add(1)
	go ps.serve()
	p.log.V(1).Info("proxy serving", "instance", name, "address", ln.Addr().String())
	return ps, nil
}

func (ps *proxyServer) serve() {
	defer ps.p.proxies.Done()
	for {
		c, err := ps.ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return // listener closed
		}
		if !ps.track(c) {
			c.Close()
			return
		}
		ps.p.proxies.Add(1)
		go func() {
			defer ps.p.proxies.Done()
			defer ps.untrack(c)
			ps.handle(c)
		}()
	}
}

// track registers a connection; false once shut down.
func (ps *proxyServer) track(c net.Conn) bool {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.closed {
		return false
	}
	ps.conns[c] = struct{}{}
	return true
}

func (ps *proxyServer) untrack(c net.Conn) {
	c.Close()
	ps.mu.Lock()
	delete(ps.conns, c)
	ps.mu.Unlock()
}

func (ps *proxyServer) shutdown() {
	ps.mu.Lock()
	if ps.closed {
		ps.mu.Unlock()
		return
	}
	ps.closed = true
	ps.cancel()
	ps.ln.Close()
	for c := range ps.conns {
		c.Close()
	}
	ps.mu.Unlock()
	ps.p.log.V(1).Info("proxy stopped", "instance", ps.name)
}

func writeStatus(c net.Conn, code int, headers string) {
	line := "HTTP/1.1 " + strconv.Itoa(code) + " " + http.StatusText(code) + "\r\n" + headers + "Content-Length: 0\r\nConnection: close\r\n\r\n"
	c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	io.WriteString(c, line)
}

func (ps *proxyServer) handle(c net.Conn) {
	o := &ps.p.opts
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReader(c)
	req, err := http.ReadRequest(br)
	if err != nil {
		writeStatus(c, http.StatusBadRequest, "")
		return
	}
	c.SetReadDeadline(time.Time{})
	target := req.Host
	if target == "" {
		target = req.RequestURI
	}
	if code, headers := ps.decide(c, req, target); code != http.StatusOK {
		writeStatus(c, code, headers)
		return
	}
	dctx, cancel := context.WithTimeout(ps.ctx, o.DialTimeout)
	up, err := o.DialContext(dctx, "tcp", target)
	cancel()
	if err != nil {
		writeStatus(c, http.StatusBadGateway, "")
		return
	}
	if !ps.track(up) {
		up.Close()
		return
	}
	defer ps.untrack(up)
	c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		return
	}
	c.SetWriteDeadline(time.Time{})
	// Bytes the client sent after the CONNECT head are in br already.
	done := make(chan struct{})
	ps.p.proxies.Add(1)
	go func() {
		defer ps.p.proxies.Done()
		defer close(done)
		io.Copy(up, br)
		closeWrite(up)
	}()
	io.Copy(c, up)
	closeWrite(c)
	<-done
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		cw.CloseWrite()
		return
	}
	c.Close()
}

// decide answers req for target: http.StatusOK to open the tunnel, or
// the status to refuse it with and the headers that go with it. With a
// guest description it answers as the guest's Squid would; without one,
// it tunnels CONNECT from anyone to loopback targets only (403 for others,
// 405 for other methods).
func (ps *proxyServer) decide(c net.Conn, req *http.Request, target string) (int, string) {
	g := ps.guest
	if g == nil {
		switch {
		case req.Method != http.MethodConnect:
			return http.StatusMethodNotAllowed, "Allow: CONNECT\r\n"
		case !loopback.HostPort(target):
			return http.StatusForbidden, ""
		}
		return http.StatusOK, ""
	}
	r := guestconf.Request{Method: req.Method, Authorization: req.Header.Get("Proxy-Authorization")}
	if ap, err := netip.ParseAddrPort(c.RemoteAddr().String()); err == nil {
		r.Client = ap.Addr()
	}
	if host, port, err := net.SplitHostPort(target); err == nil {
		r.Host = host
		r.Port, _ = strconv.Atoi(port)
	}
	code := g.Decide(r)
	if code == http.StatusProxyAuthRequired {
		return code, "Proxy-Authenticate: Basic realm=\"" + guestconf.Realm + "\"\r\n"
	}
	return code, ""
}
