package basecache

import (
	"context"
	"crypto/sha256"
	"encoding"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/internal/errs"
	"go.opentelemetry.io/otel/trace"
)

// Overlapped verification (see the package doc and
// docs/overlapped-verification.md): a cold fetch uploads the image in
// segments, one StorageVolUpload at an offset each, on one dedicated
// connection, while a second dedicated connection reads back
// (StorageVolDownload with offset and length) every segment whose upload
// stream has finished, hashing in order. The digest that decides is the
// one of the bytes read back from the host's volume.
const (
	// segmentSize is how many bytes one upload stream carries (the last
	// one the rest). A segment is read back while the next is uploaded,
	// so the read-back of the last one is what a fetch adds to one
	// transfer: smaller segments shorten that tail, but each costs a
	// stream setup, a drain and a finish (a few round trips).
	segmentSize = 32 << 20
	// inUseRetries bounds how often an upload segment refused with
	// "volume is still in use" before its first byte (libvirt checks
	// in_use, which a download holds while it sets up) is tried again.
	inUseRetries = 20
)

// committed is the boundary between the upload and the read-back: bytes
// [0, end) of the volume were written by upload streams that have
// finished (libvirt joined its writer and closed the file before it
// confirmed them), and no stream writes them again.
type committed struct {
	mu    sync.Mutex
	end   int64
	final bool          // the upload is over: end is the image's size
	halt  bool          // the upload failed: stop after the current range
	wake  chan struct{} // capacity 1: end, final or halt changed

	// The upload's connection, offered to the read-back when the upload
	// is over and the read-back has none yet (an image of one segment:
	// nothing was read back while it uploaded), so that the read-back
	// does not dial a connection of its own (an SSH and a libvirt
	// handshake: several round trips) after the upload. reader: the
	// read-back has (or is opening) a connection; offers are refused.
	offered Dedicated
	reader  bool
}

// offer hands the upload's connection dc to the read-back; false when the
// read-back has a connection of its own (the caller closes dc).
func (w *committed) offer(dc Dedicated) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.reader || w.offered != nil {
		return false
	}
	w.offered = dc
	return true
}

// take returns the offered connection (nil when none) and marks the
// read-back as having a connection from now on: it uses the one returned,
// or opens its own.
func (w *committed) take() Dedicated {
	w.mu.Lock()
	defer w.mu.Unlock()
	dc := w.offered
	w.offered, w.reader = nil, true
	return dc
}

// untaken returns a connection offered and never taken (the read-back
// ended before it needed one), for the caller to close.
func (w *committed) untaken() Dedicated {
	w.mu.Lock()
	defer w.mu.Unlock()
	dc := w.offered
	w.offered = nil
	return dc
}

// stop asks the read-back to end after the range it reads now.
func (w *committed) stop() {
	w.mu.Lock()
	w.halt = true
	w.mu.Unlock()
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

func (w *committed) halted() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.halt
}

func newCommitted() *committed { return &committed{wake: make(chan struct{}, 1)} }

