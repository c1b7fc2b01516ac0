package sshconn

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/sha256"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/egressproxy/egressproxy/internal/budget"
	"golang.org/x/crypto/ssh"
	"golang.org/x/crypto/ssh/agent"
	"golang.org/x/crypto/ssh/knownhosts"
)

// loadSigner returns the signer of KeyFile or Key, parsed (with
// KeyPassphrase when set). Any failure is KindKeyUnreadable; it happens
// before any network use. No error text carries key bytes or the
// passphrase.
func loadSigner(cfg Config, cache *keyCache) (ssh.Signer, error) {
	pem, src := cfg.Key, "Key"
	if cfg.KeyFile != "" {
		var err error
		pem, err = os.ReadFile(cfg.KeyFile)
		if err != nil {
			return nil, &Error{Kind: KindKeyUnreadable, Address: cfg.Address, Op: "read key file", Err: err}
		}
		src = "key file " + cfg.KeyFile
	}
	sum := sha256.Sum256(pem)
	if signer := cache.get(sum); signer != nil {
		return signer, nil
	}
	var signer ssh.Signer
	var err error
	if len(cfg.KeyPassphrase) > 0 {
		signer, err = ssh.ParsePrivateKeyWithPassphrase(pem, cfg.KeyPassphrase)
	} else {
		signer, err = ssh.ParsePrivateKey(pem)
	}
	if err != nil {
		var missing *ssh.PassphraseMissingError
		switch {
		case errors.As(err, &missing):
			err = fmt.Errorf("%s is encrypted and KeyPassphrase is not set", src)
		case errors.Is(err, x509.IncorrectPasswordError):
			err = fmt.Errorf("%s: KeyPassphrase does not decrypt it", src)
		default:
			err = fmt.Errorf("%s: %w", src, err)
		}
		return nil, &Error{Kind: KindKeyUnreadable, Address: cfg.Address, Op: "parse key", Err: err}
	}
	cache.put(sum, signer)
	return signer, nil
}

// keyCache remembers the signer parsed from the latest key content, so an
// encrypted key is decrypted (bcrypt, slow by design) once per content
// rather than on every dial; a rotated key file has a new content.
type keyCache struct {
	mu     sync.Mutex
	sum    [sha256.Size]byte
	signer ssh.Signer
}

func (c *keyCache) get(sum [sha256.Size]byte) ssh.Signer {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.signer != nil && c.sum == sum {
		return c.signer
	}
	return nil
}

func (c *keyCache) put(sum [sha256.Size]byte, s ssh.Signer) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sum, c.signer = sum, s
}

// authMethod returns the public key auth method: signer (loaded by
// loadSigner) when not nil, else cfg.AgentSocket's keys. For the agent it
// dials the agent (bounded by ctx, and every read and write of the agent
// connection by ctx's deadline and cancellation) and returns the
// connection's closer, which the caller calls when the handshake has ended
// (the agent signs during it); the closer is never nil.
func authMethod(ctx context.Context, cfg Config, signer ssh.Signer) (ssh.AuthMethod, func(), *stepError) {
	if signer != nil {
		return ssh.PublicKeys(signer), func() {}, nil
	}
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", cfg.AgentSocket)
	if err != nil {
		return nil, nil, &stepError{op: "dial ssh-agent", kind: KindKeyUnreadable, err: err, ctxBound: true}
	}
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	closeAgent := func() {
		stop()
		_ = conn.Close()
	}
	ag := agent.NewClient(conn)
	signers, err := ag.Signers()
	if err == nil && len(signers) == 0 {
		err = fmt.Errorf("ssh-agent at %s holds no keys", cfg.AgentSocket)
	}
	if err != nil {
		closeAgent()
		return nil, nil, &stepError{op: "list ssh-agent keys", kind: KindKeyUnreadable, err: err, ctxBound: true}
	}
	return ssh.PublicKeys(signers...), closeAgent, nil
}

// probeKey is a public key nobody pins: asking the known_hosts callback about
// it returns a *knownhosts.KeyError listing every key known for the host
// (the keys of @cert-authority lines matching the host included).
var probeKey = func() ssh.PublicKey {
	pub := ed25519.NewKeyFromSeed(make([]byte, ed25519.SeedSize)).Public()
	k, err := ssh.NewPublicKey(pub)
	if err != nil {
		panic(err)
	}
	return k
}()

