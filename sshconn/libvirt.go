package sshconn

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
	"github.com/go-logr/logr"
)

// LibvirtConfig describes the libvirt side of a Libvirt session.
type LibvirtConfig struct {
	// Socket is the remote path of libvirtd's read-write unix socket.
	// Zero: /var/run/libvirt/libvirt-sock.
	Socket string `json:"socket,omitempty"`
	// URI is the libvirt connection URI opened on that socket.
	// Zero: qemu:///system.
	URI string `json:"uri,omitempty"`
	// CallTimeout is the budget of one Do (connecting included) when its ctx
	// has no deadline. Zero: 2m.
	CallTimeout time.Duration `json:"callTimeout,omitempty"`
	// ProbeAfter is how long a call abandoned by its caller (its ctx ended)
	// may stay unanswered before the shared session is probed with a cheap
	// call; a session whose probe is not answered within ProbeTimeout is
	// torn down (libvirtd stopped answering). Zero: 30s.
	ProbeAfter time.Duration `json:"probeAfter,omitempty"`
	// ProbeTimeout bounds that probe. Zero: 10s.
	ProbeTimeout time.Duration `json:"probeTimeout,omitempty"`
	// Logger receives debug/info lines. Zero value: discard.
	Logger logr.Logger `json:"-"`
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

// Libvirt is a go-libvirt connection to one host's libvirtd, carried on a
// unix socket channel of a Pool's shared SSH connection, connected on first
// use and reconnected after it dies. Libvirt does not own the Pool: closing
// it disconnects only its libvirt connection. It is safe for concurrent use;
// go-libvirt multiplexes concurrent calls over the one connection.
type Libvirt struct {
	pool *Pool
	cfg  LibvirtConfig
	log  logr.Logger

	mu         sync.Mutex
	closed     bool
	closing    chan struct{}
	closeCtx   context.Context // ended by Close: connects in flight end
	cancelAll  context.CancelFunc
	sess       *session      // current session; may be dead (kept for Dead)
	connecting chan struct{} // non-nil while a session is being connected

	wg sync.WaitGroup // every goroutine Libvirt starts
}

// session is one libvirt connection on one unix socket channel.
type session struct {
	lv     *libvirt.Libvirt
	conn   net.Conn // the SSH channel
	link   *link    // the SSH connection carrying it
	guard  *streamGuard
	broken atomic.Bool
	once   sync.Once

	probeMu   sync.Mutex // one liveness probe at a time
	lastAlive time.Time  // when a probe was last answered (under probeMu)
}

// dead reports whether the session can no longer serve calls: marked broken
// by us, go-libvirt saw its socket close (libvirtd restarted, channel
// closed), or the SSH link died.
func (s *session) dead() bool {
	if s.broken.Load() {
		return true
	}
	select {
	case <-s.lv.Disconnected():
		return true
	default:
	}
	return s.link.isDead()
}

// lost reports whether err from a call means the connection was lost.
func (s *session) lost(err error) bool {
	if errors.Is(err, libvirt.ErrInterrupted) {
		return true
	}
	// go-libvirt returns a bare EINVAL once its socket is disconnected.
	var errno syscall.Errno
	if errors.As(err, &errno) && errno == syscall.EINVAL {
		return true
	}
	return s.dead()
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
		return nil, errors.New("sshconn: libvirt dialer already used (reconnect through sshconn.Libvirt)")
	}
	return c, nil
}

// testNoStreamGuard, set by the upstream reproducer test only, hands
// go-libvirt the bare channel.
var testNoStreamGuard bool

// NewLibvirt returns a Libvirt over pool. It does not dial.
func NewLibvirt(pool *Pool, cfg LibvirtConfig) *Libvirt {
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
	log := cfg.Logger
	if log.GetSink() == nil {
		log = logr.Discard()
	}
	closeCtx, cancelAll := context.WithCancel(context.Background())
	return &Libvirt{
		pool:      pool,
		cfg:       cfg,
		log:       log.WithName("sshconn-libvirt").WithValues("addr", pool.cfg.Addr, "uri", cfg.URI),
		closing:   make(chan struct{}),
		closeCtx:  closeCtx,
		cancelAll: cancelAll,
	}
}

