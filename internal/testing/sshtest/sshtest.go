package sshtest

import (
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"encoding/pem"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"golang.org/x/crypto/ssh"
	"golang.org/x/crypto/ssh/knownhosts"
)

// Server is an in-process sshd on a loopback port.
type Server struct {
	// Addr is the host:port it listens on.
	Addr string
	// HostKeys are the keys it presents, in its order of preference.
	HostKeys []ssh.Signer

	ln         net.Listener
	authorized []byte // marshalled authorized public key

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	frozen bool
	thaw   chan struct{}
	refuse map[string]bool // socket paths to refuse

	closed     chan struct{}
	closeOnce  sync.Once
	wg         sync.WaitGroup
	accepts    atomic.Int64
	keepalives atomic.Int64
}

// GenEd25519 returns a new ed25519 private key.
func GenEd25519(t testing.TB) ed25519.PrivateKey {
	t.Helper()
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return priv
}

// GenECDSA returns a new P-256 private key.
func GenECDSA(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// Signer returns the ssh.Signer of private key k.
func Signer(t testing.TB, k any) ssh.Signer {
	t.Helper()
	s, err := ssh.NewSignerFromKey(k)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// WriteKey writes priv as an unencrypted OpenSSH private key file
// dir/name and returns its path.
func WriteKey(t testing.TB, dir, name string, priv any) string {
	t.Helper()
	blk, err := ssh.MarshalPrivateKey(priv, "")
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, pem.EncodeToMemory(blk), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// WriteKnownHosts writes a known_hosts file dir/name pinning keys for addr
// and returns its path.
func WriteKnownHosts(t testing.TB, dir, name, addr string, keys ...ssh.PublicKey) string {
	t.Helper()
	var b strings.Builder
	for _, k := range keys {
		b.WriteString(knownhosts.Line([]string{knownhosts.Normalize(addr)}, k) + "\n")
	}
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// Start starts a Server with the given host keys (one ed25519 key if none)
// authorizing clientPub; t.Cleanup closes it.
func Start(t testing.TB, clientPub ssh.PublicKey, hostKeys ...ssh.Signer) *Server {
	t.Helper()
	if len(hostKeys) == 0 {
		hostKeys = []ssh.Signer{Signer(t, GenEd25519(t))}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &Server{
		Addr: ln.Addr().String(), HostKeys: hostKeys,
		ln: ln, authorized: clientPub.Marshal(),
		conns:  map[net.Conn]struct{}{},
		refuse: map[string]bool{},
		closed: make(chan struct{}),
	}
	s.wg.Add(1)
	go s.serve()
	t.Cleanup(s.Close)
	return s
}

// Accepts is the number of TCP connections accepted so far.
func (s *Server) Accepts() int64 { return s.accepts.Load() }

// Keepalives is the number of keepalive@openssh.com requests received.
func (s *Server) Keepalives() int64 { return s.keepalives.Load() }

// Close stops the server and ends every connection and goroutine of it.
func (s *Server) Close() {
	s.closeOnce.Do(func() {
		close(s.closed)
		_ = s.ln.Close()
		s.mu.Lock()
		for c := range s.conns {
			_ = c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
	})
}

// Freeze stops every connection reading and writing until Thaw (TCP still
// accepts new connections, which then freeze too).
func (s *Server) Freeze() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.frozen {
		s.frozen = true
		s.thaw = make(chan struct{})
	}
}

// Thaw undoes Freeze.
func (s *Server) Thaw() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.frozen {
		s.frozen = false
		close(s.thaw)
	}
}

// Refuse makes the server refuse channels to the unix socket path, as
// OpenSSH refuses a socket the user may not open.
func (s *Server) Refuse(path string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.refuse[path] = true
}

// DropAll closes every server-side connection (like killing sshd's children).
func (s *Server) DropAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for c := range s.conns {
		_ = c.Close()
	}
}

func (s *Server) gate() {
	s.mu.Lock()
	if !s.frozen {
		s.mu.Unlock()
		return
	}
	thaw := s.thaw
	s.mu.Unlock()
	select {
	case <-thaw:
	case <-s.closed:
	}
}

type freezeConn struct {
	net.Conn
	s *Server
}

func (c *freezeConn) Read(b []byte) (int, error) {
	c.s.gate()
	n, err := c.Conn.Read(b)
	c.s.gate()
	return n, err
}

func (c *freezeConn) Write(b []byte) (int, error) {
	c.s.gate()
	return c.Conn.Write(b)
}

func (s *Server) serve() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return
		}
		s.accepts.Add(1)
		s.mu.Lock()
		select {
		case <-s.closed:
			s.mu.Unlock()
			_ = c.Close()
			return
		default:
		}
		s.conns[c] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go s.handle(c)
	}
}

