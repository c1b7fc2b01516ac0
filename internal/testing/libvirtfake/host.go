package libvirtfake

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"

	"github.com/digitalocean/go-libvirt"
)

// ErrKilled is returned by the calls of a killed or closed session, and by
// Call.Wait when the session dies while the hook waits. It is not a
// libvirt.Error: it stands for the connection failing, as go-libvirt's
// errors do when its socket closes.
var ErrKilled = errors.New("libvirtfake: session killed: connection closed")

// ErrHostClosed is returned by Do and Dedicated after Host.Close.
var ErrHostClosed = errors.New("libvirtfake: host closed")

// The connection's answers to ConnectGetHostname and ConnectGetLibVersion.
const (
	Hostname   = "hv1.example"
	LibVersion = 10_002_003 // libvirt 10.2.3
)

// Host is one in-memory libvirtd. The zero value is not usable: call New.
type Host struct {
	mu       sync.Mutex
	pools    map[string]*pool
	domains  map[string]*Domain
	leases   map[string]string // MAC → IP: the network's DHCP leases
	arp      map[string]string // MAC → IP: the host's ARP table
	domcaps  string
	node     Node
	hooks    map[string]Hook
	replies  map[string]Hook
	streams  map[string]Hook
	counts   map[string]int
	log      []Call
	sessions map[*Session]struct{}
	shared   *Session
	chunk    int
	seq      uint64 // UUIDs and MAC addresses
	id       uint64 // random: the UUIDs of two Hosts never collide
	ids      int32  // IDs of running domains
	closed   bool
	wg       sync.WaitGroup // Do's goroutines
}

// New returns a Host without pools, domains, hooks or domain capabilities.
func New() *Host {
	h := &Host{
		pools:    map[string]*pool{},
		domains:  map[string]*Domain{},
		leases:   map[string]string{},
		arp:      map[string]string{},
		hooks:    map[string]Hook{},
		replies:  map[string]Hook{},
		streams:  map[string]Hook{},
		counts:   map[string]int{},
		sessions: map[*Session]struct{}{},
		chunk:    DefaultChunk,
		node:     DefaultNode(),
		id:       rand.Uint64(),
	}
	h.shared = h.newSessionLocked(false)
	return h
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

// Do runs fn with the shared session in a goroutine of its own, with the
// semantics of the module's shared libvirt session: a ctx that already
// ended starts nothing; when ctx ends before fn returns, Do returns an
// error wrapping ctx's at once and fn goes on running (the caller must not
// read what fn writes unless Do returned nil); Wait and Close wait for
// such fns. The hook "Do" runs first: its error is returned without
// running fn (a failed dial, say).
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

// Wait waits until no fn that Do started runs, abandoned ones included.
// No Do may start while Wait runs.
func (h *Host) Wait() { h.wg.Wait() }

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

// Close kills every session (ending every held call) and waits for the
// goroutines Do started. Later Do and Dedicated calls fail with
// ErrHostClosed. The state stays readable. Calling it again is allowed.
func (h *Host) Close() error {
	h.mu.Lock()
	h.closed = true
	ss := slices.Collect(maps.Keys(h.sessions))
	h.mu.Unlock()
	for _, s := range ss {
		s.Kill()
	}
	h.wg.Wait()
	return nil
}

// uuidLocked is a new UUID: the Host's random id, then a sequence number,
// so that pools and domains of different Hosts (libvirtds) differ, as
// libvirt's random UUIDs do.
func (h *Host) uuidLocked() libvirt.UUID {
	h.seq++
	var u libvirt.UUID
	for i := range 8 {
		u[7-i] = byte(h.id >> (8 * i))
		u[15-i] = byte(h.seq >> (8 * i))
	}
	u[6] = 0x40 | u[6]&0x0f // version 4 shape
	u[8] = 0x80 | u[8]&0x3f
	return u
}

func uuidString(u libvirt.UUID) string {
	return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

func parseUUID(s string) (libvirt.UUID, error) {
	var u libvirt.UUID
	b, err := hex.DecodeString(strings.ReplaceAll(s, "-", ""))
	if err != nil || len(b) != len(u) {
		return u, Errorf(libvirt.ErrInternalError, "internal error: malformed uuid element")
	}
	copy(u[:], b)
	return u, nil
}

// Errorf returns an error as go-libvirt returns libvirtd's answer: a
// libvirt.Error with code and the message. Hooks return it to make a call
// fail as libvirtd would.
func Errorf(code libvirt.ErrorNumber, format string, args ...any) error {
	return libvirt.Error{Code: uint32(code), Message: fmt.Sprintf(format, args...)}
}

func sortedKeys[V any](m map[string]V) []string {
	return slices.Sorted(maps.Keys(m))
}
