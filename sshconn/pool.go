package sshconn

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/egressproxy/egressproxy/internal/budget"
	"github.com/go-logr/logr"
	"golang.org/x/crypto/ssh"
)

// closeWait bounds how long Close waits for the goroutines it owns.
const closeWait = time.Second

// Pool holds one shared SSH connection to one host (Config.Address) for short
// calls, redials it after it dies, and opens dedicated connections for long
// transfers. It is safe for concurrent use.
type Pool struct {
	cfg    Config
	signer ssh.Signer // Options.Signer; nil: a key source of cfg
	log    logr.Logger

	mu        sync.Mutex
	closed    bool
	closing   chan struct{} // closed by Close
	closeCtx  context.Context
	cancelAll context.CancelFunc    // ends closeCtx: dials in flight end at Close
	cur       *link                 // the shared link; may be dead
	dialing   chan struct{}         // non-nil while a dial of the shared link runs
	lastErr   error                 // error of the latest failed dial of the shared link
	failures  int                   // consecutive failed dials (ctx-caused ones excluded)
	retryAt   time.Time             // no new dial before this (backoff)
	links     map[*ssh.Client]*link // every link not yet reaped: the shared one and the dedicated ones
	keys      keyCache              // the signer of the latest key content
	dialed    bool                  // the shared link was dialed once: later dials are redials

	meters poolMeters

	wg sync.WaitGroup // every goroutine the pool starts

	// wrapConn, set by tests before the first dial, wraps every TCP
	// connection a link is made of (to observe the close order).
	wrapConn func(net.Conn) net.Conn
}

// New validates cfg and opts (nil is valid) and returns a Pool. It does
// not dial: the first Client or Dedicated call does. Bad input is an
// *Error of KindConfig wrapping one *egressproxy.FieldError per problem,
// all of them at once, each naming the Go field (Address, Signer, ...),
// before any file or the network is touched.
func New(cfg Config, opts *Options) (*Pool, error) {
	if opts == nil {
		opts = &Options{}
	}
	if err := cfg.validate(opts.Signer != nil); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	log := opts.Logger
	if log.GetSink() == nil {
		log = logr.Discard()
	}
	closeCtx, cancelAll := context.WithCancel(context.Background())
	p := &Pool{
		cfg:       cfg,
		signer:    opts.Signer,
		log:       log.WithName("sshconn").WithValues("address", cfg.Address),
		closing:   make(chan struct{}),
		closeCtx:  closeCtx,
		cancelAll: cancelAll,
		links:     map[*ssh.Client]*link{},
	}
	p.initMeters(opts.MeterProvider, opts.MetricAttributes)
	return p, nil
}

// goOwned starts f in a goroutine the pool waits for on Close. It returns
// false (and does not start f) once the pool is closed.
func (p *Pool) goOwned(f func()) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		f()
	}()
	return true
}

// register records l among the pool's links and starts its reaper and
// keepalive goroutines, unless the pool is closed (then it reports false and
// starts nothing). Pool.Close tears down every link registered before it.
func (p *Pool) register(l *link) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.links[l.client] = l
	for _, f := range []func(*link){p.reap, p.keepalive} {
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			f(l)
		}()
	}
	return true
}

func (p *Pool) closedError(op string) error {
	return &Error{Kind: KindClosed, Address: p.cfg.Address, Op: op, Err: errPoolClosed}
}

// ctxError wraps why a context ended (budget.Err): a deadline that ran
// out, the caller's or one of our budgets (*budget.TimeoutError), is
// KindUnreachable (the peer did not answer in time), a cancellation is left
// unclassified.
func ctxError(addr, op string, err error) error {
	k := KindUnknown
	var te *budget.TimeoutError
	if errors.Is(err, context.DeadlineExceeded) || errors.As(err, &te) {
		k = KindUnreachable
	}
	return &Error{Kind: k, Address: addr, Op: op, Err: err}
}

// Client returns the shared *ssh.Client, dialing it when there is none or
// the previous one died. Failed dials are spaced by a bounded exponential
// backoff (100ms doubling up to MaxRedialBackoff): a call arriving during the
// backoff waits for it when ctx allows, otherwise it fails at once with the
// latest dial error. The first redial after a healthy link died is immediate.
// The caller must not Close the returned client (Kill abandons it).
func (p *Pool) Client(ctx context.Context) (*ssh.Client, error) {
	l, err := p.shared(ctx)
	if err != nil {
		return nil, err
	}
	return l.client, nil
}