func (l *Libvirt) goOwned(f func()) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return false
	}
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		f()
	}()
	return true
}

func (l *Libvirt) closedError(op string) error {
	return &Error{Kind: KindClosed, Addr: l.pool.cfg.Addr, Op: op, Err: errors.New("libvirt session closed")}
}

// Do runs fn with the shared *libvirt.Libvirt, connecting it first when
// there is none or the previous one died (libvirtd restarted, SSH link
// dead): a dead session is detected before fn runs, so the first Do after a
// libvirtd restart already runs on a fresh connection.
//
// fn runs in its own goroutine. When ctx ends (or, if ctx has no deadline,
// LibvirtConfig.CallTimeout runs out) Do returns promptly an error wrapping
// ctx.Err() (KindUnreachable for a deadline, unclassified for a cancel), or,
// when CallTimeout ran out, a *budget.TimeoutError naming it (KindUnreachable; it
// does not match context.DeadlineExceeded, which is the caller's).
// The call is abandoned for this caller only: the shared session stays up
// for every other caller, the RPC still completes on libvirtd and its reply
// is discarded when it arrives. The session is torn down only when liveness
// says it is dead: the SSH link's keepalives go unanswered, go-libvirt sees
// its socket close, or an abandoned call stays unanswered for
// LibvirtConfig.ProbeAfter and a probe call is not answered within
// ProbeTimeout either. Close ends calls in flight at once.
//
// If fn fails and the libvirt connection was lost, the session is marked
// dead and the error is returned as *Error{Kind: KindUnreachable}; any other
// error of fn (e.g. a libvirt.Error) is returned unchanged.
//
// Because an abandoned fn goes on running after Do returned, the caller
// must not touch what fn writes unless Do returned nil (then fn has
// finished, and everything it wrote happened before Do returned). Write
// results into variables fn owns and read them only on success.
func (l *Libvirt) Do(ctx context.Context, fn func(*libvirt.Libvirt) error) error {
	if err := budget.Err(ctx); err != nil {
		// Never start a call whose caller has already gone: on a loaded
		// machine its reply could otherwise win the race against ctx.
		return ctxError(l.pool.cfg.Addr, "libvirt call", err)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = budget.WithTimeout(ctx, "CallTimeout", l.cfg.CallTimeout)
		defer cancel()
	}
	s, err := l.session(ctx)
	if err != nil {
		return err
	}
	err = l.runShared(ctx, s, "libvirt call", func() error { return fn(s.lv) })
	if err == nil {
		return nil
	}
	var own *Error
	if errors.As(err, &own) {
		return err // abandoned by ctx, or closed
	}
	if s.lost(err) {
		s.broken.Store(true)
		l.log.V(1).Info("libvirt connection lost", "err", err.Error())
		return &Error{Kind: KindUnreachable, Addr: l.pool.cfg.Addr, Op: "libvirt call", Err: err}
	}
	return err
}

// start runs f in an owned goroutine; its result arrives on the returned
// channel (buffered: nobody has to receive it).
func (l *Libvirt) start(f func() error) (<-chan error, bool) {
	done := make(chan error, 1)
	if !l.goOwned(func() { done <- f() }) {
		return nil, false
	}
	return done, true
}

// runShared runs f on the shared session s and waits for it, for ctx or
// for Close. When ctx ends first, f is abandoned for this caller only (see
// Do); a watcher owned by l probes the session if f stays unanswered.
func (l *Libvirt) runShared(ctx context.Context, s *session, op string, f func() error) error {
	done, ok := l.start(f)
	if !ok {
		return l.closedError(op)
	}
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	case <-l.closing:
		return l.closedError(op)
	}
	cause := budget.Err(ctx)
	l.log.V(1).Info("libvirt call abandoned by its caller; the session stays up", "op", op, "err", cause.Error())
	l.goOwned(func() { l.watchAbandoned(s, done, op) })
	return ctxError(l.pool.cfg.Addr, op, cause)
}

