package delayproxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
)

// ChunkBytes is the most one read takes from a side, and so the size of one
// buffered chunk.
const ChunkBytes = 32 << 10

// DefaultRate is the link rate (bits per second) the default buffer is sized
// for.
const DefaultRate = 1_000_000_000

// Config configures a Proxy. The zero value of each field but Target is
// usable.
type Config struct {
	// Listen is the address to listen on. Zero: "127.0.0.1:0" (a free port;
	// Proxy.Addr tells which).
	Listen string
	// Target is the address every accepted connection is relayed to.
	// Required.
	Target string
	// RTT is the round-trip time the proxy adds: each direction delays by
	// RTT/2. Zero: a plain relay. Must not be negative.
	RTT time.Duration
	// BufferBytes bounds the bytes held per direction of one connection.
	// Zero: twice the bandwidth-delay product of DefaultRate at RTT/2, at
	// least 8 chunks.
	BufferBytes int
	// DialTimeout bounds connecting to Target. Zero: 10 s.
	DialTimeout time.Duration
	// Logger logs connections (V(1)) and relay failures. Zero: discard.
	Logger logr.Logger
}

// Proxy relays connections from its listener to Config.Target with added
// delay. Close stops it.
type Proxy struct {
	cfg   Config
	ln    net.Listener
	nbuf  int
	ctx   context.Context
	stop  context.CancelFunc
	wg    sync.WaitGroup
	mu    sync.Mutex
	conns map[net.Conn]struct{}
	once  sync.Once
	err   error
	rtt   atomic.Int64 // the round-trip time added now (SetRTT)
}

// BufferFor returns the default per-direction buffer for a link of rate
// bits per second and a round-trip time rtt: twice the bytes in flight in
// one direction (rate × rtt/2), at least 8 chunks.
func BufferFor(rate int64, rtt time.Duration) int {
	bdp := float64(rate) / 8 * (rtt / 2).Seconds()
	b := int(2 * bdp)
	if b < 8*ChunkBytes {
		b = 8 * ChunkBytes
	}
	return b
}

