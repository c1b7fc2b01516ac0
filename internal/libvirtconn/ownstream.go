package libvirtconn

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/digitalocean/go-libvirt/socket"
)

// Own stream calls: a dedicated connection makes StorageVolUpload and
// StorageVolDownload itself, on the channel it shares with go-libvirt,
// instead of through go-libvirt, whose stream code costs memory in
// proportion to the bytes moved: it allocates a fresh buffer for every
// incoming packet and a 4 MiB send buffer for every upload call (one per
// segment of an overlapped fetch), which the garbage collector's heap goal
// then doubles. An own call reuses one packet buffer per connection for an
// upload and hands a download's bytes straight out of the guard's read
// buffer, so a fetch's heap does not grow with its packets.
//
// The protocol is libvirt's (src/rpc/virnetprotocol.x and
// src/remote/remote_daemon_stream.c): a CALL, its REPLY, then STREAM
// packets with the call's serial — data (status continue), the client's
// finish (status OK, empty) or abort (status error, empty), libvirtd's
// confirmation (status OK, empty) or error (a REPLY or STREAM packet with
// status error). A download ends at libvirtd's empty data packet (end of
// file), as go-libvirt's does: no finish is sent.
//
// Own calls use serials from ownSerialBase up, which go-libvirt (counting
// from 1 on a connection that makes a few dozen calls) never reaches; the
// guard routes every packet with such a serial to its own call (or drops
// it once the call is over) and never to go-libvirt. Writes: go-libvirt
// writes a packet in several Writes (its bufio.Writer), so the guard tracks
// the frames go-libvirt writes and lets an own packet out only between two
// of them.

const (
	ownSerialBase int32 = 1 << 30
	// ownPayload is the data of one upload packet (libvirt's own clients
	// send 256 KiB; libvirtd reads a stream's file 256 KiB at a time).
	ownPayload = 256 << 10
	// ownSenderWait bounds how long Dedicated.Close waits for an
	// upload's sender once the link is dead (the sender ends when its
	// source's Read returns; the caller closes the source).
	ownSenderWait = 10 * time.Second
)

// libvirt's remote protocol constants the own calls need.
const (
	remoteProtocolVersion = 1
	typeCall              = socket.Call
	typeReply             = socket.Reply
	typeStream            = socket.Stream
)

// ownCall is one stream call the guard routes packets to.
type ownCall struct {
	serial int32
	// sink receives a download's data, on go-libvirt's reader goroutine
	// (the guard's Read), in order; nil for an upload.
	sink io.Writer
	// events: libvirtd's answers other than data (the reply, the end,
	// an error) and a failure of sink. Buffered; the reader never blocks
	// on it (a call gets at most a reply, an end and a sink failure).
	events chan ownEvent

	// set by the reader goroutine only
	ended   bool  // the end (or an error) was delivered: drop the rest
	sinkErr error // sink failed: data is discarded from then on
	n       int64 // data bytes passed to sink
}

type ownEvent struct {
	typ, status uint32
	body        []byte
	sinkErr     error // the sink failed (no packet)
}

// final reports whether ev is libvirtd's last packet for the call:
// anything but a successful reply (data never becomes an event).
func (ev ownEvent) final() bool {
	return ev.sinkErr == nil && !(ev.typ == typeReply && ev.status == socket.StatusOK)
}

// ownState is the guard's side of own calls.
type ownState struct {
	mu     sync.Mutex
	calls  map[int32]*ownCall
	next   int32
	lost   chan struct{} // closed when the guard's Read failed: no answer will come
	lostBy error

	senders sync.WaitGroup // upload senders still reading their source
	buf     []byte         // the upload packet buffer (packetBuf)
	bufBusy bool

	// write side: go-libvirt's frames in progress
	wmu    sync.Mutex
	wcond  *sync.Cond
	frames frameTracker
	werr   error

	// rpc times every call made on the channel, go-libvirt's and the own
	// ones; nil: no metrics.
	rpc *rpcCalls
}