// runExclusive runs f on a session nobody else uses yet (connecting). When
// ctx ends first the session is torn down so that f returns.
func (l *Libvirt) runExclusive(ctx context.Context, s *session, op string, f func() error) error {
	done, ok := l.start(f)
	if !ok {
		return l.closedError(op)
	}
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	case <-l.closing:
		l.abort(s, done, errors.New("libvirt session closed"))
		return l.closedError(op)
	}
	cause := budget.Err(ctx)
	l.log.V(1).Info("abandoning libvirt connect", "op", op, "err", cause.Error())
	l.abort(s, done, fmt.Errorf("%s abandoned: %w", op, cause))
	return ctxError(l.pool.cfg.Addr, op, cause)
}

// watchAbandoned waits for an abandoned call's reply. Each time it stays
// unanswered for ProbeAfter, the session is probed; a session that does not
// answer its probe is torn down, which ends the call.
func (l *Libvirt) watchAbandoned(s *session, done <-chan error, op string) {
	t := time.NewTimer(l.cfg.ProbeAfter)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-l.closing:
			return // Close tears the session down; the call's goroutine is waited for there
		case <-t.C:
		}
		if err := l.probe(s); err != nil {
			cause := fmt.Errorf("abandoned %s unanswered for %v and the session did not answer a probe: %w", op, l.cfg.ProbeAfter, err)
			l.log.Info("libvirt session not answering; tearing it down", "err", cause.Error())
			l.abort(s, done, cause)
			return
		}
		t.Reset(l.cfg.ProbeAfter)
	}
}

// probe asks libvirtd on s for its version, bounded by ProbeTimeout; nil
// means the session answers. Concurrent probes of one session share one
// call (a probe answered within the last ProbeAfter/2 counts).
func (l *Libvirt) probe(s *session) error {
	s.probeMu.Lock()
	defer s.probeMu.Unlock()
	if s.dead() {
		return errors.New("session dead")
	}
	if !s.lastAlive.IsZero() && time.Since(s.lastAlive) < l.cfg.ProbeAfter/2 {
		return nil
	}
	done, ok := l.start(func() error { _, err := s.lv.ConnectGetLibVersion(); return err })
	if !ok {
		return errors.New("libvirt session closed")
	}
	t := time.NewTimer(l.cfg.ProbeTimeout)
	defer t.Stop()
	select {
	case err := <-done:
		if err != nil && s.lost(err) {
			return err
		}
		s.lastAlive = time.Now() // any answer, even an error, is a sign of life
		return nil
	case <-t.C:
		return fmt.Errorf("no answer within %v", l.cfg.ProbeTimeout)
	case <-l.closing:
		return errors.New("libvirt session closed")
	}
}

// abort breaks s so that a call blocked on it returns, bounded in time.
func (l *Libvirt) abort(s *session, done <-chan error, cause error) {
	s.broken.Store(true)
	l.teardown(s)
	t := time.NewTimer(gentleAbort)
	defer t.Stop()
	select {
	case <-done:
		return
	case <-t.C:
	}
	// The peer did not even answer the channel close: kill the link.
	l.pool.killLink(s.link, cause)
	t.Reset(abortWait)
	select {
	case <-done:
	case <-t.C:
		l.log.Info("libvirt call still running after the link was killed", "err", cause)
	}
}

// teardown closes the session's channel without waiting on the peer (the
// close runs in an owned goroutine; a frozen peer is cut by killing the link).
func (l *Libvirt) teardown(s *session) {
	s.once.Do(func() {
		s.broken.Store(true)
		if !l.goOwned(func() { _ = s.conn.Close() }) {
			// Closed: Close kills what is left.
			return
		}
	})
}

