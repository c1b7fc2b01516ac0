package delayproxy

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// server runs handle for every connection accepted on a loopback listener
// until the test ends.
func server(t *testing.T, handle func(net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() { defer wg.Done(); defer c.Close(); handle(c) }()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String()
}

func echo(c net.Conn) { _, _ = io.Copy(c, c) }

func newProxy(t *testing.T, cfg Config) *Proxy {
	t.Helper()
	p, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return p
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// minRoundTrip is the shortest of n one-byte request/response exchanges.
func minRoundTrip(t *testing.T, c net.Conn, n int) time.Duration {
	t.Helper()
	best := time.Duration(1 << 62)
	b := []byte{0}
	for i := 0; i < n; i++ {
		start := time.Now()
		if _, err := c.Write(b); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, b); err != nil {
			t.Fatal(err)
		}
		best = min(best, time.Since(start))
	}
	return best
}

func TestAddsRoundTripTime(t *testing.T) {
	target := server(t, echo)
	direct := minRoundTrip(t, dial(t, target), 5)
	for _, rtt := range []time.Duration{10 * time.Millisecond, 50 * time.Millisecond} {
		t.Run(rtt.String(), func(t *testing.T) {
			p := newProxy(t, Config{Target: target, RTT: rtt})
			got := minRoundTrip(t, dial(t, p.Addr().String()), 5)
			if got < rtt {
				t.Errorf("round trip through a %v proxy took %v, want >= %v", rtt, got, rtt)
			}
			// Generous: the machine may be busy, but the proxy must not add
			// a multiple of its delay.
			if limit := direct + rtt + 250*time.Millisecond; got > limit {
				t.Errorf("round trip through a %v proxy took %v, want <= %v (direct %v)", rtt, got, limit, direct)
			}
			t.Logf("rtt %v: direct %v, proxied %v", rtt, direct, got)
		})
	}
}

func TestZeroRTTIsAPlainRelay(t *testing.T) {
	target := server(t, echo)
	p := newProxy(t, Config{Target: target})
	if got := minRoundTrip(t, dial(t, p.Addr().String()), 5); got > 50*time.Millisecond {
		t.Errorf("round trip through a 0 ms proxy took %v, want well under 50ms", got)
	}
}

// sink counts what it reads and reports the total once the client
// half-closes, by answering with one byte.
func sink(c net.Conn) {
	if _, err := io.Copy(io.Discard, c); err == nil {
		_, _ = c.Write([]byte{1})
	}
}

// transfer sends size bytes through addr to a sink and returns the time
// until the sink confirmed it had them all.
func transfer(t *testing.T, addr string, size int) time.Duration {
	t.Helper()
	c := dial(t, addr)
	buf := make([]byte, ChunkBytes)
	start := time.Now()
	for sent := 0; sent < size; sent += len(buf) {
		if _, err := c.Write(buf); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, buf[:1]); err != nil {
		t.Fatalf("no confirmation from the sink: %v", err)
	}
	return time.Since(start)
}

// TestThroughputNotCappedByDelay: with the default buffer a 50 ms proxy
// carries a bulk transfer far faster than one buffer's worth per delay; a
// proxy that held only a socket buffer's worth would cap it at ~2.6 MB/s.
func TestThroughputNotCappedByDelay(t *testing.T) {
	target := server(t, sink)
	const rtt = 50 * time.Millisecond
	p := newProxy(t, Config{Target: target, RTT: rtt})
	const size = 32 << 20
	el := transfer(t, p.Addr().String(), size)
	rate := float64(size) / (el - rtt).Seconds() / 1e6
	t.Logf("32 MiB through a %v proxy: %v (%.0f MB/s not counting the delay)", rtt, el, rate)
	if rate < 40 {
		t.Errorf("throughput through a %v proxy %.1f MB/s, want >= 40 MB/s (default buffer %d bytes)", rtt, rate, BufferFor(DefaultRate, rtt))
	}
}

// TestBufferBoundsThroughput: the buffer really bounds what is in flight,
// so throughput is at most buffer/delay (Little's law).
func TestBufferBoundsThroughput(t *testing.T) {
	target := server(t, sink)
	const rtt = 50 * time.Millisecond
	p := newProxy(t, Config{Target: target, RTT: rtt, BufferBytes: 2 * ChunkBytes})
	const size = 1 << 20
	el := transfer(t, p.Addr().String(), size)
	limit := float64(2*ChunkBytes) / (rtt / 2).Seconds() // bytes per second
	if rate := float64(size) / el.Seconds(); rate > 1.5*limit {
		t.Errorf("1 MiB through a 2-chunk buffer at %v: %.2f MB/s, want <= %.2f MB/s", rtt, rate/1e6, 1.5*limit/1e6)
	}
}

// TestOrderAndIntegrity: random bytes sent both ways at once come back
// unchanged and in order.
func TestOrderAndIntegrity(t *testing.T) {
	target := server(t, echo)
	p := newProxy(t, Config{Target: target, RTT: 10 * time.Millisecond})
	c := dial(t, p.Addr().String())
	data := make([]byte, 4<<20)
	if _, err := rand.Read(data); err != nil {
		t.Fatal(err)
	}
	werr := make(chan error, 1)
	go func() {
		// Odd-sized writes, so chunk boundaries fall anywhere.
		rest := data
		for len(rest) > 0 {
			n := min(len(rest), 7919)
			if _, err := c.Write(rest[:n]); err != nil {
				werr <- err
				return
			}
			rest = rest[n:]
		}
		werr <- nil
	}()
	got := make([]byte, len(data))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatal(err)
	}
	if err := <-werr; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Fatal("bytes echoed through the proxy differ from those sent")
	}
}