// shared returns the shared link, dialing it when there is none or it
// died: one dial at a time, which every other caller waits for, and none
// during the backoff after a failed one.
func (p *Pool) shared(ctx context.Context) (*link, error) {
	for {
		if err := budget.Err(ctx); err != nil {
			return nil, ctxError(p.cfg.Address, "dial", err)
		}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			return nil, p.closedError("dial")
		}
		if l := p.cur; l != nil && !l.isDead() {
			p.mu.Unlock()
			return l, nil
		}
		if ch := p.dialing; ch != nil {
			p.mu.Unlock()
			if err := p.await(ctx, ch); err != nil {
				return nil, err
			}
			continue
		}
		if wait := time.Until(p.retryAt); wait > 0 {
			last := p.lastErr
			p.mu.Unlock()
			if err := p.sitOut(ctx, wait, last); err != nil {
				return nil, err
			}
			continue
		}
		ch := make(chan struct{})
		p.dialing = ch
		redial := p.dialed
		p.dialed = true
		p.mu.Unlock()
		if redial {
			p.redialed()
		}
		return p.dialShared(ctx, ch)
	}
}

// await waits for another caller's dial of the shared link (ch closes when
// it ends), for ctx or for Close.
func (p *Pool) await(ctx context.Context, ch <-chan struct{}) error {
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctxError(p.cfg.Address, "dial", budget.Err(ctx))
	case <-p.closing:
		return p.closedError("dial")
	}
}

// sitOut waits out the backoff left after the failed dial last, or fails
// at once with last when ctx's deadline comes first.
func (p *Pool) sitOut(ctx context.Context, wait time.Duration, last error) error {
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < wait {
		return backingOff(last, wait)
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctxError(p.cfg.Address, "dial", budget.Err(ctx))
	case <-p.closing:
		return p.closedError("dial")
	}
}

// dialShared dials the shared link for the caller that set p.dialing to
// ch, records the outcome (the new link, or the failure and the backoff
// before the next dial) and releases the callers waiting on ch.
func (p *Pool) dialShared(ctx context.Context, ch chan struct{}) (*link, error) {
	l, err := p.dialLink(ctx, false)
	if err != nil {
		p.log.V(1).Info("ssh dial failed", "err", err.Error())
	}

	p.mu.Lock()
	defer p.mu.Unlock()
	p.dialing = nil
	close(ch)
	if p.closed {
		if l != nil {
			l.kill(errPoolClosed)
		}
		return nil, p.closedError("dial")
	}
	if err != nil {
		if ctx.Err() == nil { // our caller's ctx is not the server's fault
			p.failures++
			p.lastErr = err
			backoff := minRedialBackoff << min(p.failures-1, 20)
			if backoff > p.cfg.MaxRedialBackoff || backoff <= 0 {
				backoff = p.cfg.MaxRedialBackoff
			}
			p.retryAt = time.Now().Add(backoff)
		}
		return nil, err
	}
	p.failures, p.lastErr, p.retryAt = 0, nil, time.Time{}
	p.cur = l
	return l, nil
}

// Dead reports whether the shared link is known to be unusable: it was
// declared dead (keepalives unanswered, connection ended, Kill) or the latest
// dial failed, or the pool is closed. It is false before the first dial and
// after a successful (re)dial. The next Client redials a dead link.
func (p *Pool) Dead() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.closed:
		return true
	case p.lastErr != nil:
		return true
	case p.cur != nil:
		return p.cur.isDead()
	default:
		return false
	}
}

// Dedicated dials a new SSH connection, not shared and not subject to the
// shared link's backoff, for a long transfer. It has its own keepalive (a
// dead peer tears it down). The caller ends it with Kill; Pool.Close also
// ends any still open.
func (p *Pool) Dedicated(ctx context.Context) (*ssh.Client, error) {
	if err := budget.Err(ctx); err != nil {
		return nil, ctxError(p.cfg.Address, "dial dedicated", err)
	}
	l, err := p.dialLink(ctx, true)
	if err != nil {
		return nil, err
	}
	return l.client, nil
}

// lookup returns the link of c, or nil when c is not a connection of this
// pool that is still open.
func (p *Pool) lookup(c *ssh.Client) *link {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.links[c]
}

// DialUnix opens a direct-streamlocal channel to the remote unix socket
// path on c, the shared connection (Client) or a dedicated one
// (Dedicated). A refusal by the server is KindForbidden (OpenSSH refuses
// the same way when the socket does not exist or the user may not open
// it). If ctx ends first the channel open is abandoned (its channel is
// closed if it ever opens) and a ctx error is returned. A connection that
// has died, or is not this pool's, is KindUnreachable.
func (p *Pool) DialUnix(ctx context.Context, c *ssh.Client, path string) (net.Conn, error) {
	op := "open unix socket " + path
	l := p.lookup(c)
	if l == nil {
		if p.closeCtx.Err() != nil {
			return nil, p.closedError(op)
		}
		return nil, &Error{Kind: KindUnreachable, Address: p.cfg.Address, Op: op, Err: errLinkGone}
	}
	return p.openUnix(ctx, l, op, path)
}

