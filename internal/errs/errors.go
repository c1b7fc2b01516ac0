package errs

import (
	"context"
	"errors"
	"fmt"
)

// Class sentinels, checked with errors.Is. Every error a Provider returns
// carries exactly one class; Code reports it, and errors.Is agrees: for every
// error err and class c in Transient, Permanent and NotFound, Code(err) == c
// exactly when errors.Is(err, sentinel of c), and no other class sentinel
// matches. The sentinels are themselves classed: Code(ErrNotFound) is
// NotFound, and an error that wraps one (fmt.Errorf("...: %w",
// ErrNotFound)) has its class.
var (
	// ErrTransient: the operation failed for a reason that may go away
	// (link down, daemon restarting, resource busy). Retrying later with
	// the same input is safe and may succeed.
	ErrTransient error = &classError{code: Transient, msg: "transient"}
	// ErrPermanent: retrying the same input cannot succeed; a human (or a
	// changed input) must act. Examples: invalid spec, access denied,
	// digest mismatch of a cached image.
	ErrPermanent error = &classError{code: Permanent, msg: "permanent"}
	// ErrNotFound: the instance (or object) does not exist.
	ErrNotFound error = &classError{code: NotFound, msg: "not found"}
	// ErrClosed is returned by calls made after Close. It is classed
	// Permanent: Code(ErrClosed) is Permanent and errors.Is(ErrClosed,
	// ErrPermanent) holds, as for every error that wraps it (unless an
	// outer WithCode gives it another class).
	ErrClosed error = &classError{code: Permanent, msg: "provider closed"}
	// ErrSpecConflict is returned (classed Permanent, like ErrClosed) by
	// Create when an
	// instance with the spec's Name and UID exists but was created from
	// another spec: the Spec.Digest the backend recorded for it differs
	// from the digest of the spec given now (another Port, UserData,
	// ImageKey or MachineType). The existing instance is left as it is;
	// to apply the new spec, Delete the instance and Create it again (or
	// create it under a new UID). Instances for which the backend has no
	// recorded digest (Instance.SpecDigest empty) are never reported.
	ErrSpecConflict error = &classError{code: Permanent, msg: "instance exists with another spec"}
	// ErrNotSupported (classed Permanent, like ErrClosed) is returned for a
	// call that needs an optional interface (such as ImageManager) the
	// provider does not implement.
	ErrNotSupported error = &classError{code: Permanent, msg: "not supported by this provider"}
)

// ErrorCode is the fixed set of error classes.
type ErrorCode int

const (
	// OK is the code of a nil error.
	OK ErrorCode = iota
	// Unknown: an error that carries no class. Providers must not return
	// such errors; treat as Transient when in doubt.
	Unknown
	// Transient: see ErrTransient.
	Transient
	// Permanent: see ErrPermanent.
	Permanent
	// NotFound: see ErrNotFound.
	NotFound
	// Canceled: the caller's context was canceled.
	Canceled
	// DeadlineExceeded: the caller's context deadline passed.
	DeadlineExceeded
)

var codeNames = [...]string{"OK", "Unknown", "Transient", "Permanent", "NotFound", "Canceled", "DeadlineExceeded"}

func (c ErrorCode) String() string {
	if c >= 0 && int(c) < len(codeNames) {
		return codeNames[c]
	}
	return fmt.Sprintf("ErrorCode(%d)", int(c))
}

// classed is what carries a class in an error tree: an *Error or a classed
// sentinel (*classError). Code finds the first one with errors.As.
type classed interface {
	error
	class() ErrorCode
}

// classError is a classed sentinel: one of the three class sentinels, or an
// identity sentinel (ErrClosed, ErrSpecConflict) that carries a class.
type classError struct {
	code ErrorCode
	msg  string
}

func (e *classError) Error() string    { return e.msg }
func (e *classError) class() ErrorCode { return e.code }

// Is makes an identity sentinel match the class sentinel of its class
// (errors.Is(ErrClosed, ErrPermanent)); a class sentinel matches only itself
// (errors.Is does that before calling Is).
func (e *classError) Is(target error) bool {
	return target != error(e) && isClassSentinel(target) && sentinelCode(target) == e.code
}

// isClassSentinel reports whether target is ErrTransient, ErrPermanent or
// ErrNotFound.
func isClassSentinel(target error) bool {
	return target == ErrTransient || target == ErrPermanent || target == ErrNotFound
}

func sentinelCode(target error) ErrorCode {
	if c, ok := target.(*classError); ok {
		return c.code
	}
	return Unknown
}

// Error is an error with an explicit class. Create one with WithCode or
// Errorf, which hide every class inside the error they wrap, so the outer
// class is the only one errors.Is and Code see. (An *Error built as a
// literal around an already classed error does not hide the inner class;
// Code then reports the outer one, by the traversal-order rule of Code.)
//
// Error returns the wrapped error's text, made valid UTF-8 and clipped to
// MaxErrorText bytes (ClipMessage).
type Error struct {
	Code ErrorCode
	Err  error
}

