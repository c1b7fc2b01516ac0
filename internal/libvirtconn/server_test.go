package libvirtconn

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"hash"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/digitalocean/go-libvirt"
	"go.uber.org/goleak"

	"github.com/egressproxy/egressproxy/internal/testing/sshtest"
	"github.com/egressproxy/egressproxy/sshconn"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// sshConfig is the pool config that reaches f's server.
func sshConfig(f *sshtest.Fixture) sshconn.Config {
	return sshconn.Config{Address: f.Server.Addr, User: "root", KeyFile: f.KeyFile, KnownHostsFile: f.KnownHosts}
}

func newPool(t *testing.T, cfg sshconn.Config) *sshconn.Pool {
	t.Helper()
	p, err := sshconn.New(cfg, nil)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// newSession is a Session on a new pool to f's server, for lvd's socket;
// edit (nil: none) changes the pool's config, opts the Session's.
func newSession(t *testing.T, f *sshtest.Fixture, lvd *fakeLibvirtd, edit func(*sshconn.Config), opts *Options) (*sshconn.Pool, *Session) {
	t.Helper()
	cfg := sshConfig(f)
	if edit != nil {
		edit(&cfg)
	}
	p := newPool(t, cfg)
	s := New(p, Config{Address: cfg.Address, Socket: lvd.Path, URI: "test:///default"}, opts)
	t.Cleanup(func() { _ = s.Close() })
	return p, s
}

func hostname(ctx context.Context, s *Session) (string, error) {
	var h string
	err := s.Do(ctx, func(v *libvirt.Libvirt) error {
		var err error
		h, err = v.ConnectGetHostname()
		return err
	})
	if err != nil {
		return "", err // an abandoned fn may still write h
	}
	return h, nil
}

// errKind is the Kind of the *sshconn.Error in err's chain, or KindUnknown.
func errKind(err error) sshconn.Kind {
	var e *sshconn.Error
	if errors.As(err, &e) {
		return e.Kind
	}
	return sshconn.KindUnknown
}

// fakeLibvirtd speaks just enough of the libvirt RPC protocol on a unix
// socket: AuthList, ConnectOpen, ConnectClose, ConnectGetHostname,
// DomainLookupByName (always "no domain"), the volume streams.
type fakeLibvirtd struct {
	Path     string
	ln       net.Listener
	hostname string
	hang     atomic.Bool   // leave ConnectGetHostname unanswered
	held     chan struct{} // one value per ConnectGetHostname left unanswered
	hangOpen atomic.Bool   // leave ConnectOpen unanswered
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
	procDomainLookupByName = 23 // answered "no domain" (VIR_ERR_NO_DOMAIN)
	procAuthList           = 66
)

func startLibvirtd(t *testing.T, hostname string) *fakeLibvirtd {
	t.Helper()
	// Short path: unix socket paths are limited to ~108 bytes.
	dir, err := os.MkdirTemp("", "libvirtconn")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	p := filepath.Join(dir, "libvirt-sock")
	ln, err := net.Listen("unix", p)
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeLibvirtd{Path: p, ln: ln, hostname: hostname, conns: map[net.Conn]struct{}{}, calls: map[uint32][]byte{},
		held: make(chan struct{}, 64)}
	f.wg.Add(1)
	go f.serve()
	t.Cleanup(f.Close)
	return f
}

// whenHeld runs fn once a ConnectGetHostname made after this call is left
// unanswered (hang is set): that call is then in flight.
func (f *fakeLibvirtd) whenHeld(t *testing.T, fn func()) {
	t.Helper()
	for len(f.held) > 0 { // calls held earlier
		<-f.held
	}
	go func() {
		select {
		case <-f.held:
			fn()
		case <-time.After(10 * time.Second):
			fn() // the call never arrived: the test fails on its own
		}
	}()
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

// xdrError is libvirt's remote_error as go-libvirt decodes it, with code
// VIR_ERR_INTERNAL_ERROR.
func xdrError(msg string) []byte { return xdrErrorCode(libvirt.ErrInternalError, msg) }

// xdrErrorCode is libvirt's remote_error with code.
func xdrErrorCode(code libvirt.ErrorNumber, msg string) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(code))
	b = binary.BigEndian.AppendUint32(b, 0) // domain
	b = binary.BigEndian.AppendUint32(b, 0) // padding
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
		if typ == 0 {
			f.mu.Lock()
			f.calls[proc] = append(hdr[:], body...)
			f.mu.Unlock()
		}
		var err error
		switch {
		case proc == procStorageVolUpload:
			err = f.uploadPacket(c, hdr, body, ups)
		case typ == 0:
			err = f.answer(c, hdr, proc)
		}
		if err != nil {
			return
		}
	}
}