// hostKeys is what one dial verifies the host key against.
type hostKeys struct {
	cb     ssh.HostKeyCallback // knownhosts.New's: plain keys, @cert-authority, @revoked
	source string              // the file name, or "Config.KnownHosts"
	// algos are the host key algorithms offered, in order; see loadKnownHosts.
	algos []string
	// caMatch: an @cert-authority line matches the host.
	caMatch bool
	// cas holds the marshalled keys of every @cert-authority line.
	cas map[string]bool
}

// loadKnownHosts builds the host key callback from cfg.KnownHostsFile or
// cfg.KnownHosts with golang.org/x/crypto/ssh/knownhosts (hashed names,
// [host]:port, patterns, @cert-authority through ssh.CertChecker, @revoked
// for keys, certified keys and CAs), and the host key algorithms to offer:
//
//   - when an @cert-authority line matches the host, every certificate
//     algorithm first, so a host with a certificate presents it;
//   - then the types of the plain keys pinned for the host, so that the
//     pinned key type is the one the server presents (a server with ecdsa
//     and ed25519 keys would otherwise present ecdsa first, and a known_hosts
//     pinning only ed25519 would then look like a mismatch);
//   - then every other plain type: a host that no longer presents any pinned
//     type then completes the key exchange with another key, which the
//     callback reports as a mismatch (as OpenSSH does), instead of failing
//     with "no common algorithm", which would read as a network fault.
//
// Certificate algorithms are not offered when no CA line matches, so a host
// with a certificate is checked by its plain key against the plain lines.
// A missing or unreadable file, or content without a valid line, is
// KindHostUnknown.
func loadKnownHosts(cfg Config) (*hostKeys, error) {
	hk := &hostKeys{source: cfg.KnownHostsFile, cas: map[string]bool{}}
	var content []byte
	var err error
	if cfg.KnownHostsFile != "" {
		content, err = os.ReadFile(cfg.KnownHostsFile)
		if err != nil {
			return nil, &Error{Kind: KindHostUnknown, Address: cfg.Address, Op: "read known_hosts", Err: err}
		}
		hk.cb, err = knownhosts.New(cfg.KnownHostsFile)
	} else {
		hk.source = "Config.KnownHosts"
		content = cfg.KnownHosts
		hk.cb, err = knownHostsFromBytes(content)
	}
	if err != nil {
		return nil, &Error{Kind: KindHostUnknown, Address: cfg.Address, Op: "read known_hosts", Err: err}
	}
	for _, line := range bytes.Split(content, []byte("\n")) {
		marker, _, key, _, _, err := ssh.ParseKnownHosts(line)
		if err == nil && marker == "cert-authority" {
			hk.cas[string(key.Marshal())] = true
		}
	}

	var pinned []string
	var keyErr *knownhosts.KeyError
	if err := hk.cb(cfg.Address, &net.TCPAddr{IP: net.IPv4zero}, probeKey); errors.As(err, &keyErr) {
		for _, k := range keyErr.Want {
			if hk.cas[string(k.Key.Marshal())] {
				hk.caMatch = true
				continue
			}
			switch t := k.Key.Type(); t {
			case ssh.KeyAlgoRSA:
				pinned = append(pinned, ssh.KeyAlgoRSASHA512, ssh.KeyAlgoRSASHA256, ssh.KeyAlgoRSA)
			default:
				pinned = append(pinned, t)
			}
		}
	}
	var certAlgos, plainAlgos []string
	for _, a := range ssh.SupportedAlgorithms().HostKeys {
		if strings.Contains(a, "-cert-") {
			certAlgos = append(certAlgos, a)
		} else {
			plainAlgos = append(plainAlgos, a)
		}
	}
	seen := map[string]bool{}
	add := func(a ...string) {
		for _, s := range a {
			if !seen[s] {
				seen[s] = true
				hk.algos = append(hk.algos, s)
			}
		}
	}
	if hk.caMatch {
		add(certAlgos...)
	}
	add(pinned...)
	add(plainAlgos...)
	return hk, nil
}

