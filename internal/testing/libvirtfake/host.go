// Package libvirtfake is an in-memory libvirtd for unit tests: storage
// pools and volumes (with upload and download streams on byte slices) and
// defined domains, reached through sessions whose methods have the
// signatures of go-libvirt's *libvirt.Libvirt, so a Session satisfies the
// small interfaces packages declare for what they call (basecache.Libvirt).
//
// It owns: the state (Host), the sessions (Session; Do and Dedicated mirror
// libvirtconn's shared and dedicated sessions), the errors (libvirt.Error values
// with the codes and messages libvirtd returns, so classifiers see what
// they see in production), and fault injection (SetHook, SetStreamHook: any
// call can fail, block until released or until its session is killed, and
// a stream can be cut or stalled after any number of bytes).
//
// It does not own libvirt's semantics beyond what its callers need. Domains
// are definitions only (define, undefine, list, XML): no lifecycle, no
// networks; a kvm2 fake grows them here, in domain.go and beside it.
//
// Every method is safe for concurrent use. Hooks run without any lock held
// and may call the Host.
package libvirtfake

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/digitalocean/go-libvirt"
)

// DefaultChunk is the default stream chunk size (SetChunkSize).
const DefaultChunk = 64 << 10

// ErrKilled is returned by the calls of a killed or closed session, and by
// Call.Wait when the session dies while the hook waits. It is not a
// libvirt.Error: it stands for the connection failing, as go-libvirt's
// errors do when its socket closes.
var ErrKilled = errors.New("libvirtfake: session killed: connection closed")

// ErrHostClosed is returned by Do and Dedicated after Host.Close.
var ErrHostClosed = errors.New("libvirtfake: host closed")

// Host is one in-memory libvirtd. The zero value is not usable: call New.
type Host struct {
	mu       sync.Mutex
	pools    map[string]*pool
	domains  map[string]*domain
	hooks    map[string]Hook
	streams  map[string]Hook
	calls    map[string]int
	sessions map[*Session]struct{}
	shared   *Session
	chunk    int
	seq      uint64 // UUIDs
	closed   bool
	wg       sync.WaitGroup // Do's goroutines
}

// New returns an empty Host: no pools, no domains, no hooks.
func New() *Host {
	h := &Host{
		pools:    map[string]*pool{},
		domains:  map[string]*domain{},
		hooks:    map[string]Hook{},
		streams:  map[string]Hook{},
		calls:    map[string]int{},
		sessions: map[*Session]struct{}{},
		chunk:    DefaultChunk,
	}
	h.shared = h.newSessionLocked(false)
	return h
}

// Call describes one call for a hook.
type Call struct {
	// Method is the go-libvirt method name ("StorageVolUpload"), or "Do"
	// and "Dedicated" for the Host's own entry points.
	Method string
	// Session is the session the call runs on (nil for "Dedicated").
	Session *Session
	// Pool and Volume name what the call is about, when it has them.
	Pool, Volume string
	// Done is, for a stream hook, the bytes moved so far by this call.
	// An upload moves what one Read of its source returns (at most the
	// chunk size), so Done need not be a multiple of it.
	Done int64
}

// Wait blocks until release is closed (nil), or the call's session is
// killed or closed, or the Host is closed (ErrKilled). A hook that blocks
// with Wait therefore never outlives its session: Kill ends it, as it ends
// a blocked call of go-libvirt.
func (c Call) Wait(release <-chan struct{}) error {
	var dead <-chan struct{}
	if c.Session != nil {
		dead = c.Session.dead
	}
	select {
	case <-release:
		return nil
	case <-dead:
		return ErrKilled
	}
}

// Hook runs before a call does its work (SetHook) or before a stream moves
// its next chunk (SetStreamHook). A non-nil error is returned by the call
// as it is; nil lets the call go on.
type Hook func(Call) error

// SetHook makes fn run before every call of method (nil: none). It
// replaces the previous hook of method.
func (h *Host) SetHook(method string, fn Hook) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if fn == nil {
		delete(h.hooks, method)
		return
	}
	h.hooks[method] = fn
}

// SetStreamHook makes fn run before each chunk of the stream call method
// ("StorageVolUpload", "StorageVolDownload"), with Call.Done the bytes
// moved so far (nil: none). An error cuts the stream: the call returns it.
// Blocking (Call.Wait) stalls the stream.
func (h *Host) SetStreamHook(method string, fn Hook) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if fn == nil {
		delete(h.streams, method)
		return
	}
	h.streams[method] = fn
}

// Fail returns a hook that fails every call with err.
func Fail(err error) Hook { return func(Call) error { return err } }

// FailN returns a hook that fails the first n calls with err.
func FailN(n int, err error) Hook {
	var mu sync.Mutex
	return func(Call) error {
		mu.Lock()
		defer mu.Unlock()
		if n <= 0 {
			return nil
		}
		n--
		return err
	}
}

// Block returns a hook that blocks each call until release is closed or
// its session dies (then the call fails with ErrKilled).
func Block(release <-chan struct{}) Hook { return func(c Call) error { return c.Wait(release) } }

// CutAfter returns a stream hook that fails the stream with err once n
// bytes have moved.
func CutAfter(n int64, err error) Hook {
	return func(c Call) error {
		if c.Done >= n {
			return err
		}
		return nil
	}
}