// send writes p as the answer to the call whose header is call.
func send(c net.Conn, call [28]byte, p fakePacket) error {
	_, err := c.Write(p.frame(call))
	return err
}

// uploadPacket answers one packet of StorageVolUpload (the call or a
// stream packet) as the upload script says.
func (f *fakeLibvirtd) uploadPacket(c net.Conn, hdr [28]byte, body []byte, ups map[uint32]*uploadState) error {
	sc := f.upload.Load()
	if sc == nil {
		sc = &uploadScript{}
	}
	typ := binary.BigEndian.Uint32(hdr[16:20])
	serial := binary.BigEndian.Uint32(hdr[20:24])
	if typ == 0 { // the call
		if sc.callErr != "" {
			return send(c, hdr, fakePacket{typ: 1, status: 1, payload: xdrError(sc.callErr)})
		}
		ups[serial] = &uploadState{h: sha256.New()}
		return send(c, hdr, reply())
	}
	u := ups[serial]
	if typ != 3 || u == nil || u.failed {
		return nil // libvirtd drops stream packets of a stream it closed
	}
	switch binary.BigEndian.Uint32(hdr[24:28]) {
	case 2: // data
		u.n += int64(len(body))
		u.h.Write(body)
		if sc.failAfter > 0 && u.n >= sc.failAfter {
			u.failed = true
			f.finishUpload(u, false)
			return send(c, hdr, fakePacket{typ: 1, status: 1, payload: xdrError(sc.failMsg)})
		}
		return nil
	case 0: // finish
		delete(ups, serial)
		f.finishUpload(u, false)
		p := fakePacket{typ: 3, status: 0}
		if sc.finishErr != "" {
			p = fakePacket{typ: 1, status: 1, payload: xdrError(sc.finishErr)}
		}
		return send(c, hdr, p)
	default: // abort: confirmed
		delete(ups, serial)
		f.finishUpload(u, true)
		return send(c, hdr, fakePacket{typ: 3, status: 0})
	}
}

// answer answers a call of proc other than an upload (or leaves it
// unanswered, as the fake is told).
func (f *fakeLibvirtd) answer(c net.Conn, hdr [28]byte, proc uint32) error {
	var payload []byte
	switch proc {
	case procStorageVolDownload:
		pkts := defaultDownload
		if p := f.download.Load(); p != nil {
			pkts = *p
		}
		for _, p := range pkts {
			if err := send(c, hdr, p); err != nil {
				return err
			}
		}
		return nil
	case procAuthList:
		payload = binary.BigEndian.AppendUint32(nil, 0) // no auth types
	case procConnectOpen:
		if f.hangOpen.Load() {
			return nil
		}
		f.opens.Add(1)
	case procConnectClose:
	case procDomainLookupByName:
		return send(c, hdr, fakePacket{typ: 1, status: 1, payload: xdrErrorCode(libvirt.ErrNoDomain, "Domain not found")})
	case procConnectGetHostname:
		if f.hang.Load() {
			select {
			case f.held <- struct{}{}:
			default:
			}
			return nil
		}
		payload = xdrString(f.hostname)
	default:
		return nil // unknown: never answered
	}
	return send(c, hdr, fakePacket{typ: 1, status: 0, payload: payload})
}

func (f *fakeLibvirtd) finishUpload(u *uploadState, aborted bool) {
	d := uploadDone{n: u.n, aborted: aborted, failed: u.failed}
	copy(d.sum[:], u.h.Sum(nil))
	f.mu.Lock()
	f.done = append(f.done, d)
	f.mu.Unlock()
}
