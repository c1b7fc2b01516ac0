package guesttest

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// FileServer serves one file over HTTP on loopback and counts the requests.
type FileServer struct {
	*httptest.Server
	Requests atomic.Int64
}

// ServeFile serves the file at path under urlPath (e.g. "/guest.qcow2")
// until the test ends; every other path is 404.
func ServeFile(t testing.TB, urlPath, path string) *FileServer {
	t.Helper()
	s := &FileServer{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.Requests.Add(1)
		if r.URL.Path != urlPath {
			http.NotFound(w, r)
			return
		}
		http.ServeFile(w, r, path)
	}))
	t.Cleanup(s.Close)
	return s
}

// Target is a CONNECT target: an HTTP server on an address the guest
// reaches that answers every request with Token and records who asked.
type Target struct {
	Addr  string
	Token string
	mu    sync.Mutex
	peers []string
}

// ServeTarget listens on ip (port chosen by the kernel) until the test ends.
func ServeTarget(t testing.TB, ip string) *Target {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatalf("listen on %s for the CONNECT target: %v", ip, err)
	}
	ct := &Target{Addr: ln.Addr().String(), Token: "egp-e2e-" + RandHex(t, 8)}
	serveHTTP(t, ln, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, _ := net.SplitHostPort(r.RemoteAddr)
		ct.mu.Lock()
		ct.peers = append(ct.peers, host)
		ct.mu.Unlock()
		_, _ = io.WriteString(w, ct.Token)
	}))
	return ct
}

// Seen returns the source addresses of the requests so far.
func (ct *Target) Seen() []string {
	ct.mu.Lock()
	defer ct.mu.Unlock()
	return append([]string(nil), ct.peers...)
}

// ConsoleLog returns the serial console log of a domain written to dir
// (kvm2.Config.ConsoleLogDir; the tail when it is long), for failure output.
func ConsoleLog(dir, domain string) string {
	p := filepath.Join(dir, domain+".log")
	b, err := os.ReadFile(p)
	if err != nil {
		return fmt.Sprintf("(no serial console log: %v)", err)
	}
	const max = 48 << 10
	head := fmt.Sprintf("--- serial console of %s (%s, %d bytes) ---\n", domain, p, len(b))
	if len(b) > max {
		head += fmt.Sprintf("[… first %d bytes left out …]\n", len(b)-max)
		b = b[len(b)-max:]
	}
	return head + string(b) + "\n--- end of serial console ---"
}

// serveHTTP serves h on ln until the test's cleanup, which closes the
// server and waits for its goroutine.
func serveHTTP(t testing.TB, ln net.Listener, h http.Handler) {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(ln)
	}()
	t.Cleanup(func() {
		_ = srv.Close()
		<-done
	})
}
