package libvirtconn

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"sync/atomic"

	"github.com/digitalocean/go-libvirt/socket"
)

// streamGuard sits between go-libvirt's packet reader and the channel to
// libvirtd and keeps go-libvirt's reply router from deadlocking on streams.
//
// go-libvirt (the pinned version, and upstream; see
// docs/upstream.md) delivers each incoming packet to the waiting call on an
// unbuffered channel while holding the client's callback mutex, and a call
// deregisters itself under that mutex when it returns. Two shapes of
// traffic that libvirtd really sends then block the router forever, and
// with it every call on the connection:
//
//   - a stream packet that arrives after the packet that ended the call for
//     go-libvirt (an error for a data packet followed by the confirmation of
//     a finish already on its way; a second packet after end of file): the
//     call has stopped reading, the router waits for it while it waits for
//     the router's mutex;
//   - a stream data packet that arrives before the reply to the call that
//     opened the stream (libvirtd's event loop can send the first data
//     before the worker thread queues the reply, seen under CPU load): the
//     call takes the data for its reply, then takes the real reply for the
//     end of the stream, returns with nothing read, and the next data packet
//     blocks the router as above.
//
// The guard parses libvirt's framing (length, then a 24-byte header) and,
// per stream serial, holds back stream packets until their reply has been
// passed on, and drops every packet that follows the one go-libvirt treats
// as the end (an error or OK status, or an empty data packet). Everything
// else passes unchanged. Only go-libvirt's single reader goroutine calls
// Read; Write goes straight to the channel (its frames are tracked so that
// the own stream calls, see ownState, can write between them), and
// packets with the serial of an own call go to that call, never to
// go-libvirt.
//
// Callers of go-libvirt's stream downloads must pass a writer that never
// fails: a failing writer also ends the call early, which no guard can see.
type streamGuard struct {
	net.Conn
	r       *bufio.Reader
	pending []byte // accepted bytes not yet returned by Read
	// through counts the body bytes of the current data packet still to be
	// copied straight from r into Read's buffer (after its header, which
	// is in pending): a download's data packets of a replied stream are
	// passed on without being staged in a buffer of their own.
	through int
	hdr     [headerLen]byte

	streams  map[int32]*guardedStream
	ended    map[int32]struct{} // serials whose stream ended for go-libvirt
	endedFIF []int32            // ended serials, oldest first (bounded memory)
	held     int                // bytes held back in all streams

	// counters, for tests and logs
	heldPackets    atomic.Int64
	droppedPackets atomic.Int64

	// own stream calls made on this channel beside go-libvirt
	// (ownState); its write side serialises every Write.
	own ownState
}

type guardedStream struct {
	replied bool
	held    [][]byte
}

const (
	headerLen = 4 + 24 // length word + header
	// maxPacket bounds one libvirt packet (libvirt's own limit is 32 MiB).
	maxPacket = 32 << 20
	// maxHeld bounds the bytes held back before their reply; libvirtd
	// sends at most a few 256 KiB data packets ahead of it.
	maxHeld = 64 << 20
	// maxEnded bounds how many ended serials are remembered.
	maxEnded = 1024
)

func newStreamGuard(c net.Conn) *streamGuard {
	g := &streamGuard{
		Conn:    c,
		r:       bufio.NewReaderSize(c, 64<<10),
		streams: map[int32]*guardedStream{},
		ended:   map[int32]struct{}{},
	}
	g.own.init()
	return g
}

// Read returns the bytes of accepted packets, reading and sorting as many
// packets from the channel as needed.
func (g *streamGuard) Read(p []byte) (int, error) {
	for len(g.pending) == 0 && g.through == 0 {
		if err := g.next(); err != nil {
			g.own.lose(err) // no answer reaches an own call any more
			g.own.rpc.lose()
			return 0, err
		}
	}
	if len(g.pending) == 0 {
		if len(p) > g.through {
			p = p[:g.through]
		}
		n, err := g.r.Read(p)
		g.through -= n
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		if n > 0 {
			err = nil // a short read is retried by the caller's next Read
		}
		return n, err
	}
	n := copy(p, g.pending)
	g.pending = g.pending[n:]
	return n, nil
}