// StallAfter returns a stream hook that stalls the stream once n bytes
// have moved, until release is closed or the session dies.
func StallAfter(n int64, release <-chan struct{}) Hook {
	return func(c Call) error {
		if c.Done >= n {
			return c.Wait(release)
		}
		return nil
	}
}

// SetChunkSize sets how many bytes a stream moves between two stream hook
// calls (zero or less: DefaultChunk).
func (h *Host) SetChunkSize(n int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if n <= 0 {
		n = DefaultChunk
	}
	h.chunk = n
}

// Calls returns how many times method was called (hooked failures
// included), on any session.
func (h *Host) Calls(method string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.calls[method]
}

// enter counts a call, refuses it on a dead session and runs its hook.
func (h *Host) enter(c Call) error {
	h.mu.Lock()
	h.calls[c.Method]++
	fn := h.hooks[c.Method]
	h.mu.Unlock()
	if c.Session != nil && c.Session.isDead() {
		return ErrKilled
	}
	if fn != nil {
		if err := fn(c); err != nil {
			return err
		}
	}
	if c.Session != nil && c.Session.isDead() {
		return ErrKilled
	}
	return nil
}

func (h *Host) streamHook(c Call) error {
	h.mu.Lock()
	fn := h.streams[c.Method]
	h.mu.Unlock()
	if fn != nil {
		if err := fn(c); err != nil {
			return err
		}
	}
	if c.Session.isDead() {
		return ErrKilled
	}
	return nil
}

// Session is one connection to the Host. Its methods have the signatures
// of go-libvirt's *libvirt.Libvirt. Kill ends it at once; calls blocked in
// a hook (Call.Wait) or a stream return ErrKilled.
type Session struct {
	h         *Host
	dedicated bool
	dead      chan struct{}
	once      sync.Once
}

func (h *Host) newSessionLocked(dedicated bool) *Session {
	s := &Session{h: h, dedicated: dedicated, dead: make(chan struct{})}
	h.sessions[s] = struct{}{}
	return s
}

// Kill ends the session at once. Calling it again is allowed.
func (s *Session) Kill() {
	s.once.Do(func() { close(s.dead) })
	s.h.mu.Lock()
	delete(s.h.sessions, s)
	s.h.mu.Unlock()
}

// Close ends the session (as Kill: there is no peer to be polite to).
func (s *Session) Close() error {
	s.Kill()
	return nil
}

func (s *Session) isDead() bool {
	select {
	case <-s.dead:
		return true
	default:
		return false
	}
}

// Shared returns the Host's shared session, the one Do runs on. Killing
// it makes every later call on it fail with ErrKilled (a lost session).
func (h *Host) Shared() *Session { return h.shared }

// Do runs fn with the shared session in a goroutine of its own, with
// libvirtconn.Session.Do's semantics: a ctx that already ended starts nothing;
// when ctx ends before fn returns, Do returns ctx's error at once and fn
// goes on running (the caller must not read what fn writes unless Do
// returned nil); Close waits for such fns. The hook "Do" runs first: its
// error is returned without running fn (a transport failure, say).
func (h *Host) Do(ctx context.Context, fn func(*Session) error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		return ErrHostClosed
	}
	s := h.shared
	h.wg.Add(1)
	h.mu.Unlock()
	done := make(chan error, 1)
	go func() {
		defer h.wg.Done()
		if err := h.enter(Call{Method: "Do", Session: s}); err != nil {
			done <- err
			return
		}
		done <- fn(s)
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("libvirtfake: call abandoned: %w", ctx.Err())
	}
}

// Dedicated opens a new session (the hook "Dedicated" runs first and may
// fail it). ctx only bounds the opening. The caller closes the session.
func (h *Host) Dedicated(ctx context.Context) (*Session, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := h.enter(Call{Method: "Dedicated"}); err != nil {
		return nil, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil, ErrHostClosed
	}
	return h.newSessionLocked(true), nil
}

// OpenSessions returns how many dedicated sessions are open (neither
// closed nor killed).
func (h *Host) OpenSessions() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for s := range h.sessions {
		if s.dedicated {
			n++
		}
	}
	return n
}

// Close kills every session (ending every blocked call) and waits for the
// goroutines Do started. Later Do and Dedicated calls fail with
// ErrHostClosed. The state stays readable.
func (h *Host) Close() error {
	h.mu.Lock()
	h.closed = true
	ss := slices.Collect(func(yield func(*Session) bool) {
		for s := range h.sessions {
			if !yield(s) {
				return
			}
		}
	})
	h.mu.Unlock()
	for _, s := range ss {
		s.Kill()
	}
	h.wg.Wait()
	return nil
}

func (h *Host) uuidLocked() libvirt.UUID {
	h.seq++
	var u libvirt.UUID
	for i := range 8 {
		u[15-i] = byte(h.seq >> (8 * i))
	}
	u[6] = 0x40 | u[6]&0x0f // version 4 shape
	u[8] = 0x80 | u[8]&0x3f
	return u
}

func uuidString(u libvirt.UUID) string {
	return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

// lverr is an error as go-libvirt returns libvirtd's answer.
func lverr(code libvirt.ErrorNumber, format string, args ...any) error {
	return libvirt.Error{Code: uint32(code), Message: fmt.Sprintf(format, args...)}
}
