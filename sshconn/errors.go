package sshconn

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"

	"github.com/egressproxy/egressproxy/internal/errs"
)

// Kind says why an operation on the SSH transport failed, so that a caller
// (kvm2's Check, for one) can name the cause without parsing messages.
type Kind int

const (
	// KindUnknown is any error this package did not classify, including
	// the caller's cancellation (it matches context.Canceled, and its text
	// says "canceled" where the kind would be): it says nothing about the
	// server.
	KindUnknown Kind = iota
	// KindConfig is an invalid Config; nothing was touched.
	KindConfig
	// KindKeyUnreadable: the client key cannot be used (credentials
	// unavailable): the key file is missing or unreadable, the file or Key
	// bytes are not an OpenSSH/PEM private key, an encrypted key has no or a
	// wrong KeyPassphrase (or a passphrase is given for an unencrypted key),
	// or the ssh-agent cannot be reached or holds no key. It is reported
	// before sshd is contacted.
	KindKeyUnreadable
	// KindAuthRefused: the server refused our key (unauthorized).
	KindAuthRefused
	// KindHostUnknown: known_hosts pins nothing for the host: no key line
	// and no @cert-authority line matches it (this includes an empty or
	// missing known_hosts file), or only CA lines match and the host
	// presented a plain key.
	KindHostUnknown
	// KindHostKeyMismatch: known_hosts has a different key for the host, or
	// the presented key, its certificate's CA or the certified key is
	// @revoked, or the host certificate does not verify (signed by a CA not
	// trusted for the host, expired, not valid for the host name).
	KindHostKeyMismatch
	// KindUnreachable: the TCP dial or the SSH handshake failed or timed out,
	// or the connection died (keepalives unanswered, connection reset), or
	// a call on it ran out of time. Retrying later may succeed.
	KindUnreachable
	// KindForbidden: SSH is fine but the server refused to open the remote
	// unix socket channel. OpenSSH gives the same answer for a socket the
	// user may not open and for a socket that does not exist (daemon down),
	// so this kind covers both.
	KindForbidden
	// KindClosed: the Pool was used after Close.
	KindClosed
)

var kindNames = [...]string{
	KindUnknown:         "unknown",
	KindConfig:          "invalid config",
	KindKeyUnreadable:   "key unreadable",
	KindAuthRefused:     "auth refused",
	KindHostUnknown:     "host unknown",
	KindHostKeyMismatch: "host key mismatch",
	KindUnreachable:     "unreachable",
	KindForbidden:       "forbidden",
	KindClosed:          "closed",
}

// String returns a short lower-case name of the kind.
func (k Kind) String() string {
	if k >= 0 && int(k) < len(kindNames) {
		return kindNames[k]
	}
	return fmt.Sprintf("Kind(%d)", int(k))
}

// Error is the error type returned by this package for classified
// failures. Match it with errors.As and read its Kind.
type Error struct {
	Kind    Kind   // why it failed
	Address string // the sshd address (host:port), if any
	Op      string // what was being done: "dial", "ssh handshake", "open unix socket /path", ...
	Err     error  // the underlying error (may be nil)
}

// Error formats as "sshconn <address>: <op>: <kind>: <cause>". The address
// is said once: a network error in the cause (*net.OpError) is said
// without its addresses. KindForbidden adds its two possible reasons after
// the kind; an unclassified cancellation says "canceled" in place of the
// kind. The text is valid UTF-8 and at most 1 KiB, whatever the address
// or the cause.
func (e *Error) Error() string {
	s := "sshconn"
	if e.Address != "" {
		s += " " + e.Address
	}
	s += ": " + e.Op
	if e.Kind == KindUnknown && errors.Is(e.Err, context.Canceled) {
		s += ": canceled"
	} else {
		s += ": " + e.Kind.String()
	}
	if e.Kind == KindForbidden {
		// OpenSSH answers both the same way; "forbidden" alone misled
		// readers while libvirtd was merely restarting.
		s += " (the user may not open the socket, or the daemon behind it is not running)"
	}
	if e.Err != nil {
		s += ": " + causeText(e.Err)
	}
	return errs.ClipMessage(s)
}

// causeText is err's text with every *net.OpError in its chain said
// without the addresses it names ("connect: connection refused" for "dial
// tcp 127.0.0.1:1: connect: connection refused"), so that an Error says
// its address once.
func causeText(err error) string {
	s := err.Error()
	var walk func(error)
	walk = func(err error) {
		switch e := err.(type) {
		case nil:
			return
		case *net.OpError:
			if e.Err != nil {
				s = strings.Replace(s, e.Error(), e.Err.Error(), 1)
			}
			return
		case interface{ Unwrap() []error }:
			for _, inner := range e.Unwrap() {
				walk(inner)
			}
		case interface{ Unwrap() error }:
			walk(e.Unwrap())
		}
	}
	walk(err)
	return s
}

// Unwrap returns the underlying error.
func (e *Error) Unwrap() error { return e.Err }