// session returns a live session, connecting a new one if needed.
func (l *Libvirt) session(ctx context.Context) (*session, error) {
	for {
		l.mu.Lock()
		if l.closed {
			l.mu.Unlock()
			return nil, l.closedError("libvirt connect")
		}
		if s := l.sess; s != nil && !s.dead() {
			l.mu.Unlock()
			return s, nil
		}
		if ch := l.connecting; ch != nil {
			l.mu.Unlock()
			select {
			case <-ch:
				continue
			case <-ctx.Done():
				return nil, ctxError(l.pool.cfg.Addr, "libvirt connect", budget.Err(ctx))
			case <-l.closing:
				return nil, l.closedError("libvirt connect")
			}
		}
		old := l.sess
		ch := make(chan struct{})
		l.connecting = ch
		l.mu.Unlock()

		if old != nil {
			l.teardown(old)
		}
		cctx, cancel := context.WithCancel(ctx)
		stop := context.AfterFunc(l.closeCtx, cancel) // Close ends the connect
		s, err := l.connect(cctx)
		stop()
		cancel()

		l.mu.Lock()
		l.connecting = nil
		close(ch)
		if l.closed {
			l.mu.Unlock()
			if s != nil {
				l.pool.killLink(s.link, errors.New("libvirt session closed while connecting"))
			}
			return nil, l.closedError("libvirt connect")
		}
		if err == nil {
			l.sess = s
		}
		l.mu.Unlock()
		return s, err
	}
}

// connect opens a channel to the libvirt socket on the shared link and runs
// ConnectToURI on it, bounded by ctx.
func (l *Libvirt) connect(ctx context.Context) (*session, error) {
	start := time.Now()
	conn, lk, err := l.pool.dialUnix(ctx, l.cfg.Socket)
	if err != nil {
		return nil, err
	}
	s := l.newSession(conn, lk)
	if err := l.connectURI(ctx, s); err != nil {
		return nil, err
	}
	l.log.V(1).Info("libvirt connected", "elapsed", time.Since(start))
	return s, nil
}

func (l *Libvirt) newSession(conn net.Conn, lk *link) *session {
	if testNoStreamGuard {
		return &session{lv: libvirt.NewWithDialer(&onceDialer{conn: conn}), conn: conn, link: lk}
	}
	g := newStreamGuard(conn)
	return &session{lv: libvirt.NewWithDialer(&onceDialer{conn: g}), conn: conn, guard: g, link: lk}
}

func (l *Libvirt) connectURI(ctx context.Context, s *session) error {
	op := "libvirt connect " + l.cfg.URI
	err := l.runExclusive(ctx, s, op, func() error { return s.lv.ConnectToURI(libvirt.ConnectURI(l.cfg.URI)) })
	if err == nil {
		return nil
	}
	l.teardown(s)
	var own *Error
	if errors.As(err, &own) {
		return err
	}
	if s.lost(err) {
		return &Error{Kind: KindUnreachable, Addr: l.pool.cfg.Addr, Op: op, Err: err}
	}
	return fmt.Errorf("sshconn: %s on %s: %w", op, l.pool.cfg.Addr, err)
}

// Dead reports whether the current libvirt session is known to be unusable
// (connection lost, SSH link dead, abandoned by a ctx, or Libvirt closed). It
// is false before the first connection. The next Do reconnects.
func (l *Libvirt) Dead() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return true
	}
	return l.sess != nil && l.sess.dead()
}

// Close disconnects the libvirt session (politely when the peer answers
// within half a second; otherwise the channel is closed and, if the peer does
// not answer that either, the SSH link carrying it is killed) and waits
// (bounded, about a second) for Libvirt's goroutines. It does not close the
// Pool. Calls after Close fail with KindClosed. Close is idempotent.
func (l *Libvirt) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	s := l.sess
	var polite chan error
	if s != nil && !s.dead() {
		polite = make(chan error, 1)
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			polite <- s.lv.Disconnect()
		}()
	}
	l.closed = true
	close(l.closing)
	l.cancelAll()
	l.mu.Unlock()

	var err error
	if s != nil {
		if polite != nil {
			t := time.NewTimer(politeClose)
			select {
			case err = <-polite:
			case <-t.C:
				err = errors.New("libvirt disconnect did not finish in time; link killed")
				l.pool.killLink(s.link, errors.New("libvirt close timed out"))
			}
			t.Stop()
		}
		s.broken.Store(true)
		// Make sure the channel is closed (and with it go-libvirt's reader).
		s.once.Do(func() {
			l.wg.Add(1)
			go func() {
				defer l.wg.Done()
				_ = s.conn.Close()
			}()
		})
	}
	if !waitBounded(&l.wg, closeWait) {
		if s != nil {
			l.pool.killLink(s.link, errors.New("libvirt close: channel close did not finish"))
		}
		if !waitBounded(&l.wg, 200*time.Millisecond) {
			return &Error{Kind: KindUnknown, Addr: l.pool.cfg.Addr, Op: "libvirt close",
				Err: fmt.Errorf("goroutines still running after %v", closeWait)}
		}
	}
	if err != nil {
		return &Error{Kind: KindUnknown, Addr: l.pool.cfg.Addr, Op: "libvirt close", Err: err}
	}
	return nil
}