// packetBuf returns the connection's upload packet buffer (allocated on
// first use, then reused by every upload on the connection: a fetch's
// segments), or a fresh one while an earlier sender still holds it.
func (o *ownState) packetBuf() []byte {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.bufBusy {
		return make([]byte, headerLen+ownPayload)
	}
	if o.buf == nil {
		o.buf = make([]byte, headerLen+ownPayload)
	}
	o.bufBusy = true
	return o.buf
}

func (o *ownState) releaseBuf(b []byte) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.buf) > 0 && &b[0] == &o.buf[0] {
		o.bufBusy = false
	}
}

func (o *ownState) init() {
	o.calls = map[int32]*ownCall{}
	o.next = ownSerialBase
	o.lost = make(chan struct{})
	o.wcond = sync.NewCond(&o.wmu)
}

func (o *ownState) register(sink io.Writer) (*ownCall, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	select {
	case <-o.lost:
		return nil, o.lostErr()
	default:
	}
	c := &ownCall{serial: o.next, sink: sink, events: make(chan ownEvent, 4)}
	o.next++
	if o.next < ownSerialBase { // wrapped (2^31 calls on one connection)
		o.next = ownSerialBase
	}
	o.calls[c.serial] = c
	return c, nil
}

func (o *ownState) unregister(c *ownCall) {
	o.mu.Lock()
	delete(o.calls, c.serial)
	o.mu.Unlock()
}

func (o *ownState) call(serial int32) *ownCall {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.calls[serial]
}

// lose records that no packet will arrive any more (the guard's Read
// failed) and releases every call waiting.
func (o *ownState) lose(err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	select {
	case <-o.lost:
	default:
		o.lostBy = err
		close(o.lost)
	}
}

// lostErr: under o.mu or after lost was closed.
func (o *ownState) lostErr() error {
	return fmt.Errorf("libvirt connection lost (%v): %w", o.lostBy, libvirt.ErrInterrupted)
}

func (o *ownState) lostError() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.lostErr()
}

// frameTracker follows go-libvirt's outgoing frames through the bytes it
// writes: where a frame's header ends and how much of its body is left.
type frameTracker struct {
	rest int             // bytes of the current frame still to come, after its header
	hdr  [headerLen]byte // a frame's length word and header being written
	n    int             // bytes of hdr written so far
}

// feed advances t over p, calling header (when not nil) with the 24-byte
// header of every frame whose header p completes.
func (t *frameTracker) feed(p []byte, header func(h []byte)) {
	for len(p) > 0 {
		if t.rest > 0 {
			k := min(len(p), t.rest)
			t.rest -= k
			p = p[k:]
			continue
		}
		k := copy(t.hdr[t.n:], p)
		t.n += k
		p = p[k:]
		if t.n == len(t.hdr) {
			t.rest = max(int(binary.BigEndian.Uint32(t.hdr[:4]))-len(t.hdr), 0)
			t.n = 0
			if header != nil {
				header(t.hdr[4:])
			}
		}
	}
}

func (o *ownState) midFrame() bool { return o.frames.rest > 0 || o.frames.n > 0 }

// Write is go-libvirt's write to the channel: passed on, its frames
// tracked so that own packets go out between them. A call whose header p
// completes is noted before any of p leaves: its reply can come back
// before Write returns.
func (g *streamGuard) Write(p []byte) (int, error) {
	o := &g.own
	o.wmu.Lock()
	defer o.wmu.Unlock()
	if o.rpc != nil {
		ahead := o.frames
		ahead.feed(p, o.rpc.sent)
	}
	n, err := g.Conn.Write(p)
	o.frames.feed(p[:n], nil)
	if err != nil && o.werr == nil {
		o.werr = err
	}
	if !o.midFrame() || err != nil {
		o.wcond.Broadcast()
	}
	return n, err
}

// writeOwn writes one whole own packet between go-libvirt's frames.
func (g *streamGuard) writeOwn(pkt []byte) error {
	o := &g.own
	o.wmu.Lock()
	defer o.wmu.Unlock()
	for o.midFrame() && o.werr == nil {
		o.wcond.Wait()
	}
	if o.werr != nil {
		return fmt.Errorf("write to libvirt: %w (%w)", o.werr, libvirt.ErrInterrupted)
	}
	o.rpc.sent(pkt[4:headerLen]) // before it leaves: the reply may beat the return of Write
	if _, err := g.Conn.Write(pkt); err != nil {
		o.werr = err
		o.wcond.Broadcast()
		return fmt.Errorf("write to libvirt: %w (%w)", err, libvirt.ErrInterrupted)
	}
	return nil
}

