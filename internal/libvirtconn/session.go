package libvirtconn

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/internal/budget"
	"github.com/egressproxy/egressproxy/sshconn"
	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"golang.org/x/crypto/ssh"
)

// Config describes the libvirt side of a Session.
type Config struct {
	// Address is the sshd address of the Pool the session runs on; errors
	// and log lines name it. Zero: they do not.
	Address string
	// Socket is the remote path of libvirtd's read-write unix socket.
	// Zero: /var/run/libvirt/libvirt-sock.
	Socket string
	// URI is the libvirt connection URI opened on that socket.
	// Zero: qemu:///system.
	URI string
	// CallTimeout is the budget of one Do (connecting included), and of
	// opening a Dedicated connection, when its ctx has no deadline.
	// Zero: 2m.
	CallTimeout time.Duration
	// ProbeAfter is how long a call abandoned by its caller (its ctx ended)
	// may stay unanswered before the shared connection is probed with a
	// cheap call; a connection whose probe is not answered within
	// ProbeTimeout is torn down (libvirtd stopped answering). Zero: 30s.
	ProbeAfter time.Duration
	// ProbeTimeout bounds that probe. Zero: 10s.
	ProbeTimeout time.Duration
}

// Options holds a Session's runtime dependencies; nil is valid.
type Options struct {
	// Logger receives debug and info lines (named "libvirt", with the
	// address and the URI). Zero: discard.
	Logger logr.Logger
	// MeterProvider records every remote procedure call of the session's
	// connections (egressproxy.libvirt.rpc.duration). Nil: no-op.
	MeterProvider metric.MeterProvider
	// MetricAttributes are added to every measurement (kvm2's
	// egressproxy.entry). Zero: none.
	MetricAttributes []attribute.KeyValue

	// bareChannel hands go-libvirt the bare channel, without the stream
	// guard (the upstream reproducer test only).
	bareChannel bool
}

const (
	defaultLibvirtSocket = "/var/run/libvirt/libvirt-sock"
	defaultLibvirtURI    = "qemu:///system"
	defaultCallTimeout   = 2 * time.Minute
	defaultProbeAfter    = 30 * time.Second
	defaultProbeTimeout  = 10 * time.Second

	// gentleAbort is how long a call on a session being torn down gets to
	// return after its libvirt channel was closed before the whole SSH link
	// is killed.
	gentleAbort = 250 * time.Millisecond
	// abortWait bounds how long a teardown waits for a call to return once
	// the link was killed.
	abortWait = time.Second
	// politeClose bounds the polite libvirt Disconnect in Close.
	politeClose = 500 * time.Millisecond
)

// Session is a go-libvirt connection to one host's libvirtd, carried on a
// unix socket channel of a Pool's shared SSH connection, connected on first
// use and reconnected after it dies; Dedicated opens more, each on an SSH
// connection of its own. Session does not own the Pool: closing it
// disconnects only its libvirt connection. It is safe for concurrent use;
// go-libvirt multiplexes concurrent calls over the one connection.
type Session struct {
	pool        *sshconn.Pool
	cfg         Config
	log         logr.Logger
	bareChannel bool
	rpc         *rpcMeter // nil: no MeterProvider

	mu         sync.Mutex
	closed     bool
	closing    chan struct{}
	closeCtx   context.Context // ended by Close: connects in flight end
	cancelAll  context.CancelFunc
	cur        *rpcConn      // the shared connection; may be dead (kept for Dead)
	connecting chan struct{} // non-nil while the shared connection is being connected

	wg sync.WaitGroup // every goroutine the Session starts
}

// rpcConn is one go-libvirt connection on one unix socket channel.
type rpcConn struct {
	lv     *libvirt.Libvirt
	conn   net.Conn        // the SSH channel
	client *ssh.Client     // the SSH connection carrying it
	linkUp <-chan struct{} // closed when that SSH connection is declared dead
	guard  *streamGuard    // nil on a bare channel
	broken atomic.Bool
	once   sync.Once

	probeMu   sync.Mutex // one liveness probe at a time
	lastAlive time.Time  // when a probe was last answered (under probeMu)
}

