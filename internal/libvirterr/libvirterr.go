package libvirterr

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"syscall"

	libvirt "github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/budget"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/sshconn"
)

// Verdict is what the table says of one error.
type Verdict struct {
	// Code is the error's class.
	Code errs.ErrorCode
	// Reason is the health reason Check reports for a failure of this kind
	// (ReasonUnknown when the failure says nothing specific).
	Reason egressproxy.HealthReason
	// Missing: libvirt said the object does not exist (Code NotFound).
	Missing bool
	// Closed: the link was closed by its owner (Code Permanent); the error
	// is made to match errs.ErrClosed by Classify.
	Closed bool
	// Entry: the fault is the entry's own, not an answer about the object
	// a call names: its credentials, its host's key, its rights on the
	// host, its pool or its link. Its Code holds on every operation
	// (ClassifyRead keeps it).
	Entry bool
}

// Entry is one row of the libvirt-number table.
type Entry struct {
	Code   errs.ErrorCode
	Reason egressproxy.HealthReason
}

// Table maps the libvirt error numbers that are not Transient (and the
// Transient ones that name a health reason) to their class. Every other
// number is Transient with ReasonUnknown: internal and system errors, RPC
// failures, timeouts, busy resources, agent failures. A row with a health
// reason is a fault of the entry (Verdict.Entry): its rights, its pool,
// its link.
var Table = map[libvirt.ErrorNumber]Entry{
	// The object the call names does not exist.
	libvirt.ErrNoDomain:         {errs.NotFound, egressproxy.ReasonUnknown},
	libvirt.ErrNoStorageVol:     {errs.NotFound, egressproxy.ReasonUnknown},
	libvirt.ErrNoDomainMetadata: {errs.NotFound, egressproxy.ReasonUnknown},

	// The entry's configuration is wrong: a human must act.
	libvirt.ErrNoStoragePool: {errs.Permanent, egressproxy.ReasonPoolNotFound},
	libvirt.ErrNoNetwork:     {errs.Permanent, egressproxy.ReasonUnknown},

	// Refused for lack of rights.
	libvirt.ErrAccessDenied:    {errs.Permanent, egressproxy.ReasonForbidden},
	libvirt.ErrAuthFailed:      {errs.Permanent, egressproxy.ReasonForbidden},
	libvirt.ErrAuthUnavailable: {errs.Permanent, egressproxy.ReasonForbidden},
	libvirt.ErrAuthCancelled:   {errs.Permanent, egressproxy.ReasonForbidden},
	libvirt.ErrOperationDenied: {errs.Permanent, egressproxy.ReasonForbidden},

	// The request itself cannot succeed as made.
	libvirt.ErrInvalidArg:           {errs.Permanent, egressproxy.ReasonUnknown},
	libvirt.ErrNoSupport:            {errs.Permanent, egressproxy.ReasonUnknown},
	libvirt.ErrOperationInvalid:     {errs.Permanent, egressproxy.ReasonUnknown},
	libvirt.ErrOperationUnsupported: {errs.Permanent, egressproxy.ReasonUnknown},
	libvirt.ErrArgumentUnsupported:  {errs.Permanent, egressproxy.ReasonUnknown},
	libvirt.ErrConfigUnsupported:    {errs.Permanent, egressproxy.ReasonUnknown},
	libvirt.ErrXMLError:             {errs.Permanent, egressproxy.ReasonUnknown},
	libvirt.ErrXMLDetail:            {errs.Permanent, egressproxy.ReasonUnknown},
	libvirt.ErrXMLInvalidSchema:     {errs.Permanent, egressproxy.ReasonUnknown},
	libvirt.ErrDomExist:             {errs.Permanent, egressproxy.ReasonUnknown},
	libvirt.ErrStorageVolExist:      {errs.Permanent, egressproxy.ReasonUnknown},
	libvirt.ErrInvalidStoragePool:   {errs.Permanent, egressproxy.ReasonUnknown},
	libvirt.ErrInvalidStorageVol:    {errs.Permanent, egressproxy.ReasonUnknown},
	libvirt.ErrInvalidDomain:        {errs.Permanent, egressproxy.ReasonUnknown},
	libvirt.ErrInvalidMac:           {errs.Permanent, egressproxy.ReasonUnknown},
	libvirt.ErrCPUIncompatible:      {errs.Permanent, egressproxy.ReasonUnknown},
	libvirt.ErrNoKernel:             {errs.Permanent, egressproxy.ReasonUnknown},

	// Transient, but the link to libvirtd is what failed.
	libvirt.ErrNoConnect:   {errs.Transient, egressproxy.ReasonUnreachable},
	libvirt.ErrInvalidConn: {errs.Transient, egressproxy.ReasonUnreachable},
	libvirt.ErrRPC:         {errs.Transient, egressproxy.ReasonUnreachable},
}