// putHeader writes a libvirt packet header for an own packet of bodyLen
// bytes into b[:headerLen].
func putHeader(b []byte, proc uint32, typ uint32, serial int32, status uint32, bodyLen int) {
	binary.BigEndian.PutUint32(b[0:], uint32(headerLen+bodyLen))
	binary.BigEndian.PutUint32(b[4:], remoteProgram)
	binary.BigEndian.PutUint32(b[8:], remoteProtocolVersion)
	binary.BigEndian.PutUint32(b[12:], proc)
	binary.BigEndian.PutUint32(b[16:], typ)
	binary.BigEndian.PutUint32(b[20:], uint32(serial))
	binary.BigEndian.PutUint32(b[24:], status)
}

// ownPacket handles a packet whose header (in g.hdr) carries an own
// serial: a download's data goes to its sink, anything else to its call
// as an event; packets of calls that are over are dropped. The body is
// always consumed, so the framing holds.
func (g *streamGuard) ownPacket(serial int32, bodyLen int) error {
	h := g.hdr[4:headerLen]
	typ := binary.BigEndian.Uint32(h[12:16])
	status := binary.BigEndian.Uint32(h[20:24])
	c := g.own.call(serial)
	if c == nil || c.ended {
		if typ == typeReply {
			g.own.rpc.replied(h, nil) // nobody reads it: its error is not decoded
		}
		g.droppedPackets.Add(1)
		return g.discard(bodyLen)
	}
	if typ == typeStream && status == socket.StatusContinue && bodyLen > 0 {
		if c.sink == nil || c.sinkErr != nil {
			return g.discard(bodyLen)
		}
		return g.toSink(c, bodyLen)
	}
	body := make([]byte, bodyLen)
	if _, err := io.ReadFull(g.r, body); err != nil {
		return unexpected(err)
	}
	if typ == typeReply {
		g.own.rpc.replied(h, body)
	}
	ev := ownEvent{typ: typ, status: status, body: body}
	if ev.final() {
		c.ended = true
	}
	select {
	case c.events <- ev:
	default: // more than a call can get: not a shape libvirtd sends
	}
	return nil
}

// toSink passes bodyLen bytes of a data packet from the channel to c's
// sink straight out of the read buffer (no buffer per packet).
func (g *streamGuard) toSink(c *ownCall, bodyLen int) error {
	for bodyLen > 0 {
		k := g.r.Buffered()
		if k == 0 {
			if _, err := g.r.Peek(1); err != nil {
				return unexpected(err)
			}
			k = g.r.Buffered()
		}
		k = min(k, bodyLen)
		b, _ := g.r.Peek(k)
		if c.sinkErr == nil {
			if _, err := c.sink.Write(b); err != nil {
				c.sinkErr = err
				select {
				case c.events <- ownEvent{sinkErr: err}:
				default:
				}
			} else {
				c.n += int64(k)
			}
		}
		_, _ = g.r.Discard(k)
		bodyLen -= k
	}
	return nil
}

func (g *streamGuard) discard(n int) error {
	if _, err := g.r.Discard(n); err != nil {
		return unexpected(err)
	}
	return nil
}

// ownCallPacket is the CALL of proc with the XDR-encoded args.
func ownCallPacket(proc uint32, serial int32, args []byte) []byte {
	b := make([]byte, headerLen, headerLen+len(args))
	putHeader(b, proc, typeCall, serial, socket.StatusOK, len(args))
	return append(b, args...)
}

// wait returns c's next event, or an error once the connection is lost.
func (g *streamGuard) wait(c *ownCall) (ownEvent, error) {
	select {
	case ev := <-c.events:
		return ev, nil
	case <-g.own.lost:
		// An event that arrived just before the loss still counts.
		select {
		case ev := <-c.events:
			return ev, nil
		default:
		}
		return ownEvent{}, g.own.lostError()
	}
}

