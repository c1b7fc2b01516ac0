package kvm2

import (
	"context"
	"errors"
	"io"
	"net"
	"syscall"

	libvirt "github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy/provider"
	"github.com/egressproxy/egressproxy/sshconn"
)

// libvirtCode returns the libvirt error number inside err, if any.
func libvirtCode(err error) (libvirt.ErrorNumber, bool) {
	var v libvirt.Error
	if errors.As(err, &v) {
		return libvirt.ErrorNumber(v.Code), true
	}
	var p *libvirt.Error
	if errors.As(err, &p) && p != nil {
		return libvirt.ErrorNumber(p.Code), true
	}
	return 0, false
}

// isLibvirtCode reports whether err carries one of the libvirt codes.
func isLibvirtCode(err error, codes ...libvirt.ErrorNumber) bool {
	c, ok := libvirtCode(err)
	if !ok {
		return false
	}
	for _, want := range codes {
		if c == want {
			return true
		}
	}
	return false
}

// linkDead reports whether err says the connection to libvirtd (or the SSH
// link under it) is gone. Such an error is Transient whatever libvirt code
// may also appear in it.
func linkDead(err error) bool {
	if sshconn.KindOf(err) == sshconn.KindUnreachable {
		return true
	}
	switch {
	case errors.Is(err, libvirt.ErrInterrupted),
		errors.Is(err, syscall.EINVAL), // go-libvirt after the socket closed
		errors.Is(err, syscall.EPIPE),
		errors.Is(err, syscall.ECONNRESET),
		errors.Is(err, syscall.ECONNREFUSED),
		errors.Is(err, io.EOF),
		errors.Is(err, io.ErrUnexpectedEOF),
		errors.Is(err, io.ErrClosedPipe),
		errors.Is(err, net.ErrClosed):
		return true
	}
	var ne net.Error
	return errors.As(err, &ne)
}

// classify gives err one class (provider.Code), in this order:
//
//  1. nil stays nil; an error that already carries a provider class keeps it
//     (an explicit class wins over anything inferred);
//  2. context errors are Canceled / DeadlineExceeded;
//  3. sshconn kinds: unreachable (link dead) is Transient, whatever libvirt
//     code it wraps; closed and config are Permanent; key unreadable, auth
//     refused, host key unknown or mismatch are Permanent (a human must fix
//     credentials or known_hosts); forbidden is Transient (OpenSSH gives the
//     same answer when libvirtd's socket is absent, e.g. while it restarts);
//  4. a dead link seen without sshconn's help (go-libvirt's interrupted or
//     EINVAL after disconnect, EOF, closed pipe, network errors) is
//     Transient, whatever libvirt code also appears;
//  5. libvirt codes: no domain / no storage volume / no storage pool / no
//     domain metadata are NotFound; invalid argument, access denied, no
//     support, operation invalid/unsupported/denied, XML and config errors,
//     already exists are Permanent; everything else (RPC, no connect,
//     internal, system error, timeouts, busy, agent) is Transient;
//  6. anything else is Transient (a retry is the safe default).
//
// Reads that must not latch a healthy instance as failed use classifyRead.
func classify(err error) error {
	if err == nil {
		return nil
	}
	var pe *provider.Error
	if errors.As(err, &pe) {
		return err
	}
	switch {
	case errors.Is(err, context.Canceled):
		return provider.WithCode(provider.Canceled, err)
	case errors.Is(err, context.DeadlineExceeded):
		return provider.WithCode(provider.DeadlineExceeded, err)
	}
	switch sshconn.KindOf(err) {
	case sshconn.KindUnreachable:
		return provider.WithCode(provider.Transient, err)
	case sshconn.KindClosed:
		return provider.WithCode(provider.Permanent, closedError{err})
	case sshconn.KindConfig, sshconn.KindKeyUnreadable, sshconn.KindAuthRefused,
		sshconn.KindHostUnknown, sshconn.KindHostKeyMismatch:
		return provider.WithCode(provider.Permanent, err)
	case sshconn.KindForbidden:
		return provider.WithCode(provider.Transient, err)
	}
	if linkDead(err) {
		return provider.WithCode(provider.Transient, err)
	}
	if code, ok := libvirtCode(err); ok {
		switch code {
		case libvirt.ErrNoDomain, libvirt.ErrNoStorageVol, libvirt.ErrNoStoragePool, libvirt.ErrNoDomainMetadata:
			return provider.WithCode(provider.NotFound, err)
		case libvirt.ErrInvalidArg, libvirt.ErrAccessDenied, libvirt.ErrNoSupport,
			libvirt.ErrOperationInvalid, libvirt.ErrOperationUnsupported, libvirt.ErrOperationDenied,
			libvirt.ErrArgumentUnsupported, libvirt.ErrConfigUnsupported, libvirt.ErrXMLError,
			libvirt.ErrXMLDetail, libvirt.ErrXMLInvalidSchema, libvirt.ErrDomExist,
			libvirt.ErrStorageVolExist, libvirt.ErrAuthFailed, libvirt.ErrInvalidStoragePool,
			libvirt.ErrInvalidStorageVol, libvirt.ErrInvalidDomain, libvirt.ErrNoNetwork,
			libvirt.ErrInvalidMac, libvirt.ErrCPUIncompatible, libvirt.ErrNoKernel:
			return provider.WithCode(provider.Permanent, err)
		}
		return provider.WithCode(provider.Transient, err)
	}
	if errors.Is(err, libvirt.ErrUnsupported) {
		return provider.WithCode(provider.Permanent, err)
	}
	return provider.WithCode(provider.Transient, err)
}

// classifyRead classifies an error of a read (state, address, metadata) of
// an instance that exists: like classify, but a Permanent class inferred
// from a libvirt code becomes Transient, so a read that fails (for example
// because the link died half-way and libvirt answered "invalid argument")
// never latches a healthy instance as failed. Explicit classes, NotFound and
// context codes are kept.
func classifyRead(err error) error {
	if err == nil {
		return nil
	}
	var pe *provider.Error
	if errors.As(err, &pe) {
		return err
	}
	c := classify(err)
	if provider.Code(c) == provider.Permanent && sshconn.KindOf(err) != sshconn.KindClosed {
		return provider.WithCode(provider.Transient, err)
	}
	return c
}

// closedError makes an sshconn "closed" error match provider.ErrClosed.
type closedError struct{ err error }

func (e closedError) Error() string { return e.err.Error() }
func (e closedError) Unwrap() error { return e.err }
func (e closedError) Is(target error) bool {
	return target == provider.ErrClosed
}