// next reads one packet and queues, holds or drops it; a data packet that
// a replied stream's call is waiting for only has its header read here
// (the body follows through Read).
func (g *streamGuard) next() error {
	if _, err := io.ReadFull(g.r, g.hdr[:4]); err != nil {
		return err
	}
	n := binary.BigEndian.Uint32(g.hdr[:4])
	if n < headerLen || n > maxPacket {
		return fmt.Errorf("libvirt packet of %d bytes: %w", n, errBadFrame)
	}
	if _, err := io.ReadFull(g.r, g.hdr[4:]); err != nil {
		return unexpected(err)
	}
	if serial := int32(binary.BigEndian.Uint32(g.hdr[4+16 : 4+20])); serial >= ownSerialBase {
		return g.ownPacket(serial, int(n)-headerLen)
	}
	if n > headerLen && g.passesThrough(g.hdr[4:]) {
		g.pending = g.hdr[:]
		g.through = int(n) - headerLen
		return nil
	}
	pkt := make([]byte, n)
	copy(pkt, g.hdr[:])
	if _, err := io.ReadFull(g.r, pkt[headerLen:]); err != nil {
		return unexpected(err)
	}
	g.sort(pkt)
	return nil
}

func unexpected(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}

// passesThrough reports whether a packet with header h and a body is a
// data packet that sort would pass on unchanged without ending its stream:
// a stream packet with status continue of a stream whose reply has been
// passed on and that has not ended.
func (g *streamGuard) passesThrough(h []byte) bool {
	if binary.BigEndian.Uint32(h[12:16]) != socket.Stream ||
		binary.BigEndian.Uint32(h[20:24]) != socket.StatusContinue {
		return false
	}
	serial := int32(binary.BigEndian.Uint32(h[16:20]))
	if _, ok := g.ended[serial]; ok {
		return false
	}
	st := g.streams[serial]
	return st != nil && st.replied
}

var errBadFrame = fmt.Errorf("bad frame")

// sort decides what happens to one whole packet.
func (g *streamGuard) sort(pkt []byte) {
	h := pkt[4:headerLen]
	typ := binary.BigEndian.Uint32(h[12:16])
	serial := int32(binary.BigEndian.Uint32(h[16:20]))
	status := binary.BigEndian.Uint32(h[20:24])

	if typ == socket.Reply {
		g.own.rpc.replied(h, pkt[headerLen:])
	}
	if _, ok := g.ended[serial]; ok && (typ == socket.Stream || typ == socket.Reply) {
		g.droppedPackets.Add(1)
		return
	}
	switch typ {
	case socket.Reply:
		st := g.streams[serial]
		if st == nil {
			if !isStreamProc(h) {
				g.pass(pkt)
				return
			}
			st = &guardedStream{}
			g.streams[serial] = st
		}
		st.replied = true
		g.pass(pkt)
		if status != socket.StatusOK {
			g.end(serial) // the call returned with this error
			return
		}
		for _, q := range st.held {
			g.held -= len(q)
			if g.stream(serial, q) {
				g.droppedPackets.Add(int64(len(st.held)) - 1)
				break
			}
		}
		st.held = nil
	case socket.Stream:
		st := g.streams[serial]
		if st == nil {
			st = &guardedStream{}
			g.streams[serial] = st
		}
		if !st.replied {
			if g.held+len(pkt) > maxHeld {
				// Not a shape libvirtd sends; pass it on rather than
				// grow without bound.
				g.pass(pkt)
				return
			}
			g.heldPackets.Add(1)
			g.held += len(pkt)
			st.held = append(st.held, pkt)
			return
		}
		g.stream(serial, pkt)
	default:
		g.pass(pkt)
	}
}

// stream passes a stream packet of a replied call and reports whether it
// ended the stream for go-libvirt.
func (g *streamGuard) stream(serial int32, pkt []byte) bool {
	status := binary.BigEndian.Uint32(pkt[4+20 : 4+24])
	g.pass(pkt)
	if status == socket.StatusContinue && len(pkt) > headerLen {
		return false
	}
	g.end(serial)
	return true
}

func (g *streamGuard) end(serial int32) {
	delete(g.streams, serial)
	g.ended[serial] = struct{}{}
	g.endedFIF = append(g.endedFIF, serial)
	if len(g.endedFIF) > maxEnded {
		delete(g.ended, g.endedFIF[0])
		g.endedFIF = g.endedFIF[1:]
	}
}

func (g *streamGuard) pass(pkt []byte) {
	if len(g.pending) == 0 {
		g.pending = pkt
		return
	}
	g.pending = append(g.pending, pkt...)
}

// libvirt's remote program and its stream procedures that this module
// uses (REMOTE_PROC_STORAGE_VOL_UPLOAD, REMOTE_PROC_STORAGE_VOL_DOWNLOAD).
const (
	remoteProgram          = 0x20008086
	procStorageVolUpload   = 208
	procStorageVolDownload = 209
)

func isStreamProc(h []byte) bool {
	if binary.BigEndian.Uint32(h[0:4]) != remoteProgram {
		return false
	}
	switch binary.BigEndian.Uint32(h[8:12]) {
	case procStorageVolUpload, procStorageVolDownload:
		return true
	}
	return false
}