// openUnix opens the channel to path on l, bounded by ctx and by l's death.
func (p *Pool) openUnix(ctx context.Context, l *link, op, path string) (net.Conn, error) {
	type result struct {
		c   net.Conn
		err error
	}
	res := make(chan result)
	abandon := make(chan struct{})
	if !p.goOwned(func() {
		c, err := l.client.Dial("unix", path)
		select {
		case res <- result{c, err}:
		case <-abandon:
			if c != nil {
				_ = c.Close()
			}
		}
	}) {
		return nil, p.closedError(op)
	}
	select {
	case r := <-res:
		if r.err == nil {
			return r.c, nil
		}
		var oce *ssh.OpenChannelError
		if errors.As(r.err, &oce) {
			return nil, &Error{Kind: KindForbidden, Address: p.cfg.Address, Op: op, Err: r.err}
		}
		// Any other failure means the connection itself is broken.
		l.kill(fmt.Errorf("channel open failed: %w", r.err))
		return nil, &Error{Kind: KindUnreachable, Address: p.cfg.Address, Op: op, Err: r.err}
	case <-ctx.Done():
		close(abandon)
		return nil, ctxError(p.cfg.Address, op, budget.Err(ctx))
	case <-l.dead:
		close(abandon)
		return nil, &Error{Kind: KindUnreachable, Address: p.cfg.Address, Op: op, Err: l.deathCause()}
	}
}

// Done returns a channel that is closed when c's connection is declared
// dead: its keepalives went unanswered, the connection ended, Kill or
// Close. For a client that is not a connection of this pool still open,
// the channel is closed already.
func (p *Pool) Done(c *ssh.Client) <-chan struct{} {
	if l := p.lookup(c); l != nil {
		return l.dead
	}
	return closedChan
}

// closedChan is the Done of a connection that is gone.
var closedChan = func() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}()

// Kill declares c's connection dead and tears it down at once (never
// blocks): calls blocked on it return with errors, and after the shared
// connection was killed the next Client redials without backoff. cause is
// recorded for logs and error messages. A client that is not a connection
// of this pool still open is ignored.
func (p *Pool) Kill(c *ssh.Client, cause error) {
	if cause == nil {
		cause = errKilled
	}
	if l := p.lookup(c); l != nil {
		p.killLink(l, cause)
	}
}

func (p *Pool) killLink(l *link, cause error) {
	if l.kill(cause) {
		p.log.Info("ssh link killed", "dedicated", l.dedicated, "err", cause)
	}
}

// Close ends dials in flight, tears down the shared link and every
// dedicated link still open, and waits (at most about a second) for the
// pool's goroutines. Each link is
// first declared dead, then its TCP connection is closed, and only then its
// ssh.Client, so an unresponsive or stopped peer cannot block Close. Calls
// after Close fail with KindClosed. Close is idempotent.
func (p *Pool) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	close(p.closing)
	p.cancelAll() // dials in flight (TCP connect, handshake) end now
	var links []*link
	if p.cur != nil {
		links = append(links, p.cur)
	}
	for _, l := range p.links {
		if l != p.cur {
			links = append(links, l)
		}
	}
	p.mu.Unlock()
	p.stopMeters() // not under p.mu: a collection in flight may be waiting for it

	for _, l := range links {
		l.kill(errPoolClosed) // dead first, then the TCP conn
	}
	for _, l := range links {
		_ = l.client.Close() // cannot block now: its net.Conn is closed
	}
	if !budget.Wait(&p.wg, closeWait) {
		return &Error{Kind: KindUnknown, Address: p.cfg.Address, Op: "close",
			Err: fmt.Errorf("goroutines still running after %v", closeWait)}
	}
	return nil
}

// backingOff is the error of a dial refused during the backoff that
// followed the failed dial last: last's kind, address and cause, its step
// saying that the pool is backing off.
func backingOff(last error, wait time.Duration) error {
	e := &Error{Kind: KindUnknown, Op: "dial", Err: last}
	var le *Error
	if errors.As(last, &le) {
		e = &Error{Kind: le.Kind, Address: le.Address, Op: le.Op, Err: le.Err}
	}
	e.Op += fmt.Sprintf(" (failed; backing off %v before the next dial)", wait.Round(time.Millisecond))
	return e
}