// answerErr is the error libvirtd's answer ev carries (a REPLY or STREAM
// packet with status error), or an error for an answer the protocol does
// not allow at that point (what names it).
func answerErr(ev ownEvent, what string) error {
	if ev.status == socket.StatusError {
		return decodeRemoteError(ev.body)
	}
	return fmt.Errorf("libvirt answered %s with a packet of type %d, status %d", what, ev.typ, ev.status)
}

// ownDownload is StorageVolDownload (proc) with XDR args: the call, then
// the data passed to sink until libvirtd's end of file, as go-libvirt
// does it (data before the reply is passed on too: libvirtd can send it
// first, see streamGuard).
func (g *streamGuard) ownDownload(proc uint32, args []byte, sink io.Writer) error {
	c, err := g.own.register(sink)
	if err != nil {
		return err
	}
	defer g.own.unregister(c)
	if err := g.writeOwn(ownCallPacket(proc, c.serial, args)); err != nil {
		return err
	}
	for {
		ev, err := g.wait(c)
		if err != nil {
			return err
		}
		switch {
		case ev.sinkErr != nil:
			// Stop libvirtd sending; what it sent meanwhile is dropped.
			var abort [headerLen]byte
			putHeader(abort[:], proc, typeStream, c.serial, socket.StatusError, 0)
			_ = g.writeOwn(abort[:])
			return ev.sinkErr
		case ev.typ == typeReply && ev.status == socket.StatusOK:
			continue // the data follows (or came first)
		case ev.status == socket.StatusError:
			return decodeRemoteError(ev.body)
		case ev.typ == typeStream:
			return nil // end of file (empty data) or libvirtd's OK
		default:
			return answerErr(ev, "a download")
		}
	}
}

// ownUpload is StorageVolUpload (proc) with XDR args: the call, then src
// sent in packets of up to ownPayload bytes from the connection's buffer, then
// the finish, whose confirmation ends it. Like go-libvirt's, the call
// returns as soon as libvirtd reports an error, even while src's Read
// blocks: src is read by a sender goroutine that ends when that Read
// returns (Dedicated.Close waits for it); a source error is sent as
// an abort and returned once libvirtd confirmed it.
func (g *streamGuard) ownUpload(proc uint32, args []byte, src io.Reader) error {
	c, err := g.own.register(nil)
	if err != nil {
		return err
	}
	defer g.own.unregister(c)
	if err := g.writeOwn(ownCallPacket(proc, c.serial, args)); err != nil {
		return err
	}
	ev, err := g.wait(c)
	if err != nil {
		return err
	}
	if ev.typ != typeReply || ev.status != socket.StatusOK {
		return answerErr(ev, "an upload call")
	}
	s := &ownSender{g: g, c: c, proc: proc, src: src, done: make(chan error, 1), stop: make(chan struct{})}
	g.own.senders.Add(1)
	go s.run()
	defer close(s.stop)
	ev, err = g.wait(c)
	if err != nil {
		return err
	}
	if ev.status == socket.StatusError {
		return decodeRemoteError(ev.body)
	}
	if ev.typ != typeStream || ev.status != socket.StatusOK || len(ev.body) != 0 {
		return answerErr(ev, "an upload")
	}
	// libvirtd confirmed a finish or an abort: the sender has sent it
	// and is returning.
	select {
	case err := <-s.done:
		return err
	case <-g.own.lost:
		return g.own.lostError()
	}
}

// ownSender sends an upload's source.
type ownSender struct {
	g    *streamGuard
	c    *ownCall
	proc uint32
	src  io.Reader
	done chan error    // the source's error after the abort was sent, nil after the finish
	stop chan struct{} // closed when the call returned: stop after the current Read
}