// ErrPoolInactive marks a storage pool that exists but does not run (wrap
// it with %w); Of classes it Permanent with ReasonPoolNotActive.
var ErrPoolInactive = errors.New("storage pool is not active")

// Number returns the libvirt error number inside err, if any.
func Number(err error) (libvirt.ErrorNumber, bool) {
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

// Is reports whether err carries one of the libvirt numbers.
func Is(err error, numbers ...libvirt.ErrorNumber) bool {
	n, ok := Number(err)
	if !ok {
		return false
	}
	for _, want := range numbers {
		if n == want {
			return true
		}
	}
	return false
}

// LinkDead reports whether err says the connection to libvirtd (or the SSH
// link under it) is gone.
func LinkDead(err error) bool {
	var se *sshconn.Error
	if errors.As(err, &se) && se.Kind == sshconn.KindUnreachable {
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

// PoolInactive reports whether err says a storage pool is stopped: the
// ErrPoolInactive marker, or libvirt's VIR_ERR_OPERATION_INVALID "storage
// pool '…' is not active" (the same number also means passing states such
// as "has asynchronous jobs running", which PoolBusy reports).
func PoolInactive(err error) bool {
	if errors.Is(err, ErrPoolInactive) {
		return true
	}
	var le libvirt.Error
	return errors.As(err, &le) && le.Code == uint32(libvirt.ErrOperationInvalid) &&
		strings.Contains(le.Message, "storage pool") && strings.HasSuffix(strings.TrimSpace(le.Message), "is not active")
}

// busy reports libvirt's VIR_ERR_OPERATION_INVALID for a passing state of
// an object ("has asynchronous jobs running"): Transient, not Permanent.
func busy(err error) bool {
	var le libvirt.Error
	return errors.As(err, &le) && le.Code == uint32(libvirt.ErrOperationInvalid) &&
		strings.Contains(le.Message, "asynchronous jobs running")
}

// PoolBusy reports whether err says a storage pool has asynchronous jobs
// running (a volume is being built in it, e.g. an overlay being created):
// libvirt refuses a pool refresh (VIR_ERR_INTERNAL_ERROR) or a pool
// operation (VIR_ERR_OPERATION_INVALID) until they end. The pool itself is
// running and usable; the state passes.
func PoolBusy(err error) bool {
	var le libvirt.Error
	return errors.As(err, &le) &&
		(le.Code == uint32(libvirt.ErrInternalError) || le.Code == uint32(libvirt.ErrOperationInvalid)) &&
		strings.Contains(le.Message, "asynchronous jobs running")
}

// sshKinds are the verdicts of sshconn's kinds: every one is a fault of
// the entry's link.
var sshKinds = map[sshconn.Kind]Verdict{
	sshconn.KindUnreachable:     {Code: errs.Transient, Reason: egressproxy.ReasonUnreachable, Entry: true},
	sshconn.KindClosed:          {Code: errs.Permanent, Reason: egressproxy.ReasonUnknown, Closed: true, Entry: true},
	sshconn.KindConfig:          {Code: errs.Permanent, Reason: egressproxy.ReasonUnknown, Entry: true},
	sshconn.KindKeyUnreadable:   {Code: errs.Permanent, Reason: egressproxy.ReasonCredentialsUnavailable, Entry: true},
	sshconn.KindAuthRefused:     {Code: errs.Permanent, Reason: egressproxy.ReasonUnauthorized, Entry: true},
	sshconn.KindHostUnknown:     {Code: errs.Permanent, Reason: egressproxy.ReasonHostKeyUnknown, Entry: true},
	sshconn.KindHostKeyMismatch: {Code: errs.Permanent, Reason: egressproxy.ReasonHostKeyMismatch, Entry: true},
	sshconn.KindForbidden:       {Code: errs.Transient, Reason: egressproxy.ReasonForbidden, Entry: true},
}

// Classed reports whether err already carries an explicit class: a
// *errs.Error anywhere in its chain, or a class sentinel
// (errs.ErrNotFound, …) wrapped bare. Such an error keeps its class.
func Classed(err error) bool {
	var pe *errs.Error
	if errors.As(err, &pe) {
		return true
	}
	switch errs.Code(err) {
	case errs.Transient, errs.Permanent, errs.NotFound:
		return true
	}
	return false
}

// Of returns the verdict of err (see the package doc for the order).
func Of(err error) Verdict {
	if err == nil {
		return Verdict{Code: errs.OK, Reason: egressproxy.ReasonNone}
	}
	v := inferred(err)
	if Classed(err) {
		v.Code = errs.Code(err)
		v.Missing = v.Code == errs.NotFound
	}
	return v
}

// inferred is the verdict from what err says, ignoring explicit classes
// (the reason of an explicitly classed error is still read from its cause).
func inferred(err error) Verdict {
	switch {
	case errors.Is(err, context.Canceled):
		return Verdict{Code: errs.Canceled, Reason: egressproxy.ReasonUnknown}
	case errors.Is(err, context.DeadlineExceeded):
		return Verdict{Code: errs.DeadlineExceeded, Reason: egressproxy.ReasonUnknown}
	}
	var se *sshconn.Error
	if errors.As(err, &se) {
		if v, ok := sshKinds[se.Kind]; ok {
			return v
		}
	}
	if errors.As(err, new(*budget.TimeoutError)) {
		return Verdict{Code: errs.Transient, Reason: egressproxy.ReasonUnreachable, Entry: true}
	}
	if LinkDead(err) {
		return Verdict{Code: errs.Transient, Reason: egressproxy.ReasonUnreachable, Entry: true}
	}
	if PoolInactive(err) {
		return Verdict{Code: errs.Permanent, Reason: egressproxy.ReasonPoolNotActive, Entry: true}
	}
	if n, ok := Number(err); ok {
		if busy(err) {
			return Verdict{Code: errs.Transient, Reason: egressproxy.ReasonUnknown}
		}
		if e, ok := Table[n]; ok {
			return Verdict{Code: e.Code, Reason: e.Reason, Missing: e.Code == errs.NotFound, Entry: e.Reason != egressproxy.ReasonUnknown}
		}
		return Verdict{Code: errs.Transient, Reason: egressproxy.ReasonUnknown}
	}
	if errors.Is(err, libvirt.ErrUnsupported) {
		return Verdict{Code: errs.Permanent, Reason: egressproxy.ReasonUnknown}
	}
	return Verdict{Code: errs.Transient, Reason: egressproxy.ReasonUnknown}
}

// Classify returns err with its class (Of(err).Code); an error that already
// carries a class is returned unchanged, nil stays nil. A closed link also
// matches errs.ErrClosed.
func Classify(err error) error {
	if err == nil {
		return nil
	}
	if Classed(err) {
		return err
	}
	v := Of(err)
	if v.Closed {
		err = ClosedError{Err: err}
	}
	return errs.WithCode(v.Code, err)
}

// ClassifyRead classifies an error of a read (state, address, metadata) of
// an object that exists: like Classify, but a Permanent libvirt answer
// about that object becomes Transient, so a read that fails (for example
// because the link died half-way and libvirt answered "invalid argument")
// never latches a healthy instance as failed. A fault of the entry
// (Verdict.Entry: credentials, host key, rights, pool, a closed link)
// keeps its class, as on every other operation, so that a caller whose
// status comes from reads sees what a human must fix. Explicit classes,
// NotFound and context codes are kept.
func ClassifyRead(err error) error {
	if err == nil {
		return nil
	}
	if Classed(err) {
		return err
	}
	if v := Of(err); v.Code == errs.Permanent && !v.Entry {
		return errs.WithCode(errs.Transient, err)
	}
	return Classify(err)
}

// Reason is the health reason of a failed check (Of(err).Reason; nil is
// ReasonNone).
func Reason(err error) egressproxy.HealthReason { return Of(err).Reason }

// ClosedError makes an sshconn "closed" error match errs.ErrClosed.
type ClosedError struct{ Err error }

func (e ClosedError) Error() string { return e.Err.Error() }
func (e ClosedError) Unwrap() error { return e.Err }

// Is matches errs.ErrClosed.
func (e ClosedError) Is(target error) bool {
	return target == errs.ErrClosed
}
