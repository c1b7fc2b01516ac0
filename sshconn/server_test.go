package sshconn

import (
	"bufio"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/pem"
	"hash"
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

// testServer is an in-process sshd: public key auth, keepalive replies,
// direct-streamlocal channels bridged to local unix sockets. It can freeze
// (stop reading and writing, like a SIGSTOPped sshd) and refuse channels.
type testServer struct {
	t          *testing.T
	ln         net.Listener
	Addr       string
	hostKeys   []ssh.Signer
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

func genEd25519(t *testing.T) ed25519.PrivateKey {
	t.Helper()
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return priv
}

func mustSigner(t *testing.T, k any) ssh.Signer {
	t.Helper()
	s, err := ssh.NewSignerFromKey(k)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// writeKey writes priv as an unencrypted OpenSSH private key file.
func writeKey(t *testing.T, dir, name string, priv any) string {
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

func writeKnownHosts(t *testing.T, dir, name, addr string, keys ...ssh.PublicKey) string {
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

// startServer starts a test sshd with the given host keys (ed25519 if none)
// authorizing clientPub.
func startServer(t *testing.T, clientPub ssh.PublicKey, hostKeys ...ssh.Signer) *testServer {
	t.Helper()
	if len(hostKeys) == 0 {
		hostKeys = []ssh.Signer{mustSigner(t, genEd25519(t))}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &testServer{
		t: t, ln: ln, Addr: ln.Addr().String(), hostKeys: hostKeys,
		authorized: clientPub.Marshal(),
		conns:      map[net.Conn]struct{}{},
		refuse:     map[string]bool{},
		closed:     make(chan struct{}),
	}
	s.wg.Add(1)
	go s.serve()
	t.Cleanup(s.Close)
	return s
}

func (s *testServer) Close() {
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

func (s *testServer) Freeze() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.frozen {
		s.frozen = true
		s.thaw = make(chan struct{})
	}
}

func (s *testServer) Thaw() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.frozen {
		s.frozen = false
		close(s.thaw)
	}
}

func (s *testServer) Refuse(path string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.refuse[path] = true
}

// DropAll closes every server-side connection (like killing sshd's children).
func (s *testServer) DropAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for c := range s.conns {
		_ = c.Close()
	}
}

func (s *testServer) gate() {
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
	s *testServer
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

func (s *testServer) serve() {
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

func (s *testServer) handle(c net.Conn) {
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
	for _, k := range s.hostKeys {
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
		if nc.ChannelType() != "direct-streamlocal@openssh.com" {
			_ = nc.Reject(ssh.UnknownChannelType, "unsupported")
			continue
		}
		var req struct {
			Path      string
			Reserved0 string
			Reserved1 uint32
		}
		if err := ssh.Unmarshal(nc.ExtraData(), &req); err != nil {
			_ = nc.Reject(ssh.ConnectionFailed, "bad request")
			continue
		}
		s.mu.Lock()
		refused := s.refuse[req.Path]
		s.mu.Unlock()
		if refused {
			_ = nc.Reject(ssh.ConnectionFailed, "open failed")
			continue
		}
		uc, err := net.Dial("unix", req.Path)
		if err != nil {
			_ = nc.Reject(ssh.ConnectionFailed, "open failed")
			continue
		}
		ch, creqs, err := nc.Accept()
		if err != nil {
			_ = uc.Close()
			continue
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
}

// fakeLibvirtd speaks just enough of the libvirt RPC protocol on a unix
// socket: AuthList, ConnectOpen, ConnectClose, ConnectGetHostname.
type fakeLibvirtd struct {
	Path     string
	ln       net.Listener
	hostname string
	hang     atomic.Bool // leave ConnectGetHostname unanswered
	hangOpen atomic.Bool // leave ConnectOpen unanswered
	opens    atomic.Int64
	// download answers StorageVolDownload with these packets (nil: the
	// reply, then the data "0123456789" in two packets, then end of file).
	download atomic.Pointer[[]fakePacket]
	// upload says how StorageVolUpload is answered (nil: accepted).
	upload atomic.Pointer[uploadScript]

	mu     sync.Mutex
	calls  map[uint32][]byte // proc -> the last CALL packet (header and args)
	done   []uploadDone      // finished or aborted uploads, in order
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup
	closed bool
}

// uploadScript: how the fake libvirtd answers an upload.
type uploadScript struct {
	callErr   string // answer the call with this error
	failAfter int64  // > 0: once this many data bytes arrived, fail the stream (a REPLY with status error, as libvirtd does when a write fails)
	failMsg   string
	finishErr string // answer the finish with this error
}

// uploadDone is one upload stream as the fake libvirtd saw it end.
type uploadDone struct {
	n       int64
	sum     [32]byte
	aborted bool // the client sent an abort
	failed  bool // the fake failed it
}

// uploadState is an upload stream in progress on one connection.
type uploadState struct {
	n      int64
	h      hash.Hash
	failed bool
}

func (f *fakeLibvirtd) uploads() []uploadDone {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]uploadDone(nil), f.done...)
}

func (f *fakeLibvirtd) lastCall(proc uint32) []byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[proc]
}

const (
	procConnectOpen        = 1
	procConnectClose       = 2
	procConnectGetHostname = 59
	procAuthList           = 66
)

func startLibvirtd(t *testing.T, hostname string) *fakeLibvirtd {
	t.Helper()
	// Short path: unix socket paths are limited to ~108 bytes.
	dir, err := os.MkdirTemp("", "sshconn")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	p := filepath.Join(dir, "libvirt-sock")
	ln, err := net.Listen("unix", p)
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeLibvirtd{Path: p, ln: ln, hostname: hostname, conns: map[net.Conn]struct{}{}, calls: map[uint32][]byte{}}
	f.wg.Add(1)
	go f.serve()
	t.Cleanup(f.Close)
	return f
}

func (f *fakeLibvirtd) Close() {
	f.mu.Lock()
	f.closed = true
	_ = f.ln.Close()
	for c := range f.conns {
		_ = c.Close()
	}
	f.mu.Unlock()
	f.wg.Wait()
}

// DropAll closes every client connection, like a libvirtd restart.
func (f *fakeLibvirtd) DropAll() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for c := range f.conns {
		_ = c.Close()
	}
}

func (f *fakeLibvirtd) serve() {
	defer f.wg.Done()
	for {
		c, err := f.ln.Accept()
		if err != nil {
			return
		}
		f.mu.Lock()
		if f.closed {
			f.mu.Unlock()
			_ = c.Close()
			return
		}
		f.conns[c] = struct{}{}
		f.wg.Add(1)
		f.mu.Unlock()
		go f.handle(c)
	}
}

// fakePacket is one packet a fake libvirtd sends for a call.
type fakePacket struct {
	typ, status uint32 // socket.Reply/Stream, socket.StatusOK/Error/Continue
	payload     []byte
}

func reply() fakePacket               { return fakePacket{typ: 1, status: 0} }
func data(s string) fakePacket        { return fakePacket{typ: 3, status: 2, payload: []byte(s)} }
func eof() fakePacket                 { return fakePacket{typ: 3, status: 2} }
func streamOK() fakePacket            { return fakePacket{typ: 3, status: 0} }
func streamErr(msg string) fakePacket { return fakePacket{typ: 3, status: 1, payload: xdrError(msg)} }

var defaultDownload = []fakePacket{reply(), data("01234"), data("56789"), eof()}

// frame builds the packet as an answer to the call whose header is call.
func (p fakePacket) frame(call [28]byte) []byte {
	out := make([]byte, 28, 28+len(p.payload))
	copy(out, call[:])
	binary.BigEndian.PutUint32(out[0:4], uint32(28+len(p.payload)))
	binary.BigEndian.PutUint32(out[16:20], p.typ)
	binary.BigEndian.PutUint32(out[24:28], p.status)
	return append(out, p.payload...)
}

// xdrError is libvirt's remote_error as go-libvirt decodes it.
func xdrError(msg string) []byte {
	b := binary.BigEndian.AppendUint32(nil, 1) // code: VIR_ERR_INTERNAL_ERROR
	b = binary.BigEndian.AppendUint32(b, 0)    // domain
	b = binary.BigEndian.AppendUint32(b, 0)    // padding
	b = append(b, xdrString(msg)...)
	return binary.BigEndian.AppendUint32(b, 2) // level: error
}

func xdrString(s string) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(len(s)))
	b = append(b, s...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

func (f *fakeLibvirtd) handle(c net.Conn) {
	defer f.wg.Done()
	defer func() {
		_ = c.Close()
		f.mu.Lock()
		delete(f.conns, c)
		f.mu.Unlock()
	}()
	r := bufio.NewReader(c)
	ups := map[uint32]*uploadState{} // by serial
	send := func(call [28]byte, p fakePacket) bool {
		_, err := c.Write(p.frame(call))
		return err == nil
	}
	for {
		var hdr [28]byte
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return
		}
		n := binary.BigEndian.Uint32(hdr[0:4])
		if n < 28 || n > 32<<20 {
			return
		}
		body := make([]byte, n-28)
		if _, err := io.ReadFull(r, body); err != nil {
			return
		}
		proc := binary.BigEndian.Uint32(hdr[12:16])
		typ := binary.BigEndian.Uint32(hdr[16:20])
		serial := binary.BigEndian.Uint32(hdr[20:24])
		if typ == 0 {
			f.mu.Lock()
			f.calls[proc] = append(hdr[:], body...)
			f.mu.Unlock()
		}
		if proc == procStorageVolUpload {
			sc := f.upload.Load()
			if sc == nil {
				sc = &uploadScript{}
			}
			if typ == 0 { // the call
				if sc.callErr != "" {
					if !send(hdr, fakePacket{typ: 1, status: 1, payload: xdrError(sc.callErr)}) {
						return
					}
					continue
				}
				ups[serial] = &uploadState{h: sha256.New()}
				if !send(hdr, reply()) {
					return
				}
				continue
			}
			u := ups[serial]
			if typ != 3 || u == nil || u.failed {
				continue // libvirtd drops stream packets of a stream it closed
			}
			status := binary.BigEndian.Uint32(hdr[24:28])
			switch status {
			case 2: // data
				u.n += int64(len(body))
				u.h.Write(body)
				if sc.failAfter > 0 && u.n >= sc.failAfter {
					u.failed = true
					f.finishUpload(u, false)
					if !send(hdr, fakePacket{typ: 1, status: 1, payload: xdrError(sc.failMsg)}) {
						return
					}
				}
			case 0: // finish
				delete(ups, serial)
				f.finishUpload(u, false)
				p := fakePacket{typ: 3, status: 0}
				if sc.finishErr != "" {
					p = fakePacket{typ: 1, status: 1, payload: xdrError(sc.finishErr)}
				}
				if !send(hdr, p) {
					return
				}
			default: // abort: confirmed
				delete(ups, serial)
				f.finishUpload(u, true)
				if !send(hdr, fakePacket{typ: 3, status: 0}) {
					return
				}
			}
			continue
		}
		if typ != 0 {
			continue
		}
		var payload []byte
		if proc == procStorageVolDownload {
			pkts := defaultDownload
			if p := f.download.Load(); p != nil {
				pkts = *p
			}
			for _, p := range pkts {
				if _, err := c.Write(p.frame(hdr)); err != nil {
					return
				}
			}
			continue
		}
		switch proc {
		case procAuthList:
			payload = binary.BigEndian.AppendUint32(nil, 0) // no auth types
		case procConnectOpen:
			if f.hangOpen.Load() {
				continue
			}
			f.opens.Add(1)
		case procConnectClose:
		case procConnectGetHostname:
			if f.hang.Load() {
				continue
			}
			payload = xdrString(f.hostname)
		default:
			continue // unknown: never answered
		}
		out := make([]byte, 28, 28+len(payload))
		copy(out, hdr[:])
		binary.BigEndian.PutUint32(out[0:4], uint32(28+len(payload)))
		binary.BigEndian.PutUint32(out[16:20], 1) // type: reply
		binary.BigEndian.PutUint32(out[24:28], 0) // status: OK
		out = append(out, payload...)
		if _, err := c.Write(out); err != nil {
			return
		}
	}
}

func (f *fakeLibvirtd) finishUpload(u *uploadState, aborted bool) {
	d := uploadDone{n: u.n, aborted: aborted, failed: u.failed}
	copy(d.sum[:], u.h.Sum(nil))
	f.mu.Lock()
	f.done = append(f.done, d)
	f.mu.Unlock()
}

// fixture is a test server plus the client files that reach it.
type fixture struct {
	srv        *testServer
	dir        string
	keyFile    string
	knownHosts string
	clientPriv ed25519.PrivateKey
}

func newFixture(t *testing.T, hostKeys ...ssh.Signer) *fixture {
	t.Helper()
	dir := t.TempDir()
	priv := genEd25519(t)
	clientPub, err := ssh.NewPublicKey(priv.Public())
	if err != nil {
		t.Fatal(err)
	}
	srv := startServer(t, clientPub, hostKeys...)
	return &fixture{
		srv:        srv,
		dir:        dir,
		keyFile:    writeKey(t, dir, "id_ed25519", priv),
		knownHosts: writeKnownHosts(t, dir, "known_hosts", srv.Addr, srv.hostKeys[0].PublicKey()),
		clientPriv: priv,
	}
}

func (f *fixture) config() Config {
	return Config{Addr: f.srv.Addr, User: "root", KeyFile: f.keyFile, KnownHostsFile: f.knownHosts}
}

func genECDSA(t *testing.T) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}