// dead reports whether c can no longer serve calls: marked broken by us,
// go-libvirt saw its socket close (libvirtd restarted, channel closed), or
// the SSH link died.
func (c *rpcConn) dead() bool {
	if c.broken.Load() {
		return true
	}
	select {
	case <-c.lv.Disconnected():
		return true
	case <-c.linkUp:
		return true
	default:
		return false
	}
}

// lost reports whether err from a call means the connection was lost.
func (c *rpcConn) lost(err error) bool {
	if errors.Is(err, libvirt.ErrInterrupted) {
		return true
	}
	// go-libvirt returns a bare EINVAL once its socket is disconnected.
	var errno syscall.Errno
	if errors.As(err, &errno) && errno == syscall.EINVAL {
		return true
	}
	return c.dead()
}

// onceDialer hands go-libvirt the channel we opened (with a ctx) ourselves.
type onceDialer struct {
	mu   sync.Mutex
	conn net.Conn
}

func (d *onceDialer) Dial() (net.Conn, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	c := d.conn
	d.conn = nil
	if c == nil {
		return nil, errors.New("libvirt dialer already used (a Session reconnects with a new one)")
	}
	return c, nil
}

// New returns a Session over pool. It does not dial.
func New(pool *sshconn.Pool, cfg Config, opts *Options) *Session {
	if opts == nil {
		opts = &Options{}
	}
	if cfg.Socket == "" {
		cfg.Socket = defaultLibvirtSocket
	}
	if cfg.URI == "" {
		cfg.URI = defaultLibvirtURI
	}
	if cfg.CallTimeout <= 0 {
		cfg.CallTimeout = defaultCallTimeout
	}
	if cfg.ProbeAfter <= 0 {
		cfg.ProbeAfter = defaultProbeAfter
	}
	if cfg.ProbeTimeout <= 0 {
		cfg.ProbeTimeout = defaultProbeTimeout
	}
	log := opts.Logger
	if log.GetSink() == nil {
		log = logr.Discard()
	}
	log = log.WithName("libvirt")
	if cfg.Address != "" {
		log = log.WithValues("address", cfg.Address)
	}
	closeCtx, cancelAll := context.WithCancel(context.Background())
	return &Session{
		pool:        pool,
		cfg:         cfg,
		log:         log.WithValues("uri", cfg.URI),
		bareChannel: opts.bareChannel,
		rpc:         newRPCMeter(opts.MeterProvider, opts.MetricAttributes),
		closing:     make(chan struct{}),
		closeCtx:    closeCtx,
		cancelAll:   cancelAll,
	}
}

func (s *Session) goOwned(f func()) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		f()
	}()
	return true
}

// errClosed is the cause of every call failing because the Session closed.
var errClosed = errors.New("libvirt session closed")

// fail is the *sshconn.Error of kind for op: the error type kvm2 and the
// image cache classify, whichever layer the failure comes from.
func (s *Session) fail(kind sshconn.Kind, op string, err error) error {
	return &sshconn.Error{Kind: kind, Address: s.cfg.Address, Op: op, Err: err}
}

func (s *Session) closedError(op string) error {
	return s.fail(sshconn.KindClosed, op, errClosed)
}

// ctxError wraps why a context ended (budget.Err): a deadline that ran out,
// the caller's or CallTimeout (*budget.TimeoutError), is KindUnreachable
// (libvirtd did not answer in time), a cancellation is left unclassified.
func (s *Session) ctxError(op string, err error) error {
	k := sshconn.KindUnknown
	var te *budget.TimeoutError
	if errors.Is(err, context.DeadlineExceeded) || errors.As(err, &te) {
		k = sshconn.KindUnreachable
	}
	return s.fail(k, op, err)
}