func (s *Server) handle(c net.Conn) {
	defer s.wg.Done()
	defer func() {
		_ = c.Close()
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
	}()
	cfg := &ssh.ServerConfig{
		PublicKeyCallback: func(_ ssh.ConnMetadata, key ssh.PublicKey) (*ssh.Permissions, error) {
			if string(key.Marshal()) == string(s.authorized) {
				return nil, nil
			}
			return nil, io.ErrUnexpectedEOF
		},
	}
	for _, k := range s.HostKeys {
		cfg.AddHostKey(k)
	}
	sc, chans, reqs, err := ssh.NewServerConn(&freezeConn{Conn: c, s: s}, cfg)
	if err != nil {
		return
	}
	defer sc.Close()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for r := range reqs {
			if r.Type == "keepalive@openssh.com" {
				s.keepalives.Add(1)
			}
			if r.WantReply {
				_ = r.Reply(false, nil) // like OpenSSH: unknown global request -> failure reply
			}
		}
	}()
	for nc := range chans {
		s.channel(nc)
	}
}

// channel serves one channel request: a direct-streamlocal channel is
// bridged to its unix socket, anything else refused.
func (s *Server) channel(nc ssh.NewChannel) {
	if nc.ChannelType() != "direct-streamlocal@openssh.com" {
		_ = nc.Reject(ssh.UnknownChannelType, "unsupported")
		return
	}
	var req struct {
		Path      string
		Reserved0 string
		Reserved1 uint32
	}
	if err := ssh.Unmarshal(nc.ExtraData(), &req); err != nil {
		_ = nc.Reject(ssh.ConnectionFailed, "bad request")
		return
	}
	s.mu.Lock()
	refused := s.refuse[req.Path]
	s.mu.Unlock()
	if refused {
		_ = nc.Reject(ssh.ConnectionFailed, "open failed")
		return
	}
	uc, err := net.Dial("unix", req.Path)
	if err != nil {
		_ = nc.Reject(ssh.ConnectionFailed, "open failed")
		return
	}
	ch, creqs, err := nc.Accept()
	if err != nil {
		_ = uc.Close()
		return
	}
	s.wg.Add(3)
	go func() { defer s.wg.Done(); ssh.DiscardRequests(creqs) }()
	go func() {
		defer s.wg.Done()
		_, _ = io.Copy(ch, uc)
		_ = ch.Close()
	}()
	go func() {
		defer s.wg.Done()
		_, _ = io.Copy(uc, ch)
		_ = uc.Close()
	}()
}

// Fixture is a Server plus the client files that reach it.
type Fixture struct {
	Server *Server
	// Dir is a temporary directory for more client files.
	Dir string
	// KeyFile is the authorized client key, KnownHosts a known_hosts file
	// pinning the server's first host key.
	KeyFile, KnownHosts string
	// ClientKey is the authorized client private key.
	ClientKey ed25519.PrivateKey
}

// NewFixture starts a Server with hostKeys (see Start) and writes the
// files a client needs to reach it.
func NewFixture(t testing.TB, hostKeys ...ssh.Signer) *Fixture {
	t.Helper()
	dir := t.TempDir()
	priv := GenEd25519(t)
	clientPub, err := ssh.NewPublicKey(priv.Public())
	if err != nil {
		t.Fatal(err)
	}
	srv := Start(t, clientPub, hostKeys...)
	return &Fixture{
		Server:     srv,
		Dir:        dir,
		KeyFile:    WriteKey(t, dir, "id_ed25519", priv),
		KnownHosts: WriteKnownHosts(t, dir, "known_hosts", srv.Addr, srv.HostKeys[0].PublicKey()),
		ClientKey:  priv,
	}
}

// UnixSocket listens on a new unix socket and returns its path; it accepts
// connections and holds them open until the test ends.
func UnixSocket(t testing.TB) string {
	t.Helper()
	// Short path: unix socket paths are limited to about 108 bytes.
	dir, err := os.MkdirTemp("", "sshtest")
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "sock")
	ln, err := net.Listen("unix", p)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		<-done
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		_ = os.RemoveAll(dir)
	})
	return p
}

// SilentServer accepts TCP connections and never says anything (a host
// whose sshd hangs before its banner, or a black-holing middlebox). Each
// connection sends on spoke once the client has written to it: the client
// is then in its SSH handshake.
func SilentServer(t testing.TB) (addr string, spoke <-chan struct{}) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var conns []net.Conn
	var mu sync.Mutex
	var wg sync.WaitGroup
	sp := make(chan struct{}, 16)
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
			go func() {
				defer wg.Done()
				var b [1]byte
				if _, err := c.Read(b[:]); err == nil {
					sp <- struct{}{}
				}
			}()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String(), sp
}
