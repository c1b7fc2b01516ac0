package sshconn

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/crypto/ssh"
	"golang.org/x/crypto/ssh/knownhosts"
)

// loadSigner reads and parses the private key file. Any failure is
// KindKeyUnreadable; it happens before any network use.
func loadSigner(cfg Config) (ssh.Signer, error) {
	pem, err := os.ReadFile(cfg.KeyFile)
	if err != nil {
		return nil, &Error{Kind: KindKeyUnreadable, Addr: cfg.Addr, Op: "read key file", Err: err}
	}
	signer, err := ssh.ParsePrivateKey(pem)
	if err != nil {
		var missing *ssh.PassphraseMissingError
		if errors.As(err, &missing) {
			err = fmt.Errorf("key file %s is encrypted (only unencrypted keys are supported): %w", cfg.KeyFile, err)
		} else {
			err = fmt.Errorf("key file %s: %w", cfg.KeyFile, err)
		}
		return nil, &Error{Kind: KindKeyUnreadable, Addr: cfg.Addr, Op: "parse key file", Err: err}
	}
	return signer, nil
}

// probeKey is a public key nobody pins: asking the known_hosts callback about
// it returns a *knownhosts.KeyError listing every key known for the host.
var probeKey = func() ssh.PublicKey {
	pub := ed25519.NewKeyFromSeed(make([]byte, ed25519.SeedSize)).Public()
	k, err := ssh.NewPublicKey(pub)
	if err != nil {
		panic(err)
	}
	return k
}()

// loadKnownHosts returns the host key callback for cfg.KnownHostsFile and the
// host key algorithms to offer, pinned types first, so that the pinned key
// type is the one the server presents (a server with ecdsa and ed25519 keys would otherwise
// present ecdsa first, and a known_hosts pinning only ed25519 would then look
// like a mismatch). A missing or unreadable file is KindHostUnknown.
func loadKnownHosts(cfg Config) (ssh.HostKeyCallback, []string, error) {
	cb, err := knownhosts.New(cfg.KnownHostsFile)
	if err != nil {
		return nil, nil, &Error{Kind: KindHostUnknown, Addr: cfg.Addr, Op: "read known_hosts", Err: err}
	}
	var algos []string
	var keyErr *knownhosts.KeyError
	if err := cb(cfg.Addr, &net.TCPAddr{IP: net.IPv4zero}, probeKey); errors.As(err, &keyErr) {
		seen := map[string]bool{}
		add := func(a ...string) {
			for _, s := range a {
				if !seen[s] {
					seen[s] = true
					algos = append(algos, s)
				}
			}
		}
		for _, k := range keyErr.Want {
			switch t := k.Key.Type(); t {
			case ssh.KeyAlgoRSA:
				add(ssh.KeyAlgoRSASHA512, ssh.KeyAlgoRSASHA256, ssh.KeyAlgoRSA)
			default:
				add(t)
			}
		}
		// Every other type after the pinned ones: a host that no longer
		// presents any pinned type then completes the key exchange with
		// another key, which the callback reports as a mismatch (as
		// OpenSSH does), instead of failing with "no common algorithm",
		// which would read as a network fault.
		add(ssh.SupportedAlgorithms().HostKeys...)
	}
	return cb, algos, nil
}

// classifyHandshake maps an ssh.NewClientConn error to a Kind.
func classifyHandshake(err error) Kind {
	var keyErr *knownhosts.KeyError
	var revoked *knownhosts.RevokedError
	switch {
	case errors.As(err, &keyErr):
		if len(keyErr.Want) == 0 {
			return KindHostUnknown
		}
		return KindHostKeyMismatch
	case errors.As(err, &revoked):
		return KindHostKeyMismatch
	case strings.Contains(err.Error(), "unable to authenticate"):
		return KindAuthRefused
	default:
		return KindUnreachable
	}
}

// activityConn records when bytes were last read from the server: any
// traffic counts as a sign of life for the keepalive logic.
type activityConn struct {
	net.Conn
	base time.Time
	last atomic.Int64 // time.Since(base) of the last successful read
}

func newActivityConn(c net.Conn) *activityConn {
	return &activityConn{Conn: c, base: time.Now()}
}

func (c *activityConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if n > 0 {
		c.last.Store(int64(time.Since(c.base)))
	}
	return n, err
}

