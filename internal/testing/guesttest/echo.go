package guesttest

import (
	"io"
	"net"
	"net/http"
	"sync"
	"testing"
)

// Echo is a "what is my address" server: it answers every request with
// the address it was asked from (or, after Report, an address it is told
// to report) and records who asked.
type Echo struct {
	// URL is "http://IP:PORT/".
	URL string
	// Addr is its IP:PORT.
	Addr   string
	mu     sync.Mutex
	report string
	peers  []string
}

// ServeEcho listens on ip (port chosen by the kernel) until the test ends.
func ServeEcho(t testing.TB, ip string) *Echo {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatalf("listen on %s for the echo server: %v", ip, err)
	}
	e := &Echo{Addr: ln.Addr().String()}
	e.URL = "http://" + e.Addr + "/"
	serveHTTP(t, ln, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		e.mu.Lock()
		e.peers = append(e.peers, host)
		answer := e.report
		e.mu.Unlock()
		if answer == "" {
			answer = host
		}
		_, _ = io.WriteString(w, answer+"\n")
	}))
	return e
}

// Report makes the server answer addr from now on ("" : the asker's
// address again).
func (e *Echo) Report(addr string) {
	e.mu.Lock()
	e.report = addr
	e.mu.Unlock()
}

// Seen returns the source addresses of the requests so far.
func (e *Echo) Seen() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.peers...)
}