// Do runs fn with the shared *libvirt.Libvirt, connecting it first when
// there is none or the previous one died (libvirtd restarted, SSH link
// dead): a dead connection is detected before fn runs, so the first Do
// after a libvirtd restart already runs on a fresh connection.
//
// fn runs in its own goroutine. When ctx ends (or, if ctx has no deadline,
// Config.CallTimeout runs out) Do returns promptly an error wrapping
// ctx.Err() (KindUnreachable for a deadline, unclassified for a cancel),
// or, when CallTimeout ran out, a *budget.TimeoutError naming it
// (KindUnreachable; it does not match context.DeadlineExceeded, which is
// the caller's). The call is abandoned for this caller only: the shared
// connection stays up for every other caller, the RPC still completes on
// libvirtd and its reply is discarded when it arrives. The connection is
// torn down only when liveness says it is dead: the SSH link's keepalives
// go unanswered, go-libvirt sees its socket close, or an abandoned call
// stays unanswered for Config.ProbeAfter and a probe call is not answered
// within ProbeTimeout either. Close ends calls in flight at once.
//
// If fn fails and the libvirt connection was lost, the connection is
// marked dead and the error is returned as an *sshconn.Error of
// KindUnreachable; any other error of fn (e.g. a libvirt.Error) is
// returned unchanged.
//
// Because an abandoned fn goes on running after Do returned, the caller
// must not touch what fn writes unless Do returned nil (then fn has
// finished, and everything it wrote happened before Do returned). Write
// results into variables fn owns and read them only on success.
func (s *Session) Do(ctx context.Context, fn func(*libvirt.Libvirt) error) error {
	if err := budget.Err(ctx); err != nil {
		// Never start a call whose caller has already gone: on a loaded
		// machine its reply could otherwise win the race against ctx.
		return s.ctxError("libvirt call", err)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = budget.WithTimeout(ctx, "CallTimeout", s.cfg.CallTimeout)
		defer cancel()
	}
	c, err := s.shared(ctx)
	if err != nil {
		return err
	}
	err = s.runShared(ctx, c, "libvirt call", func() error { return fn(c.lv) })
	if err == nil {
		return nil
	}
	var own *sshconn.Error
	if errors.As(err, &own) {
		return err // abandoned by ctx, or closed
	}
	if c.lost(err) {
		c.broken.Store(true)
		s.log.V(1).Info("libvirt connection lost", "err", err.Error())
		return s.fail(sshconn.KindUnreachable, "libvirt call", err)
	}
	return err
}

// start runs f in an owned goroutine; its result arrives on the returned
// channel (buffered: nobody has to receive it).
func (s *Session) start(f func() error) (<-chan error, bool) {
	done := make(chan error, 1)
	if !s.goOwned(func() { done <- f() }) {
		return nil, false
	}
	return done, true
}

// runShared runs f on the shared connection c and waits for it, for ctx or
// for Close. When ctx ends first, f is abandoned for this caller only (see
// Do); a watcher owned by s probes c if f stays unanswered.
func (s *Session) runShared(ctx context.Context, c *rpcConn, op string, f func() error) error {
	done, ok := s.start(f)
	if !ok {
		return s.closedError(op)
	}
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	case <-s.closing:
		return s.closedError(op)
	}
	cause := budget.Err(ctx)
	s.log.V(1).Info("libvirt call abandoned by its caller; the connection stays up", "op", op, "err", cause.Error())
	s.goOwned(func() { s.watchAbandoned(c, done, op) })
	return s.ctxError(op, cause)
}

// runExclusive runs f on a connection nobody else uses yet (connecting).
// When ctx ends first the connection is torn down so that f returns.
func (s *Session) runExclusive(ctx context.Context, c *rpcConn, op string, f func() error) error {
	done, ok := s.start(f)
	if !ok {
		return s.closedError(op)
	}
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	case <-s.closing:
		s.abort(c, done, errClosed)
		return s.closedError(op)
	}
	cause := budget.Err(ctx)
	s.log.V(1).Info("abandoning libvirt connect", "op", op, "err", cause.Error())
	s.abort(c, done, fmt.Errorf("%s abandoned: %w", op, cause))
	return s.ctxError(op, cause)
}