// New validates cfg, listens, and starts relaying. The proxy runs until
// Close.
func New(cfg Config) (*Proxy, error) {
	var errs []error
	if cfg.Target == "" {
		errs = append(errs, errors.New("delayproxy: Target: required"))
	}
	if cfg.RTT < 0 {
		errs = append(errs, fmt.Errorf("delayproxy: RTT %v: must not be negative", cfg.RTT))
	}
	if cfg.BufferBytes < 0 {
		errs = append(errs, fmt.Errorf("delayproxy: BufferBytes %d: must not be negative", cfg.BufferBytes))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	if cfg.Listen == "" {
		cfg.Listen = "127.0.0.1:0"
	}
	if cfg.BufferBytes == 0 {
		cfg.BufferBytes = BufferFor(DefaultRate, cfg.RTT)
	}
	if cfg.DialTimeout == 0 {
		cfg.DialTimeout = 10 * time.Second
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("delayproxy: listen: %w", err)
	}
	p := &Proxy{cfg: cfg, ln: ln, conns: map[net.Conn]struct{}{}}
	p.nbuf = (cfg.BufferBytes + ChunkBytes - 1) / ChunkBytes
	p.rtt.Store(int64(cfg.RTT))
	p.ctx, p.stop = context.WithCancel(context.Background())
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the address the proxy listens on.
func (p *Proxy) Addr() net.Addr { return p.ln.Addr() }

// RTT is the round-trip time the proxy adds now.
func (p *Proxy) RTT() time.Duration { return time.Duration(p.rtt.Load()) }

// SetRTT changes the round-trip time the proxy adds, at run time, for the
// connections it relays already and for new ones: a chunk read from now on
// is delivered rtt/2 after it was read, and one already buffered no later
// than rtt/2 after it was read (chunks stay in order, so lowering the RTT
// lets the buffered ones go at once; the one being waited for when it
// changes keeps its due time). The buffer bound (Config.BufferBytes)
// does not change, so throughput at a raised RTT is at most
// BufferBytes per RTT/2. A negative rtt is an error.
func (p *Proxy) SetRTT(rtt time.Duration) error {
	if rtt < 0 {
		return fmt.Errorf("delayproxy: RTT %v: must not be negative", rtt)
	}
	old := time.Duration(p.rtt.Swap(int64(rtt)))
	if old != rtt {
		p.cfg.Logger.Info("rtt changed", "from", old.String(), "to", rtt.String())
	}
	return nil
}

// half is the delay of one direction now.
func (p *Proxy) half() time.Duration { return p.RTT() / 2 }

// Close stops listening, closes every relayed connection and waits for
// every goroutine of the proxy to end. It is idempotent.
func (p *Proxy) Close() error {
	p.once.Do(func() {
		p.stop()
		p.err = p.ln.Close()
		p.mu.Lock()
		for c := range p.conns {
			c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p.err
}

func (p *Proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ctx.Err() != nil {
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *Proxy) untrack(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			if p.ctx.Err() == nil {
				p.cfg.Logger.Error(err, "accept failed; proxy stops accepting")
			}
			return
		}
		if !p.track(c) {
			c.Close()
			return
		}
		p.wg.Add(1)
		go p.serve(c)
	}
}

func (p *Proxy) serve(client net.Conn) {
	defer p.wg.Done()
	defer p.untrack(client)
	defer client.Close()
	d := net.Dialer{Timeout: p.cfg.DialTimeout}
	server, err := d.DialContext(p.ctx, "tcp", p.cfg.Target)
	if err != nil {
		p.cfg.Logger.Error(err, "dial target failed", "client", client.RemoteAddr().String(), "target", p.cfg.Target)
		return
	}
	if !p.track(server) {
		server.Close()
		return
	}
	defer p.untrack(server)
	defer server.Close()
	start := time.Now()
	p.cfg.Logger.V(1).Info("relaying", "client", client.RemoteAddr().String(), "target", p.cfg.Target, "rtt", p.RTT().String())

	var wg sync.WaitGroup
	wg.Add(2)
	var up, down int64
	go func() { defer wg.Done(); up = p.relay(server, client, p.half) }()
	go func() { defer wg.Done(); down = p.relay(client, server, p.half) }()
	wg.Wait()
	p.cfg.Logger.V(1).Info("closed", "client", client.RemoteAddr().String(), "bytesUp", up, "bytesDown", down,
		"elapsed", time.Since(start).String())
}

// chunk is one read: its bytes, when it was read, and whether the source
// ended (eof) or failed (err) after it.
type chunk struct {
	buf  []byte
	n    int
	at   time.Time
	eof  bool
	fail bool
}

// relay copies src to dst, delaying each chunk by delay() (read when the
// chunk is due to be written) after it was read.
// On a clean end of src it half-closes dst; on any failure it closes both.
// It returns the bytes written to dst.
func (p *Proxy) relay(dst, src net.Conn, delay func() time.Duration) int64 {
	return pipe(p.ctx, dst, src, delay, p.nbuf, func() {
		if cw, ok := dst.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
		} else {
			dst.Close()
		}
	}, func() {
		dst.Close()
		src.Close()
	})
}

// pipe is relay's engine: a reader goroutine fills at most nbuf buffers of
// ChunkBytes from src, stamping each, and the calling goroutine writes them
// to dst in order, each no earlier than its stamp plus delay() (asked
// again for each chunk, so a change applies to what is buffered). onEOF runs
// after the last byte of a cleanly ended src is written, onFail on any read
// or write failure or when ctx ends. pipe returns once both goroutines are
// done.
func pipe(ctx context.Context, dst io.Writer, src io.Reader, delay func() time.Duration, nbuf int,
	onEOF, onFail func()) int64 {
	free := make(chan []byte, nbuf)
	for i := 0; i < nbuf; i++ {
		free <- make([]byte, ChunkBytes)
	}
	queue := make(chan chunk, nbuf+1)
	done := make(chan struct{}) // the writer stopped; the reader must not block
	var rwg sync.WaitGroup
	rwg.Add(1)
	go func() {
		defer rwg.Done()
		defer close(queue)
		for {
			var buf []byte
			select {
			case buf = <-free:
			case <-done:
				return
			}
			n, err := src.Read(buf)
			c := chunk{buf: buf, n: n, at: time.Now()}
			if err != nil {
				c.eof = errors.Is(err, io.EOF)
				c.fail = !c.eof
			}
			select {
			case queue <- c:
			case <-done:
				return
			}
			if err != nil {
				return
			}
		}
	}()

	var written int64
	timer := time.NewTimer(0)
	<-timer.C
	failed := false
	for c := range queue {
		if d := delay(); d > 0 {
			if due := time.Until(c.at.Add(d)); due > 0 {
				timer.Reset(due)
				select {
				case <-timer.C:
				case <-ctx.Done():
					failed = true
				}
			}
		}
		if failed {
			break
		}
		if c.n > 0 {
			n, err := dst.Write(c.buf[:c.n])
			written += int64(n)
			if err != nil {
				failed = true
				break
			}
		}
		if c.eof {
			onEOF()
			break
		}
		if c.fail {
			failed = true
			break
		}
		free <- c.buf
	}
	timer.Stop()
	close(done)
	if failed {
		onFail() // unblocks a reader stuck in src.Read
	}
	rwg.Wait()
	return written
}