func TestHalfCloseIsRelayed(t *testing.T) {
	target := server(t, func(c net.Conn) {
		req, err := io.ReadAll(c) // until the client's FIN
		if err != nil {
			return
		}
		_, _ = c.Write(append([]byte("got "), req...))
	})
	p := newProxy(t, Config{Target: target, RTT: 10 * time.Millisecond})
	c := dial(t, p.Addr().String())
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != "got ping" {
		t.Errorf("answer %q, want %q", got, "got ping")
	}
}

func TestCloseEndsRelayedConnections(t *testing.T) {
	target := server(t, echo)
	p, err := New(Config{Target: target, RTT: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	c := dial(t, p.Addr().String())
	minRoundTrip(t, c, 1)
	if err := p.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Error("read from a connection after Close succeeded, want EOF or reset")
	}
	if _, err := net.DialTimeout("tcp", p.Addr().String(), time.Second); err == nil {
		t.Error("dial after Close succeeded")
	}
	if err := p.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

func TestConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"no target", Config{}},
		{"negative rtt", Config{Target: "127.0.0.1:1", RTT: -time.Millisecond}},
		{"negative buffer", Config{Target: "127.0.0.1:1", BufferBytes: -1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if p, err := New(tc.cfg); err == nil {
				p.Close()
				t.Fatal("New succeeded, want an error")
			}
		})
	}
}

// countingReader returns full chunks forever, reporting each read.
type countingReader struct{ reads chan int }

func (r countingReader) Read(b []byte) (int, error) {
	r.reads <- len(b)
	return len(b), nil
}

// gateWriter blocks every Write until release is closed.
type gateWriter struct{ release chan struct{} }

func (w gateWriter) Write(b []byte) (int, error) {
	<-w.release
	return 0, errors.New("stopped")
}

// TestPipeBuffersAtMostNBuf: when the destination does not take bytes, pipe
// reads exactly nbuf chunks and then stops reading.
func TestPipeBuffersAtMostNBuf(t *testing.T) {
	const nbuf = 4
	r := countingReader{reads: make(chan int, 100)}
	w := gateWriter{release: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var failed sync.Once
	stopped := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		pipe(ctx, w, r, func() time.Duration { return 0 }, nbuf, func() {}, func() { failed.Do(func() { close(stopped) }) })
	}()
	for i := 0; i < nbuf; i++ {
		<-r.reads
	}
	select {
	case <-r.reads:
		t.Errorf("pipe read a chunk beyond its %d buffers while the destination took nothing", nbuf)
	case <-time.After(200 * time.Millisecond):
	}
	close(w.release)
	<-stopped
	<-done
}

// TestSetRTT changes the added round-trip time of a connection that is
// already relayed (the soak's rtt fault: raised to 400 ms for a while, then
// lowered again), and of the next one.
func TestSetRTT(t *testing.T) {
	target := server(t, echo)
	p := newProxy(t, Config{Target: target, RTT: 10 * time.Millisecond})
	c := dial(t, p.Addr().String())
	if got := minRoundTrip(t, c, 3); got >= 200*time.Millisecond {
		t.Fatalf("round trip at 10ms: %v", got)
	}
	if err := p.SetRTT(400 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if p.RTT() != 400*time.Millisecond {
		t.Fatalf("RTT() = %v after SetRTT(400ms)", p.RTT())
	}
	if got := minRoundTrip(t, c, 2); got < 400*time.Millisecond {
		t.Errorf("round trip on the same connection after SetRTT(400ms): %v, want >= 400ms", got)
	}
	if got := minRoundTrip(t, dial(t, p.Addr().String()), 1); got < 400*time.Millisecond {
		t.Errorf("round trip on a new connection after SetRTT(400ms): %v, want >= 400ms", got)
	}
	if err := p.SetRTT(10 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	_ = minRoundTrip(t, c, 1) // may still wait out a chunk queued at 400ms
	if got := minRoundTrip(t, c, 3); got >= 200*time.Millisecond {
		t.Errorf("round trip after lowering to 10ms again: %v, want < 200ms", got)
	}
	if err := p.SetRTT(-time.Second); err == nil {
		t.Error("SetRTT(-1s) succeeded")
	}
}