// watchAbandoned waits for an abandoned call's reply. Each time it stays
// unanswered for ProbeAfter, c is probed; a connection that does not
// answer its probe is torn down, which ends the call.
func (s *Session) watchAbandoned(c *rpcConn, done <-chan error, op string) {
	t := time.NewTimer(s.cfg.ProbeAfter)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-s.closing:
			return // Close tears the connection down; the call's goroutine is waited for there
		case <-t.C:
		}
		if err := s.probe(c); err != nil {
			cause := fmt.Errorf("abandoned %s unanswered for %v and the connection did not answer a probe: %w", op, s.cfg.ProbeAfter, err)
			s.log.Info("libvirt connection not answering; tearing it down", "err", cause.Error())
			s.abort(c, done, cause)
			return
		}
		t.Reset(s.cfg.ProbeAfter)
	}
}

// probe asks libvirtd on c for its version, bounded by ProbeTimeout; nil
// means c answers. Concurrent probes of one connection share one call (a
// probe answered within the last ProbeAfter/2 counts).
func (s *Session) probe(c *rpcConn) error {
	c.probeMu.Lock()
	defer c.probeMu.Unlock()
	if c.dead() {
		return errors.New("connection dead")
	}
	if !c.lastAlive.IsZero() && time.Since(c.lastAlive) < s.cfg.ProbeAfter/2 {
		return nil
	}
	done, ok := s.start(func() error { _, err := c.lv.ConnectGetLibVersion(); return err })
	if !ok {
		return errClosed
	}
	t := time.NewTimer(s.cfg.ProbeTimeout)
	defer t.Stop()
	select {
	case err := <-done:
		if err != nil && c.lost(err) {
			return err
		}
		c.lastAlive = time.Now() // any answer, even an error, is a sign of life
		return nil
	case <-t.C:
		return fmt.Errorf("no answer within %v", s.cfg.ProbeTimeout)
	case <-s.closing:
		return errClosed
	}
}

// abort breaks c so that a call blocked on it returns, bounded in time.
func (s *Session) abort(c *rpcConn, done <-chan error, cause error) {
	c.broken.Store(true)
	s.teardown(c)
	t := time.NewTimer(gentleAbort)
	defer t.Stop()
	select {
	case <-done:
		return
	case <-t.C:
	}
	// The peer did not even answer the channel close: kill the link.
	s.pool.Kill(c.client, cause)
	t.Reset(abortWait)
	select {
	case <-done:
	case <-t.C:
		s.log.Info("libvirt call still running after the link was killed", "err", cause)
	}
}

// teardown closes c's channel without waiting on the peer (the close runs
// in an owned goroutine; a frozen peer is cut by killing the link).
func (s *Session) teardown(c *rpcConn) {
	c.once.Do(func() {
		c.broken.Store(true)
		// When s is closed, Close closes what is left.
		s.goOwned(func() { _ = c.conn.Close() })
	})
}

// shared returns a live shared connection, connecting a new one if needed.
func (s *Session) shared(ctx context.Context) (*rpcConn, error) {
	for {
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			return nil, s.closedError("libvirt connect")
		}
		if c := s.cur; c != nil && !c.dead() {
			s.mu.Unlock()
			return c, nil
		}
		if ch := s.connecting; ch != nil {
			s.mu.Unlock()
			select {
			case <-ch:
				continue
			case <-ctx.Done():
				return nil, s.ctxError("libvirt connect", budget.Err(ctx))
			case <-s.closing:
				return nil, s.closedError("libvirt connect")
			}
		}
		old := s.cur
		ch := make(chan struct{})
		s.connecting = ch
		s.mu.Unlock()

		if old != nil {
			s.teardown(old)
		}
		cctx, cancel := context.WithCancel(ctx)
		stop := context.AfterFunc(s.closeCtx, cancel) // Close ends the connect
		c, err := s.connect(cctx)
		stop()
		cancel()

		s.mu.Lock()
		s.connecting = nil
		close(ch)
		if s.closed {
			s.mu.Unlock()
			if c != nil {
				s.pool.Kill(c.client, errors.New("libvirt session closed while connecting"))
			}
			return nil, s.closedError("libvirt connect")
		}
		if err == nil {
			s.cur = c
		}
		s.mu.Unlock()
		return c, err
	}
}