// DedicatedConn is a libvirt connection on its own SSH connection, for long
// transfers (image uploads). L may be used directly (no Do wrapper); to
// abandon a blocked call, Kill the connection. Its StorageVolUpload and
// StorageVolDownload make those stream calls with sshconn's own stream code
// (ownstream.go), which moves the bytes without go-libvirt's buffers.
type DedicatedConn struct {
	L *libvirt.Libvirt

	pool  *Pool
	link  *link
	guard *streamGuard // nil only in the upstream reproducer
	log   logr.Logger
	once  sync.Once
}

// Dedicated dials a new SSH connection (Pool.Dedicated), opens the libvirt
// socket on it and connects, all bounded by ctx. The caller must Close it.
func (l *Libvirt) Dedicated(ctx context.Context) (*DedicatedConn, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = budget.WithTimeout(ctx, "CallTimeout", l.cfg.CallTimeout)
		defer cancel()
	}
	l.mu.Lock()
	closed := l.closed
	l.mu.Unlock()
	if closed {
		return nil, l.closedError("libvirt dedicated connect")
	}
	var cancel context.CancelFunc
	ctx, cancel = context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(l.closeCtx, cancel)() // Close ends the connect
	lk, err := l.pool.dedicatedLink(ctx)
	if err != nil {
		return nil, err
	}
	conn, err := l.pool.openUnix(ctx, lk, l.cfg.Socket)
	if err != nil {
		l.pool.killLink(lk, errors.New("dedicated connect failed"))
		return nil, err
	}
	s := l.newSession(conn, lk)
	if err := l.connectURI(ctx, s); err != nil {
		l.pool.killLink(lk, errors.New("dedicated connect failed"))
		return nil, err
	}
	return &DedicatedConn{L: s.lv, pool: l.pool, link: lk, guard: s.guard, log: l.log}, nil
}

// Close disconnects libvirt (politely if the peer answers within half a
// second), then closes the SSH connection. It never blocks on a dead peer.
func (d *DedicatedConn) Close() error {
	var err error
	d.once.Do(func() {
		if !d.link.isDead() {
			done := make(chan error, 1)
			if d.pool.goOwned(func() { done <- d.L.Disconnect() }) {
				t := time.NewTimer(politeClose)
				select {
				case err = <-done:
				case <-t.C:
					err = errors.New("libvirt disconnect did not finish in time")
				}
				t.Stop()
			}
		}
		d.link.kill(errors.New("dedicated connection closed")) // dead first, then the TCP conn
		_ = d.link.client.Close()
		if g := d.guard; g != nil {
			// An upload's sender ends when its source's Read returns
			// (its writes fail now that the link is gone).
			if !waitBounded(&g.own.senders, ownSenderWait) {
				d.log.Info("an upload's source is still being read after its connection closed", "waited", ownSenderWait)
			}
			if held, dropped := g.heldPackets.Load(), g.droppedPackets.Load(); held+dropped > 0 {
				d.log.V(1).Info("stream guard kept go-libvirt's router from deadlocking",
					"heldBeforeReply", held, "droppedAfterEnd", dropped)
			}
		}
	})
	if err != nil {
		return &Error{Kind: KindUnknown, Addr: d.link.addr, Op: "close dedicated", Err: err}
	}
	return nil
}

// Kill closes the dedicated SSH connection at once (to abort a transfer);
// calls blocked on L return with errors. Close is still allowed afterwards.
func (d *DedicatedConn) Kill() {
	d.pool.killLink(d.link, errKilled)
}