func (w *committed) set(end int64, final bool) {
	w.mu.Lock()
	w.end = max(w.end, end)
	w.final = w.final || final
	w.mu.Unlock()
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

func (w *committed) get() (int64, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.end, w.final
}

// segments is the upload's view of the image body: it ends (io.EOF) every
// left bytes, so that each upload stream carries one segment. The first
// Read of a segment runs once libvirt has set up that segment's stream;
// it is then that the previous segment is committed for the read-back,
// so a download never sets up together with an upload (libvirt would
// refuse the upload as "in use"). Only the meter calls Read, under its
// lock; the upload loop sets the fields under the same lock.
type segments struct {
	r       io.Reader
	left    int64
	read    int64 // bytes of the current segment read so far
	eof     bool  // r ended
	pending int64 // end of the previous segment, not yet committed
	w       *committed
}

func (s *segments) Read(p []byte) (int, error) {
	if s.pending > 0 {
		s.w.set(s.pending, false)
		s.pending = 0
	}
	if s.eof || s.left <= 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > s.left {
		p = p[:s.left]
	}
	n, err := s.r.Read(p)
	s.left -= int64(n)
	s.read += int64(n)
	if errors.Is(err, io.EOF) {
		s.eof = true
	}
	return n, err
}

// readResult is what the read-back found: the bytes it read from the
// host and their sha256, or why it failed. span is imagecache.Verify,
// started with the first read-back and ended by the caller of transfer
// once the stored bytes are judged. closed, when not nil, is closed once
// the read-back's connection is: after a read-back that succeeded the
// connection closes in the background (its polite libvirt close costs a
// round trip, which then overlaps the checks that follow), and the
// caller waits for it before it returns, and before it deletes the volume.
type readResult struct {
	n      int64
	digest string
	err    error
	span   trace.Span
	closed <-chan struct{}
}

// transfer runs the upload of body into volume name (upload) and, beside
// it, the read-back of every segment it has finished (readBehind). check
// judges the upload's count and digest once it is over, before the last
// segment is read back. transfer returns when both have ended and closed
// their connections:
//   - the upload failed, or check did: that error, the read-back stopped;
//   - the read-back failed first: its error, the upload stopped for it;
//   - otherwise the upload's count and digest and what the read-back
//     found (its error included, for the caller to weigh after the
//     volume's size).
//
// vol is the volume's handle as its creation answered it (see doHandle);
// ahead, when not nil, is the upload's connection being opened ahead (see
// dialAhead); t, when not nil, counts the bytes sent (see tally).
func (c *Cache) transfer(ctx context.Context, vol libvirt.StorageVol, ahead *dialing, body io.ReadCloser, total int64, free uint64, t *tally, check func(n int64, digest string) error) (n int64, digest string, back readResult, err error) {
	name := vol.Name
	w := newCommitted()
	uctx, stopUpload := context.WithCancel(ctx)
	defer stopUpload()
	rctx, stopRead := context.WithCancel(ctx)
	defer stopRead()
	var readFailed atomic.Bool
	rc := make(chan readResult, 1)
	go func() {
		r := c.readBehind(rctx, vol, w)
		if r.err != nil && rctx.Err() == nil && !errors.Is(r.err, errHalted) {
			// Whatever the upload still sends is wasted: stop it.
			readFailed.Store(true)
			stopUpload()
		}
		rc <- r
	}()
	n, digest, dc, err := c.upload(uctx, name, &vol, ahead, body, total, free, w, t)
	if err == nil {
		if err = check(n, digest); err != nil {
			_ = dc.Close()
		}
	}
	if err != nil {
		r := c.endReadBack(ctx, w, rc, stopRead, readFailed.Load())
		if r.closed != nil {
			<-r.closed // not expected: a read-back ends with an error here
		}
		if readFailed.Load() && ctx.Err() == nil {
			err = r.err
		}
		if r.span != nil {
			endSpan(r.span, err)
		}
		return n, digest, readResult{}, err
	}
	offered := w.offer(dc)
	w.set(n, true)
	if !offered {
		_ = dc.Close() // the read-back has its own and reads the last range meanwhile
	}
	back = <-rc
	if dc := w.untaken(); dc != nil {
		_ = dc.Close()
	}
	return n, digest, back, nil
}

// haltWait bounds how long a failed fetch lets the read-back finish the
// range it reads (see endReadBack) before its link is killed.
const haltWait = 2 * time.Second

// endReadBack ends the read-back of a fetch whose upload failed. When ctx
// ended or the read-back failed, its link is killed at once. Otherwise it
// may finish the range it is reading (at most haltWait): libvirtd's reader
// then reaches the range's end and closes the volume's file itself, while
// a killed link leaves the file open in libvirtd until it notices the
// client is gone, so the space of the volume deleted next would come back
// only later.
func (c *Cache) endReadBack(ctx context.Context, w *committed, rc <-chan readResult, stopRead context.CancelFunc, readFailed bool) readResult {
	if ctx.Err() != nil || readFailed {
		stopRead()
		return <-rc
	}
	w.stop()
	t := time.AfterFunc(haltWait, stopRead)
	defer t.Stop()
	return <-rc
}

// errHalted: the read-back stopped because the upload failed.
var errHalted = errors.New("read-back stopped: the upload failed")

// readBehind reads back, in order and on a dedicated connection of its
// own (opened with the first committed bytes, closed before it returns),
// every range of the volume the upload commits, and hashes it. It ends
// once the upload is final and everything is read, when ctx ends, or at
// its first error; a range that returns fewer bytes than were committed is
// an error at once. A range whose stream stalls is read once more on a
// fresh connection, the hash rewound to its start.
//
// known is the volume's handle as its creation answered it, good on any
// connection (see doHandle). The first connection is the upload's when it
// offers it (an image of one segment, see committed); after a read-back
// that succeeded the connection closes in the background
// (readResult.closed).
func (c *Cache) readBehind(ctx context.Context, known libvirt.StorageVol, w *committed) (res readResult) {
	name := known.Name
	var dc Dedicated
	vol := known
	defer func() {
		switch {
		case dc == nil:
		case res.err == nil:
			res.closed = c.closeAside(dc)
		default:
			_ = dc.Close()
		}
	}()
	h := sha256.New()
	var off int64
	retried := false
	for {
		if w.halted() {
			res.n, res.err = off, errHalted
			return res
		}
		end, final := w.get()
		if off >= end {
			if final {
				res.n, res.digest = off, hex.EncodeToString(h.Sum(nil))
				return res
			}
			select {
			case <-ctx.Done():
				res.n, res.err = off, c.classify(ctx, fmt.Errorf("read back %s after %d bytes: %w", name, off, ctx.Err()))
				return res
			case <-w.wake:
			}
			continue
		}
		if res.span == nil {
			_, res.span = c.start(ctx, "imagecache.Verify", name)
		}
		if dc == nil {
			if dc = w.take(); dc == nil {
				var err error
				if dc, err = c.conn.Dedicated(ctx); err != nil {
					dc = nil
					res.n, res.err = off, c.classify(ctx, fmt.Errorf("read back %s: dedicated connection: %w", name, err))
					return res
				}
			}
		}
		state, err := h.(encoding.BinaryMarshaler).MarshalBinary()
		if err != nil {
			res.n, res.err = off, errs.WithCode(errs.Permanent, fmt.Errorf("read back %s: %w", name, err))
			return res
		}
		got, err := c.readRange(ctx, dc, name, &vol, h, off, end-off)
		if errors.Is(err, errStalled) && ctx.Err() == nil && !retried {
			retried = true
			c.log.Info("the read-back stream made no progress; reading back once more on a fresh connection", "volume", name, "bytes", off, "err", err.Error())
			_ = dc.Close()
			dc, vol = nil, known
			if uerr := h.(encoding.BinaryUnmarshaler).UnmarshalBinary(state); uerr != nil {
				res.n, res.err = off, errs.WithCode(errs.Permanent, fmt.Errorf("read back %s: %w", name, uerr))
				return res
			}
			continue
		}
		if err != nil {
			res.n, res.err = off+got, err
			return res
		}
		if got != end-off {
			res.n, res.err = off+got, errs.Errorf(errs.Transient, "verify %s: the host returned %d bytes at offset %d but %d were uploaded there (upload lost data; disk full?)", name, got, off, end-off)
			return res
		}
		off = end
	}
}

// readRange hashes into h the bytes libvirt reads from the volume on the
// host at [off, off+length) (length 0: to the end) over dc, and returns how
// many it read. A stall or ctx ending kills dc (see runStream). *vol is the
// volume's handle on dc: looked up (pool, then volume) when still zero and
// kept there, so the ranges of one read-back pay the lookups once.
func (c *Cache) readRange(ctx context.Context, dc Dedicated, name string, vol *libvirt.StorageVol, h hash.Hash, off, length int64) (int64, error) {
	// The writer never fails: go-libvirt must keep draining the stream
	// (a failing writer would end the call early, leaving packets behind
	// for its router); ctx and stalls kill the link.
	w := &hashWriter{h: h, stall: c.cfg.StreamStall}
	w.touch()
	err := c.runStream(ctx, dc, "read back "+name, w.stalled, func() error {
		if vol.Name == "" {
			v, err := c.lookupVol(dc.Libvirt(), name)
			if err != nil {
				return err
			}
			*vol = v
		}
		return dc.Libvirt().StorageVolDownload(*vol, w, uint64(off), uint64(length), 0)
	})
	w.mu.Lock()
	defer w.mu.Unlock()
	w.h = nil // a call runStream gave up on must not write into h any more
	if err != nil {
		return w.n, c.classify(ctx, fmt.Errorf("read back %s after %d bytes: %w", name, off+w.n, err))
	}
	return w.n, nil
}

// inUse reports libvirt refusing a stream on a volume another stream is
// being set up on ("volume ... is still in use").
func inUse(err error) bool {
	return isLibvirtErr(err, libvirt.ErrOperationInvalid) && strings.Contains(err.Error(), "in use")
}