// check is the handshake's host key callback: hk.cb, with the failure
// classified (a *hostKeyError) and described with what the server presented
// and what it was checked against.
func (hk *hostKeys) check(host string, remote net.Addr, key ssh.PublicKey) error {
	err := hk.cb(host, remote, key)
	if err == nil {
		return nil
	}
	kind := KindHostKeyMismatch
	var keyErr *knownhosts.KeyError
	var revoked *knownhosts.RevokedError
	cert, isCert := key.(*ssh.Certificate)
	switch {
	case errors.As(err, &revoked):
		// a revoked key, certified key or CA: a mismatch, never "unknown"
	case errors.As(err, &keyErr):
		plain := 0
		for _, k := range keyErr.Want {
			if !hk.cas[string(k.Key.Marshal())] {
				plain++
			}
		}
		if plain == 0 {
			kind = KindHostUnknown
		}
	case isCert && !hk.caMatch:
		kind = KindHostUnknown
	}
	desc := key.Type() + " " + ssh.FingerprintSHA256(key)
	if isCert {
		desc = fmt.Sprintf("a certificate for %s %s signed by CA %s %s", cert.Key.Type(),
			ssh.FingerprintSHA256(cert.Key), cert.SignatureKey.Type(), ssh.FingerprintSHA256(cert.SignatureKey))
	}
	return &hostKeyError{kind: kind, err: fmt.Errorf("%w (server presented %s; checked against %s)", err, desc, hk.source)}
}

// hostKeyError is a host key refusal, classified where it is known.
type hostKeyError struct {
	kind Kind
	err  error
}

func (e *hostKeyError) Error() string { return e.err.Error() }
func (e *hostKeyError) Unwrap() error { return e.err }

