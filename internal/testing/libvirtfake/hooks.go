package libvirtfake

import (
	"slices"
	"sync"
)

// DefaultChunk is the default stream chunk size (SetChunkSize).
const DefaultChunk = 64 << 10

// Call describes one call, for hooks and the call log.
type Call struct {
	// Method is the go-libvirt method name ("StorageVolUpload"), or "Do"
	// and "Dedicated" for the Host's own entry points.
	Method string
	// Session is the session the call runs on (nil for "Dedicated").
	Session *Session
	// Domain, Pool and Volume name what the call is about, when it has
	// them (a volume call names its pool too).
	Domain, Pool, Volume string
	// Args holds the other arguments where a test checks them:
	// ConnectGetDomainCapabilities's emulator, arch, machine, virttype
	// and flags.
	Args string
	// After is set when the hook runs as a reply hook (SetReplyHook):
	// the call took effect.
	After bool
	// Done is, for a stream hook, the bytes moved so far by this call.
	// An upload moves what one Read of its source returns (at most the
	// chunk size), so Done need not be a multiple of it.
	Done int64
}

// Name is the name the call is about: its domain, else its volume, else
// its pool ("" for a call about the connection).
func (c Call) Name() string {
	switch {
	case c.Domain != "":
		return c.Domain
	case c.Volume != "":
		return c.Volume
	}
	return c.Pool
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

// Hook runs before a call takes effect (SetHook), after it took effect
// (SetReplyHook) or before a stream moves its next chunk (SetStreamHook).
// A non-nil error is returned by the call as it is; nil lets it go on.
type Hook func(Call) error

// entryPoint reports whether method is one of the Host's entry points
// rather than a libvirt call.
func entryPoint(method string) bool { return method == "Do" || method == "Dedicated" }

// SetHook makes fn run before every call of method takes effect (nil:
// none), replacing the previous hook of method. Method "" hooks every
// libvirt call (not Do or Dedicated); that hook runs before the method's
// own.
func (h *Host) SetHook(method string, fn Hook) { h.setHook(h.hooks, method, fn) }

// SetReplyHook makes fn run after every call of method took effect, with
// Call.After set (nil: none), replacing the previous reply hook of method.
// An error is the call's while its effect stays, as when the reply is
// lost. Method "" is every libvirt call, as for SetHook.
func (h *Host) SetReplyHook(method string, fn Hook) { h.setHook(h.replies, method, fn) }

// SetStreamHook makes fn run before each chunk of the stream call method
// ("StorageVolUpload", "StorageVolDownload"), with Call.Done the bytes
// moved so far (nil: none). An error cuts the stream: the call returns it.
// Blocking (Call.Wait) stalls the stream.
func (h *Host) SetStreamHook(method string, fn Hook) { h.setHook(h.streams, method, fn) }

func (h *Host) setHook(m map[string]Hook, method string, fn Hook) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if fn == nil {
		delete(m, method)
		return
	}
	m[method] = fn
}

// ClearHooks removes every hook, stream hooks included.
func (h *Host) ClearHooks() {
	h.mu.Lock()
	defer h.mu.Unlock()
	clear(h.hooks)
	clear(h.replies)
	clear(h.streams)
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
// included), on any session; method "" counts every libvirt call (not Do
// or Dedicated).
func (h *Host) Calls(method string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	if method == "" {
		return len(h.log)
	}
	return h.counts[method]
}

// Log returns the libvirt calls (not Do or Dedicated) in the order they
// were made, each as its hooks saw it before it took effect.
func (h *Host) Log() []Call {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.log)
}

// ResetCalls forgets the calls made so far (Calls and Log start again).
func (h *Host) ResetCalls() {
	h.mu.Lock()
	defer h.mu.Unlock()
	clear(h.counts)
	h.log = nil
}

// enter logs a call, refuses it on a dead session and runs its hooks.
func (h *Host) enter(c Call) error {
	h.mu.Lock()
	h.counts[c.Method]++
	var all Hook
	if !entryPoint(c.Method) {
		h.log = append(h.log, c)
		all = h.hooks[""]
	}
	fn := h.hooks[c.Method]
	h.mu.Unlock()
	if c.Session != nil && c.Session.isDead() {
		return ErrKilled
	}
	for _, hook := range []Hook{all, fn} {
		if hook == nil {
			continue
		}
		if err := hook(c); err != nil {
			return err
		}
	}
	if c.Session != nil && c.Session.isDead() {
		return ErrKilled
	}
	return nil
}

// reply runs the reply hooks of a call that took effect.
func (h *Host) reply(c Call) error {
	c.After = true
	h.mu.Lock()
	all, fn := h.replies[""], h.replies[c.Method]
	h.mu.Unlock()
	for _, hook := range []Hook{all, fn} {
		if hook == nil {
			continue
		}
		if err := hook(c); err != nil {
			return err
		}
	}
	return nil
}

// run makes call c on s: its hooks, fn (the effect) when they let it go
// on, and the reply hooks when fn succeeded.
func (s *Session) run(c Call, fn func() error) error {
	c.Session = s
	if err := s.h.enter(c); err != nil {
		return err
	}
	if err := fn(); err != nil {
		return err
	}
	return s.h.reply(c)
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

// Fail returns a hook that fails every call with err.
func Fail(err error) Hook { return func(Call) error { return err } }

// FailFirst returns a hook that fails the first n calls with err.
func FailFirst(n int, err error) Hook {
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

// FailNth returns a hook that fails the n-th call it sees (from 1) with
// err, and no other.
func FailNth(n int, err error) Hook {
	var mu sync.Mutex
	seen := 0
	return func(Call) error {
		mu.Lock()
		defer mu.Unlock()
		seen++
		if seen == n {
			return err
		}
		return nil
	}
}

// Named returns a hook that runs fn for the calls about name (Call.Name)
// and lets every other call go on.
func Named(name string, fn Hook) Hook {
	return func(c Call) error {
		if c.Name() != name {
			return nil
		}
		return fn(c)
	}
}

// Chain returns a hook that runs hooks in order (nil ones skipped); the
// first error ends it and is the call's.
func Chain(hooks ...Hook) Hook {
	return func(c Call) error {
		for _, fn := range hooks {
			if fn == nil {
				continue
			}
			if err := fn(c); err != nil {
				return err
			}
		}
		return nil
	}
}

// Block returns a hook that blocks each call until release is closed or
// its session dies (then the call fails with ErrKilled).
func Block(release <-chan struct{}) Hook { return func(c Call) error { return c.Wait(release) } }

// Pause holds the first call its Hook sees until Release, or until that
// call's session dies (then the call fails with ErrKilled); later calls go
// on. Entered is closed when the first call arrives.
type Pause struct {
	entered, release chan struct{}
	first, open      sync.Once
}

// NewPause returns a Pause that holds nothing yet.
func NewPause() *Pause {
	return &Pause{entered: make(chan struct{}), release: make(chan struct{})}
}

// Hook is the Pause's hook, for SetHook.
func (p *Pause) Hook(c Call) error {
	held := false
	p.first.Do(func() { held = true; close(p.entered) })
	if !held {
		return nil
	}
	return c.Wait(p.release)
}

// Entered is closed when the held call arrives.
func (p *Pause) Entered() <-chan struct{} { return p.entered }

// Release lets the held call (and any later one) go on. Calling it again
// is allowed.
func (p *Pause) Release() { p.open.Do(func() { close(p.release) }) }

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