func (e *Error) Error() string {
	if e.Err == nil {
		return e.Code.String()
	}
	return ClipMessage(e.Err.Error())
}

func (e *Error) class() ErrorCode { return e.Code }

// Unwrap returns the cause. Class sentinels of inner errors are hidden
// behind it when it was made by WithCode or Errorf, so the outer class is the
// only one errors.Is sees.
func (e *Error) Unwrap() error { return e.Err }

// Is matches the class sentinel of e's code; an *Error of code Canceled or
// DeadlineExceeded also matches context.Canceled or
// context.DeadlineExceeded. Identity sentinels (ErrClosed, ErrSpecConflict)
// match only when wrapped.
func (e *Error) Is(target error) bool {
	switch {
	case isClassSentinel(target):
		return sentinelCode(target) == e.Code
	case target == context.Canceled:
		return e.Code == Canceled
	case target == context.DeadlineExceeded:
		return e.Code == DeadlineExceeded
	}
	return false
}

// WithCode returns err classed as code, and as code only: every class inside
// err (an *Error, a classed sentinel such as ErrNotFound or ErrClosed) is
// hidden from Code and from errors.Is with a class sentinel, while errors.Is
// with any other target (ErrClosed, ErrSpecConflict, io.EOF, context errors)
// and errors.As keep seeing through. A nil err returns nil. A code that is not
// one of the classes (OK, or out of range) is Unknown: the result then carries
// no class sentinel. Context errors keep matching context.Canceled /
// DeadlineExceeded with errors.Is.
func WithCode(code ErrorCode, err error) error {
	if err == nil {
		return nil
	}
	if code <= OK || code > DeadlineExceeded {
		code = Unknown
	}
	if e, ok := err.(*Error); ok && e.Code == code && !hasClass(e.Err) {
		return err // already this class, and only this one
	}
	if hasClass(err) {
		err = hideClass{err}
	}
	return &Error{Code: code, Err: err}
}

// hasClass reports whether a class is visible in err's tree.
func hasClass(err error) bool {
	var c classed
	return errors.As(err, &c)
}

// Errorf formats an error (fmt.Errorf rules, %w allowed) and classes it.
func Errorf(code ErrorCode, format string, args ...any) error {
	return WithCode(code, fmt.Errorf(format, args...))
}

// hideClass wraps an already classed error so that its classes no longer
// match, while every other errors.Is/As target still does.
type hideClass struct{ err error }

func (h hideClass) Error() string { return h.err.Error() }

func (h hideClass) Is(target error) bool {
	if isClassSentinel(target) {
		return false
	}
	return errors.Is(h.err, target)
}

func (h hideClass) As(target any) bool {
	switch target.(type) {
	case **Error, **classError, *classed:
		return false
	}
	return errors.As(h.err, target)
}

// Code returns the class of err:
//   - OK for nil;
//   - the class of the first classed error in err's tree, in the order
//     errors.Is and errors.As visit it (depth first: an error before what
//     it wraps, the errors of an errors.Join or of a multi-%w fmt.Errorf
//     from left to right): an *Error (an explicit class wins over anything
//     it wraps) or a classed sentinel (ErrTransient, ErrPermanent,
//     ErrNotFound, ErrClosed, ErrSpecConflict). Classes hidden by WithCode
//     do not count;
//   - Canceled / DeadlineExceeded for context errors without a class
//     (Canceled when both are in the tree);
//   - Unknown otherwise.
//
// So errors.Is(err, sentinel of Code(err)) always holds for Transient,
// Permanent and NotFound, and an error with exactly one class matches no
// other class sentinel. An errors.Join of errors with different classes
// has the class of the first of them; give it one class with WithCode when
// that matters.
func Code(err error) ErrorCode {
	if err == nil {
		return OK
	}
	var c classed
	if errors.As(err, &c) {
		if code := c.class(); code > OK && code <= DeadlineExceeded {
			return code
		}
		return Unknown // an *Error literal with code OK or out of range
	}
	switch {
	case errors.Is(err, context.Canceled):
		return Canceled
	case errors.Is(err, context.DeadlineExceeded):
		return DeadlineExceeded
	}
	return Unknown
}

// FromContext classes a context error (ctx.Err() or context.Cause) as
// Canceled or DeadlineExceeded. Other errors are returned unchanged.
func FromContext(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, context.DeadlineExceeded):
		return WithCode(DeadlineExceeded, err)
	case errors.Is(err, context.Canceled):
		return WithCode(Canceled, err)
	}
	return err
}

// Retryable reports whether retrying the same call later can succeed:
// Transient, DeadlineExceeded and Unknown are retryable; Permanent,
// NotFound and Canceled are not, nor is a nil error.
func Retryable(err error) bool {
	switch Code(err) {
	case Transient, DeadlineExceeded, Unknown:
		return true
	}
	return false
}