func (s *ownSender) run() {
	defer s.g.own.senders.Done()
	buf := s.g.own.packetBuf()
	defer s.g.own.releaseBuf(buf)
	for {
		select {
		case <-s.stop:
			return
		default:
		}
		n, err := s.src.Read(buf[headerLen:])
		select {
		case <-s.stop:
			return // libvirtd failed the stream, or the link is gone
		default:
		}
		if n > 0 {
			putHeader(buf, s.proc, typeStream, s.c.serial, socket.StatusContinue, n)
			if werr := s.g.writeOwn(buf[:headerLen+n]); werr != nil {
				return // the call sees the link go
			}
		}
		if err == nil {
			continue
		}
		status := uint32(socket.StatusOK) // finish
		if !errors.Is(err, io.EOF) {
			status = socket.StatusError // abort; libvirtd confirms it
		} else {
			err = nil
		}
		var end [headerLen]byte
		putHeader(end[:], s.proc, typeStream, s.c.serial, status, 0)
		if werr := s.g.writeOwn(end[:]); werr != nil {
			return
		}
		s.done <- err
		return
	}
}

// decodeRemoteError decodes libvirt's remote_error (code, domain,
// optional message, level, …) as go-libvirt does: a libvirt.Error with
// the code and message; "unknown procedure" is libvirt.ErrUnsupported.
func decodeRemoteError(b []byte) error {
	u32 := func() (uint32, bool) {
		if len(b) < 4 {
			return 0, false
		}
		v := binary.BigEndian.Uint32(b)
		b = b[4:]
		return v, true
	}
	code, ok1 := u32()
	_, ok2 := u32() // domain
	// The message is optional in XDR (a flag, then the string); libvirt
	// always sets it, and go-libvirt reads the string whatever the flag
	// says: so do we.
	_, ok3 := u32()
	n, ok4 := u32()
	if !ok1 || !ok2 || !ok3 || !ok4 || uint64(n) > uint64(len(b)) {
		return errors.New("libvirt sent a malformed error")
	}
	msg := string(b[:n])
	if strings.Contains(msg, "unknown procedure") {
		return libvirt.ErrUnsupported
	}
	if libvirt.ErrorNumber(code) == libvirt.ErrOk {
		return nil
	}
	return libvirt.Error{Code: code, Message: msg}
}

// volStreamArgs is the XDR encoding of remote_storage_vol_upload_args and
// remote_storage_vol_download_args (the same layout): the volume (pool,
// name, key), offset, length, flags.
func volStreamArgs(vol libvirt.StorageVol, offset, length uint64, flags uint32) []byte {
	var b []byte
	for _, s := range []string{vol.Pool, vol.Name, vol.Key} {
		b = binary.BigEndian.AppendUint32(b, uint32(len(s)))
		b = append(b, s...)
		for len(b)%4 != 0 {
			b = append(b, 0)
		}
	}
	b = binary.BigEndian.AppendUint64(b, offset)
	b = binary.BigEndian.AppendUint64(b, length)
	return binary.BigEndian.AppendUint32(b, flags)
}

// StorageVolUpload uploads src into vol at offset (length 0: until src
// ends) like L.StorageVolUpload, with this package's own stream code: one
// 256 KiB packet buffer per connection instead of go-libvirt's 4 MiB
// buffer per call. It returns as soon as libvirtd reports an error, even
// while a Read of src blocks; src is then read no further once that Read
// returns, and Close waits for it to return (close src to end it).
// Kill ends a call blocked on a dead peer.
func (d *Dedicated) StorageVolUpload(vol libvirt.StorageVol, src io.Reader, offset, length uint64, flags libvirt.StorageVolUploadFlags) error {
	if d.guard == nil {
		return d.L.StorageVolUpload(vol, src, offset, length, flags)
	}
	return d.guard.ownUpload(procStorageVolUpload, volStreamArgs(vol, offset, length, uint32(flags)), src)
}

// StorageVolDownload writes vol's bytes at [offset, offset+length) (length
// 0: to the end) to w like L.StorageVolDownload, with this package's own
// stream code: w is given the bytes straight from the connection's read buffer
// (no buffer per packet), on the connection's reader goroutine. As with
// go-libvirt, w should never fail (a failing w ends the call early); after
// a call that returned early (Kill) w may still be written to once.
func (d *Dedicated) StorageVolDownload(vol libvirt.StorageVol, w io.Writer, offset, length uint64, flags libvirt.StorageVolDownloadFlags) error {
	if d.guard == nil {
		return d.L.StorageVolDownload(vol, w, offset, length, flags)
	}
	return d.guard.ownDownload(procStorageVolDownload, volStreamArgs(vol, offset, length, uint32(flags)), w)
}
