package sshconn

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/crypto/ssh"
)

// activityConn records when bytes were last read from the server: any
// traffic counts as a sign of life for the keepalive logic.
//
// It also acknowledges small segments at once. OpenSSH's sshd leaves Nagle's
// algorithm on for a connection without a terminal session (it sets
// TCP_NODELAY only for interactive sessions), so it holds a small packet back
// while an earlier small one is unacknowledged, and Linux delays the
// acknowledgement of a lone small segment by 40 ms or more: an answer sent
// right after a channel window adjustment (which sshd sends as it consumes
// what we wrote) waits for that timer, as a stream's finish and its
// confirmation, or a call and its reply, do on most round trips. After a
// read of fewer than quickAckBelow bytes (control traffic; a bulk data
// stream is acknowledged every other segment anyway) the socket is set to
// TCP_QUICKACK, which sends the pending acknowledgement now.
type activityConn struct {
	net.Conn
	base     time.Time
	last     atomic.Int64 // time.Since(base) of the last successful read
	quickAck func()       // nil: not a TCP socket (or not Linux)
}

// quickAckBelow: reads shorter than this are acknowledged at once.
const quickAckBelow = 512

func newActivityConn(c net.Conn) *activityConn {
	return &activityConn{Conn: c, base: time.Now(), quickAck: quickAcker(c)}
}

func (c *activityConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if n > 0 {
		c.last.Store(int64(time.Since(c.base)))
		if n < quickAckBelow && c.quickAck != nil {
			c.quickAck()
		}
	}
	return n, err
}

// idle is how long ago bytes were last read (or the conn was created).
func (c *activityConn) idle() time.Duration {
	return time.Since(c.base) - time.Duration(c.last.Load())
}

// link is one SSH connection: the shared one of a Pool or a dedicated one.
type link struct {
	nc        *activityConn
	client    *ssh.Client
	dedicated bool
	created   time.Time

	dead  chan struct{} // closed when the link is declared dead (first)
	once  sync.Once
	mu    sync.Mutex
	cause error
}

// kill declares the link dead and tears it down. Order matters: the dead
// channel is closed first (waiters are released), then the TCP conn is closed
// (which unblocks every reader and writer, including ssh's own goroutines).
// Nothing here waits on the peer.
func (l *link) kill(cause error) bool {
	killed := false
	l.once.Do(func() {
		killed = true
		l.mu.Lock()
		l.cause = cause
		l.mu.Unlock()
		close(l.dead)
		_ = l.nc.Close()
	})
	return killed
}

func (l *link) isDead() bool {
	select {
	case <-l.dead:
		return true
	default:
		return false
	}
}

func (l *link) deathCause() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.cause
}

var (
	errPoolClosed = errors.New("pool closed")
	errKilled     = errors.New("link killed by caller")
	errLinkGone   = errors.New("the connection has ended")
)

// reap waits for the SSH connection to end (for any reason) and marks the
// link dead. It is the goroutine that notices a reset or EOF from the server.
func (p *Pool) reap(l *link) {
	err := l.client.Wait()
	if err == nil {
		err = errors.New("connection closed")
	}
	if l.kill(fmt.Errorf("ssh connection ended: %w", err)) {
		p.log.Info("ssh link ended", "dedicated", l.dedicated, "err", err.Error())
	}
	_ = l.client.Close()
	p.mu.Lock()
	delete(p.links, l.client)
	p.mu.Unlock()
}

// keepalive sends keepalive@openssh.com every interval (one in flight at a
// time) and declares the link dead when nothing at all has been read from the
// server for KeepaliveCount intervals — i.e. KeepaliveCount keepalives went
// unanswered. Any reply, even a refusal, counts as an answer; so does any
// other traffic.
func (p *Pool) keepalive(l *link) {
	iv := p.cfg.KeepaliveInterval
	limit := time.Duration(p.cfg.KeepaliveCount) * iv
	tick := time.NewTicker(iv)
	defer tick.Stop()
	check := time.NewTimer(limit)
	defer check.Stop()
	replies := make(chan error, 1)
	inflight := false
	probe := func() {
		inflight = p.goOwned(func() {
			_, _, err := l.client.SendRequest("keepalive@openssh.com", true, nil)
			replies <- err // buffered; at most one probe in flight
		})
	}
	probe()
	for {
		select {
		case <-l.dead:
			return
		case err := <-replies:
			inflight = false
			if err != nil {
				if l.kill(fmt.Errorf("keepalive failed: %w", err)) {
					p.log.Info("ssh link dead", "reason", "keepalive failed", "err", err.Error())
				}
				return
			}
		case <-tick.C:
			if !inflight {
				probe()
			}
		case <-check.C:
			idle := l.nc.idle()
			if idle >= limit {
				cause := fmt.Errorf("no answer for %v (%d keepalives at %v)",
					idle.Round(time.Millisecond), p.cfg.KeepaliveCount, iv)
				if l.kill(cause) {
					p.log.Info("ssh link dead", "reason", cause.Error())
				}
				return
			}
			check.Reset(limit - idle)
		}
	}
}