// connect opens a channel to the libvirt socket on the pool's shared SSH
// connection and runs ConnectToURI on it, bounded by ctx.
func (s *Session) connect(ctx context.Context) (*rpcConn, error) {
	start := time.Now()
	client, err := s.pool.Client(ctx)
	if err != nil {
		return nil, err
	}
	ch, err := s.pool.DialUnix(ctx, client, s.cfg.Socket)
	if err != nil {
		return nil, err
	}
	c := s.newConn(ch, client)
	if err := s.connectURI(ctx, c); err != nil {
		return nil, err
	}
	s.log.V(1).Info("libvirt connected", "elapsed", time.Since(start))
	return c, nil
}

// newConn puts go-libvirt on the channel ch of client, behind a stream
// guard.
func (s *Session) newConn(ch net.Conn, client *ssh.Client) *rpcConn {
	c := &rpcConn{conn: ch, client: client, linkUp: s.pool.Done(client)}
	if s.bareChannel {
		c.lv = libvirt.NewWithDialer(&onceDialer{conn: ch})
		return c
	}
	c.guard = newStreamGuard(ch)
	if s.rpc != nil {
		c.guard.own.rpc = &rpcCalls{m: s.rpc}
	}
	c.lv = libvirt.NewWithDialer(&onceDialer{conn: c.guard})
	return c
}

func (s *Session) connectURI(ctx context.Context, c *rpcConn) error {
	op := "libvirt connect " + s.cfg.URI
	err := s.runExclusive(ctx, c, op, func() error { return c.lv.ConnectToURI(libvirt.ConnectURI(s.cfg.URI)) })
	if err == nil {
		return nil
	}
	s.teardown(c)
	var own *sshconn.Error
	if errors.As(err, &own) {
		return err
	}
	if c.lost(err) {
		return s.fail(sshconn.KindUnreachable, op, err)
	}
	// libvirtd answered: not the link's failure, so not an *sshconn.Error.
	if s.cfg.Address != "" {
		return fmt.Errorf("libvirt %s: connect %s: %w", s.cfg.Address, s.cfg.URI, err)
	}
	return fmt.Errorf("libvirt: connect %s: %w", s.cfg.URI, err)
}

// Dead reports whether the shared libvirt connection is known to be
// unusable (connection lost, SSH link dead, abandoned by a ctx, or the
// Session closed). It is false before the first connection. The next Do
// reconnects.
func (s *Session) Dead() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return true
	}
	return s.cur != nil && s.cur.dead()
}

// Close disconnects the shared libvirt connection (politely when the peer
// answers within half a second; otherwise the channel is closed and, if the
// peer does not answer that either, the SSH link carrying it is killed) and
// waits (bounded, about a second) for the Session's goroutines. It does not
// close the Pool or the Dedicated connections. Calls after Close fail with
// KindClosed. Close is idempotent.
func (s *Session) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	c := s.cur
	var polite chan error
	if c != nil && !c.dead() {
		polite = make(chan error, 1)
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			polite <- c.lv.Disconnect()
		}()
	}
	s.closed = true
	close(s.closing)
	s.cancelAll()
	s.mu.Unlock()

	var err error
	if c != nil {
		if polite != nil {
			t := time.NewTimer(politeClose)
			select {
			case err = <-polite:
			case <-t.C:
				err = errors.New("libvirt disconnect did not finish in time; link killed")
				s.pool.Kill(c.client, errors.New("libvirt close timed out"))
			}
			t.Stop()
		}
		c.broken.Store(true)
		// Make sure the channel is closed (and with it go-libvirt's reader).
		c.once.Do(func() {
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				_ = c.conn.Close()
			}()
		})
	}
	if !budget.Wait(&s.wg, closeWait) {
		if c != nil {
			s.pool.Kill(c.client, errors.New("libvirt close: channel close did not finish"))
		}
		if !budget.Wait(&s.wg, 200*time.Millisecond) {
			return s.fail(sshconn.KindUnknown, "libvirt close", fmt.Errorf("goroutines still running after %v", closeWait))
		}
	}
	if err != nil {
		return s.fail(sshconn.KindUnknown, "libvirt close", err)
	}
	return nil
}