// classifyHandshake maps an ssh.NewClientConn error to a Kind.
func classifyHandshake(err error) Kind {
	var hkErr *hostKeyError
	var keyErr *knownhosts.KeyError
	var revoked *knownhosts.RevokedError
	switch {
	case errors.As(err, &hkErr):
		return hkErr.kind
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

// dialLink opens a new SSH connection: key, known_hosts, TCP, handshake. It
// registers the link, which starts its keepalive and reaper goroutines
// (owned by the pool). ctx bounds the dial only; it is not stored.
func (p *Pool) dialLink(ctx context.Context, dedicated bool) (*link, error) {
	signer, hk, err := p.credentials()
	if err != nil {
		return nil, err
	}
	dctx, cancel := budget.WithTimeout(ctx, "DialTimeout", p.cfg.DialTimeout)
	defer cancel()
	// Pool.Close ends the dial too, so Close never waits for a dial timeout.
	defer context.AfterFunc(p.closeCtx, cancel)()
	start := time.Now()
	ac, client, serr := p.connect(dctx, signer, hk)
	if serr != nil {
		return nil, p.dialFailed(dctx, serr)
	}
	l := &link{
		nc:        ac,
		client:    client,
		dedicated: dedicated,
		created:   time.Now(),
		dead:      make(chan struct{}),
	}
	if !p.register(l) {
		l.kill(errPoolClosed)
		_ = l.client.Close()
		return nil, p.closedError("dial")
	}
	p.log.V(1).Info("ssh connected", "user", p.cfg.User, "dedicated", dedicated,
		"elapsed", time.Since(start))
	return l, nil
}

// credentials loads what a dial needs before any network use, so that a
// local failure never reaches the host: the client key (nil: the agent's,
// loaded by authMethod during the dial) and the known host keys.
func (p *Pool) credentials() (ssh.Signer, *hostKeys, error) {
	signer := p.signer
	if signer == nil && p.cfg.AgentSocket == "" {
		var err error
		if signer, err = loadSigner(p.cfg, &p.keys); err != nil {
			return nil, nil, err
		}
	}
	hk, err := loadKnownHosts(p.cfg)
	if err != nil {
		return nil, nil, err
	}
	return signer, hk, nil
}

// stepError is the failure of one network step of a dial, before
// dialFailed says what it means.
type stepError struct {
	op   string // the step: "dial ssh-agent", "dial", "ssh handshake", ...
	kind Kind
	err  error
	// ctxBound: the failure may be dctx's doing (the step was cut by it);
	// false for an answer of the server (a key refused, a host key
	// mismatch), which no context changes.
	ctxBound bool
}

// connect runs the network steps of a dial, bounded by dctx: the agent's
// keys (when the key comes from the agent), the TCP connection and the
// SSH handshake.
func (p *Pool) connect(dctx context.Context, signer ssh.Signer, hk *hostKeys) (*activityConn, *ssh.Client, *stepError) {
	// The agent connection (if any) lives until the handshake has ended:
	// the agent signs during it.
	auth, closeAgent, serr := authMethod(dctx, p.cfg, signer)
	if serr != nil {
		return nil, nil, serr
	}
	defer closeAgent()
	var d net.Dialer
	nc, err := d.DialContext(dctx, "tcp", p.cfg.Address)
	if err != nil {
		return nil, nil, &stepError{op: "dial", kind: KindUnreachable, err: err, ctxBound: true}
	}
	// The handshake has no context: bound it by a deadline and by dctx.
	if dl, ok := dctx.Deadline(); ok {
		_ = nc.SetDeadline(dl)
	}
	stop := context.AfterFunc(dctx, func() { _ = nc.SetDeadline(time.Unix(1, 0)) })
	if p.wrapConn != nil {
		nc = p.wrapConn(nc)
	}
	ac := newActivityConn(nc)
	sc, chans, reqs, err := ssh.NewClientConn(ac, p.cfg.Address, &ssh.ClientConfig{
		User:              p.cfg.User,
		Auth:              []ssh.AuthMethod{auth},
		HostKeyCallback:   hk.check,
		HostKeyAlgorithms: hk.algos,
	})
	if !stop() && err == nil {
		// dctx ended just as the handshake finished: honour it.
		_ = sc.Close()
		if err = budget.Err(dctx); err == nil {
			err = context.Canceled
		}
	}
	if err != nil {
		_ = nc.Close()
		k := classifyHandshake(err)
		return nil, nil, &stepError{op: "ssh handshake", kind: k, err: err, ctxBound: k == KindUnreachable}
	}
	_ = nc.SetDeadline(time.Time{})
	return ac, ssh.NewClient(sc, chans, reqs), nil
}

// dialFailed is the error of a dial whose step s failed, saying why in one
// place:
//
//   - the pool was closed meanwhile: KindClosed;
//   - the caller canceled ctx and s may be its doing: the cancellation,
//     unclassified like every cancellation in this package (ctxError). It
//     says nothing about the host, so it is not KindUnreachable (which
//     reads as a network failure, and which kvm2 and imagecache take for a
//     dead link); the error the cancel provoked is left out (the handshake
//     is cut by an expired connection deadline, whose "i/o timeout" would
//     again read as the host's fault);
//   - a deadline ended an unreachable step: the caller's
//     (context.DeadlineExceeded) or our DialTimeout (*budget.TimeoutError,
//     which is not the caller's), with the step's own error as text only:
//     net's timeout error matches context.DeadlineExceeded even when
//     DialTimeout ended it;
//   - otherwise s as it is.
func (p *Pool) dialFailed(dctx context.Context, s *stepError) error {
	if p.closeCtx.Err() != nil {
		return p.closedError(s.op)
	}
	err := s.err
	if s.ctxBound {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			// The connection's deadline is dctx's: dctx ends at once (its
			// timer may not have fired yet), so wait to say why it ended.
			t := time.NewTimer(time.Second)
			select {
			case <-dctx.Done():
			case <-t.C:
			}
			t.Stop()
		}
		ctxErr := budget.Err(dctx)
		if errors.Is(ctxErr, context.Canceled) {
			return ctxError(p.cfg.Address, s.op, ctxErr)
		}
		if ctxErr != nil && s.kind == KindUnreachable {
			err = fmt.Errorf("%w (%s)", ctxErr, causeText(err))
		}
	}
	return &Error{Kind: s.kind, Address: p.cfg.Address, Op: s.op, Err: err}
}

// renameErr is err with the name of the file knownhosts read replaced by
// the name the embedder knows.
type renameErr struct {
	err      error
	from, to string
}

func (e renameErr) Error() string { return strings.ReplaceAll(e.err.Error(), e.from, e.to) }
func (e renameErr) Unwrap() error { return e.err }
