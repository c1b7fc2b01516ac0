package health

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
)

// fakeProxy is an in-process TCP server on loopback standing in for a
// proxy. handle runs in its own goroutine per connection; a nil handle
// accepts and holds connections without reading or answering (and without a
// goroutine per connection). Everything ends at test cleanup.
type fakeProxy struct {
	ln       net.Listener
	addr     string
	handle   func(c net.Conn)
	wg       sync.WaitGroup
	mu       sync.Mutex
	conns    map[net.Conn]struct{}
	accepted atomic.Int64
	active   atomic.Int64
	peak     atomic.Int64
}

func startFake(tb testing.TB, handle func(c net.Conn)) *fakeProxy {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	f := &fakeProxy{ln: ln, addr: ln.Addr().String(), handle: handle, conns: map[net.Conn]struct{}{}}
	f.wg.Add(1)
	go f.serve()
	tb.Cleanup(f.close)
	return f
}

func (f *fakeProxy) serve() {
	defer f.wg.Done()
	for {
		c, err := f.ln.Accept()
		if err != nil {
			return
		}
		f.accepted.Add(1)
		f.mu.Lock()
		f.conns[c] = struct{}{}
		f.mu.Unlock()
		if f.handle == nil {
			continue
		}
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			n := f.active.Add(1)
			for {
				p := f.peak.Load()
				if n <= p || f.peak.CompareAndSwap(p, n) {
					break
				}
			}
			f.handle(c)
			f.active.Add(-1)
			c.Close()
			f.mu.Lock()
			delete(f.conns, c)
			f.mu.Unlock()
		}()
	}
}

func (f *fakeProxy) close() {
	f.ln.Close()
	f.mu.Lock()
	for c := range f.conns {
		c.Close()
	}
	f.mu.Unlock()
	f.wg.Wait()
}

// readHead reads a request head and returns it, or nil on error.
func readHead(br *bufio.Reader) *http.Request {
	req, err := http.ReadRequest(br)
	if err != nil {
		return nil
	}
	return req
}

// reply answers every CONNECT with raw, then waits for the client to close.
func reply(raw string) func(net.Conn) {
	return func(c net.Conn) {
		br := bufio.NewReader(c)
		if readHead(br) == nil {
			return
		}
		io.WriteString(c, raw)
		io.Copy(io.Discard, br)
	}
}

// replyClose answers with raw and closes the connection at once.
func replyClose(raw string) func(net.Conn) {
	return func(c net.Conn) {
		br := bufio.NewReader(c)
		if readHead(br) == nil {
			return
		}
		io.WriteString(c, raw)
	}
}

// tunnel is a real (tiny) CONNECT proxy: it dials the requested target and
// relays bytes both ways. When user is not empty it requires those basic
// credentials.
func tunnel(user, pass string) func(net.Conn) {
	return func(c net.Conn) {
		br := bufio.NewReader(c)
		req := readHead(br)
		if req == nil {
			return
		}
		if req.Method != http.MethodConnect {
			io.WriteString(c, "HTTP/1.1 405 Method Not Allowed\r\n\r\n")
			return
		}
		if user != "" {
			r := &http.Request{Header: http.Header{"Authorization": req.Header["Proxy-Authorization"]}}
			u, p, ok := r.BasicAuth()
			if !ok || u != user || p != pass {
				io.WriteString(c, "HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=\"x\"\r\nContent-Length: 0\r\n\r\n")
				io.Copy(io.Discard, br)
				return
			}
		}
		up, err := net.Dial("tcp", req.RequestURI)
		if err != nil {
			io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\n\r\n")
			return
		}
		defer up.Close()
		io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n")
		done := make(chan struct{})
		go func() {
			io.Copy(up, br)
			up.(*net.TCPConn).CloseWrite()
			close(done)
		}()
		io.Copy(c, up)
		c.(interface{ CloseWrite() error }).CloseWrite() // TCP or TLS
		<-done
	}
}

// closedAddr returns a loopback address nobody listens on.
func closedAddr(tb testing.TB) string {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}