// Dedicated is a libvirt connection on its own SSH connection, for long
// transfers (image uploads and read-backs). L may be used directly (no Do
// wrapper); to abandon a blocked call, Kill the connection. Its
// StorageVolUpload and StorageVolDownload make those stream calls with
// this package's own stream code, which moves the bytes without
// go-libvirt's buffers.
type Dedicated struct {
	L *libvirt.Libvirt

	s      *Session
	client *ssh.Client
	linkUp <-chan struct{}
	guard  *streamGuard // nil only on a bare channel (the upstream reproducer)
	once   sync.Once
}

// Dedicated dials a new SSH connection (Pool.Dedicated), opens the libvirt
// socket on it and connects, all bounded by ctx (or, when ctx has no
// deadline, by Config.CallTimeout). The caller must Close it.
func (s *Session) Dedicated(ctx context.Context) (*Dedicated, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = budget.WithTimeout(ctx, "CallTimeout", s.cfg.CallTimeout)
		defer cancel()
	}
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return nil, s.closedError("libvirt dedicated connect")
	}
	var cancel context.CancelFunc
	ctx, cancel = context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(s.closeCtx, cancel)() // Close ends the connect
	client, err := s.pool.Dedicated(ctx)
	if err != nil {
		return nil, err
	}
	ch, err := s.pool.DialUnix(ctx, client, s.cfg.Socket)
	if err != nil {
		s.pool.Kill(client, errors.New("dedicated connect failed"))
		return nil, err
	}
	c := s.newConn(ch, client)
	if err := s.connectURI(ctx, c); err != nil {
		s.pool.Kill(client, errors.New("dedicated connect failed"))
		return nil, err
	}
	return &Dedicated{L: c.lv, s: s, client: client, linkUp: c.linkUp, guard: c.guard}, nil
}

// Close disconnects libvirt (politely if the peer answers within half a
// second), then closes the SSH connection. It never blocks on a dead peer.
func (d *Dedicated) Close() error {
	var err error
	d.once.Do(func() {
		if !isClosed(d.linkUp) {
			done := make(chan error, 1)
			if d.s.goOwned(func() { done <- d.L.Disconnect() }) {
				t := time.NewTimer(politeClose)
				select {
				case err = <-done:
				case <-t.C:
					err = errors.New("libvirt disconnect did not finish in time")
				}
				t.Stop()
			}
		}
		d.s.pool.Kill(d.client, errors.New("dedicated connection closed")) // dead first, then the TCP conn
		_ = d.client.Close()
		if g := d.guard; g != nil {
			// An upload's sender ends when its source's Read returns
			// (its writes fail now that the link is gone).
			if !budget.Wait(&g.own.senders, ownSenderWait) {
				d.s.log.Info("an upload's source is still being read after its connection closed", "elapsed", ownSenderWait)
			}
			if held, dropped := g.heldPackets.Load(), g.droppedPackets.Load(); held+dropped > 0 {
				d.s.log.V(1).Info("stream guard kept go-libvirt's router from deadlocking",
					"heldBeforeReply", held, "droppedAfterEnd", dropped)
			}
		}
	})
	if err != nil {
		return d.s.fail(sshconn.KindUnknown, "close dedicated", err)
	}
	return nil
}

// Kill closes the dedicated SSH connection at once (to abort a transfer);
// calls blocked on L return with errors. Close is still allowed afterwards.
func (d *Dedicated) Kill() {
	d.s.pool.Kill(d.client, nil)
}

// isClosed reports whether ch is closed.
func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// closeWait bounds how long Close waits for the goroutines it owns.
const closeWait = time.Second
