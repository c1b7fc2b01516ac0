package kvm2

import (
	"errors"

	libvirt "github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/libvirterr"
	"github.com/egressproxy/egressproxy/sshconn"
)

// The classification of libvirt and link errors is one table shared with
// imagecache (internal/libvirterr); these names keep kvm2's call sites short.

// isLibvirtCode reports whether err carries one of the libvirt codes.
func isLibvirtCode(err error, codes ...libvirt.ErrorNumber) bool {
	return libvirterr.Is(err, codes...)
}

// sshKind is the kind of the *sshconn.Error in err's chain (the SSH link's
// and the libvirt session's failures), or KindUnknown.
func sshKind(err error) sshconn.Kind {
	var se *sshconn.Error
	if errors.As(err, &se) {
		return se.Kind
	}
	return sshconn.KindUnknown
}

// linkDead reports whether err says the connection to libvirtd (or the SSH
// link under it) is gone. Such an error is Transient whatever libvirt code
// may also appear in it.
func linkDead(err error) bool { return libvirterr.LinkDead(err) }

// classify gives err one class (errs.Code) from the shared table (see
// internal/libvirterr for the rules): an explicit class wins; context errors
// are Canceled / DeadlineExceeded; sshconn's kinds, a dead link, a stopped or
// missing pool and libvirt's error numbers map as the table says; anything
// else is Transient. A libvirt "no such object" is NotFound: kvm2's calls
// name the object (the instance's domain or volumes), and the calls for
// which a missing object is success (Delete) check for it before.
//
// Reads that must not latch a healthy instance as failed use classifyRead.
func classify(err error) error { return libvirterr.Classify(err) }

// classifyRead classifies an error of a read (state, address, metadata) of
// an instance that exists: like classify, but a Permanent libvirt answer
// about the instance becomes Transient, so a read that fails (for example
// because the link died half-way and libvirt answered "invalid argument")
// never latches a healthy instance as failed. A fault of the entry itself
// (credentials, host key, rights, pool, a closed link) keeps the class it
// has on every other operation. Explicit classes, NotFound and context
// codes are kept.
func classifyRead(err error) error { return libvirterr.ClassifyRead(err) }

// healthReason maps a failed check to its reason (the shared table's).
func healthReason(err error) egressproxy.HealthReason { return libvirterr.Reason(err) }

// closedError makes an sshconn "closed" error match errs.ErrClosed.
type closedError = libvirterr.ClosedError
