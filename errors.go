package egressproxy

import (
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
)

// ErrorCode is the class of an error: what a caller can do about it. Every
// error the library returns has exactly one, read with Code; for
// Transient, Permanent and NotFound, errors.Is with the class sentinel
// agrees (errors.Is(err, ErrNotFound) exactly when Code(err) is NotFound).
type ErrorCode = errs.ErrorCode

// The error classes.
const (
	// OK is the code of a nil error.
	OK = errs.OK
	// Unknown is the code of an error that carries no class. The library
	// never returns one: the Client classes such an error of a provider
	// Transient.
	Unknown = errs.Unknown
	// Transient: retrying the same call later may succeed (link down,
	// daemon restarting, a race another call resolves). See ErrTransient.
	Transient = errs.Transient
	// Permanent: retrying the same input cannot succeed; a person or a new
	// input must act (invalid spec, credentials refused, digest mismatch).
	// See ErrPermanent.
	Permanent = errs.Permanent
	// NotFound: the instance (or image base) does not exist. See
	// ErrNotFound.
	NotFound = errs.NotFound
	// Canceled: the caller's context was canceled.
	Canceled = errs.Canceled
	// DeadlineExceeded: the caller's context deadline passed.
	DeadlineExceeded = errs.DeadlineExceeded
)

// Code returns the class of err: OK for nil; the class the library gave it;
// Canceled or DeadlineExceeded for a context error without a class;
// Unknown otherwise. An explicit class wraps and hides any class inside it,
// so an error has one class however deep it is wrapped.
func Code(err error) ErrorCode { return errs.Code(err) }

// The class sentinels, matched with errors.Is, and the sentinels of three
// specific failures, which carry their class (errors.Is(ErrClosed,
// ErrPermanent) holds, and so does Code(ErrClosed) == Permanent).
var (
	// ErrTransient matches every error of class Transient.
	ErrTransient = errs.ErrTransient
	// ErrPermanent matches every error of class Permanent.
	ErrPermanent = errs.ErrPermanent
	// ErrNotFound matches every error of class NotFound.
	ErrNotFound = errs.ErrNotFound
	// ErrClosed: the call was made after Close. Permanent.
	ErrClosed = errs.ErrClosed
	// ErrSpecConflict: Create found the instance's Name and UID created from
	// another spec (Instance.SpecDigest differs from Spec.Digest). The
	// instance is left as it is; Delete it and Create it again to apply the
	// new spec. Permanent.
	ErrSpecConflict = errs.ErrSpecConflict
	// ErrNotSupported: the call needs a capability the provider does not
	// have (such as image management). Permanent.
	ErrNotSupported = errs.ErrNotSupported
)

// FieldError is one rule broken by one field of an input. Field names the
// field as the caller wrote it: the Go field for a Go value ("Name",
// "Probe.Timeout"), the key path for a file ("entries[2].images.deb.sha256").
// Value is the offending value as given; Rule says what it must be; Line
// is the line of the file the field is on, where the format gives one
// (zero otherwise). Its text is
//
//	line <Line>: invalid <Field> <quoted Value>: <Rule>
//
// with the value escaped and bounded (no line when Line is zero). A validation error reports every
// broken rule at once: FieldErrors lists them, errors.As finds the first.
// Validation errors are Permanent.
type FieldError = errs.FieldError

// FieldErrors returns every *FieldError in err's tree, in order; nil when
// there is none.
func FieldErrors(err error) []*FieldError { return errs.FieldErrors(err) }

// DefaultPort is the proxy port of a Spec whose Port is zero.
const DefaultPort = naming.DefaultPort