// idle is how long ago bytes were last read (or the conn was created).
func (c *activityConn) idle() time.Duration {
	return time.Since(c.base) - time.Duration(c.last.Load())
}

// link is one SSH connection: the shared one of a Pool or a dedicated one.
type link struct {
	addr      string
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

// dialLink opens a new SSH connection: key, known_hosts, TCP, handshake. It
// starts the link's keepalive and reaper goroutines (owned by the pool). ctx
// bounds the dial only; it is not stored.
func (p *Pool) dialLink(ctx context.Context, dedicated bool) (*link, error) {
	cfg := p.cfg
	signer, err := loadSigner(cfg)
	if err != nil {
		return nil, err
	}
	hostKeyCB, algos, err := loadKnownHosts(cfg)
	if err != nil {
		return nil, err
	}

	dctx, cancel := context.WithTimeout(ctx, cfg.DialTimeout)
	defer cancel()
	// Pool.Close ends the dial too, so Close never waits for a dial timeout.
	stopOnClose := context.AfterFunc(p.closeCtx, cancel)
	defer stopOnClose()
	var d net.Dialer
	start := time.Now()
	nc, err := d.DialContext(dctx, "tcp", cfg.Addr)
	if err != nil {
		if p.closeCtx.Err() != nil {
			return nil, p.closedError("dial")
		}
		return nil, &Error{Kind: KindUnreachable, Addr: cfg.Addr, Op: "dial", Err: err}
	}
	// The handshake has no context: bound it by a deadline and by ctx.
	if dl, ok := dctx.Deadline(); ok {
		_ = nc.SetDeadline(dl)
	}
	stop := context.AfterFunc(dctx, func() { _ = nc.SetDeadline(time.Unix(1, 0)) })
	if testWrapConn != nil {
		nc = testWrapConn(nc)
	}
	ac := newActivityConn(nc)
	sc, chans, reqs, err := ssh.NewClientConn(ac, cfg.Addr, &ssh.ClientConfig{
		User: cfg.User,
		Auth: []ssh.AuthMethod{ssh.PublicKeys(signer)},
		HostKeyCallback: func(host string, remote net.Addr, key ssh.PublicKey) error {
			if err := hostKeyCB(host, remote, key); err != nil {
				return fmt.Errorf("%w (server presented %s %s; checked against %s)",
					err, key.Type(), ssh.FingerprintSHA256(key), cfg.KnownHostsFile)
			}
			return nil
		},
		HostKeyAlgorithms: algos,
	})
	if !stop() && err == nil {
		// ctx ended just as the handshake finished: honour ctx.
		_ = sc.Close()
		err = dctx.Err()
		if err == nil {
			err = context.Canceled
		}
	}
	if err != nil {
		_ = nc.Close()
		if p.closeCtx.Err() != nil {
			return nil, p.closedError("ssh handshake")
		}
		k := classifyHandshake(err)
		if ctxErr := dctx.Err(); ctxErr != nil && k == KindUnreachable {
			err = fmt.Errorf("%w (%v)", ctxErr, err)
		}
		return nil, &Error{Kind: k, Addr: cfg.Addr, Op: "ssh handshake", Err: err}
	}
	_ = nc.SetDeadline(time.Time{})

	l := &link{
		addr:      cfg.Addr,
		nc:        ac,
		client:    ssh.NewClient(sc, chans, reqs),
		dedicated: dedicated,
		created:   time.Now(),
		dead:      make(chan struct{}),
	}
	if !p.goOwned(func() { p.reap(l) }) {
		l.kill(errPoolClosed)
		_ = l.client.Close()
		return nil, p.closedError("dial")
	}
	if !p.goOwned(func() { p.keepalive(l) }) {
		l.kill(errPoolClosed)
		return nil, p.closedError("dial")
	}
	p.log.V(1).Info("ssh connected", "user", cfg.User, "dedicated", dedicated,
		"elapsed", time.Since(start))
	return l, nil
}

// testWrapConn, when set by a test, wraps every TCP connection a link is
// made of (to observe the close order).
var testWrapConn func(net.Conn) net.Conn

var (
	errPoolClosed = errors.New("pool closed")
	errKilled     = errors.New("link killed by caller")
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
	if l.dedicated {
		p.mu.Lock()
		delete(p.dedicated, l)
		p.mu.Unlock()
	}
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
				cause := fmt.Errorf("no answer from %s for %v (%d keepalives at %v)", l.addr,
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
