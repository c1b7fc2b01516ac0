package provider

import (
	"context"
	"errors"
	"fmt"
)

// Class sentinels, checked with errors.Is. Every error a Provider returns
// carries at most one class; Code reports it.
var (
	// ErrTransient: the operation failed for a reason that may go away
	// (link down, daemon restarting, resource busy). Retrying later with
	// the same input is safe and may succeed.
	ErrTransient = &classError{code: Transient, msg: "transient"}
	// ErrPermanent: retrying the same input cannot succeed; a human (or a
	// changed input) must act. Examples: invalid spec, access denied,
	// digest mismatch of a cached image.
	ErrPermanent = &classError{code: Permanent, msg: "permanent"}
	// ErrNotFound: the instance (or object) does not exist.
	ErrNotFound = &classError{code: NotFound, msg: "not found"}
	// ErrClosed is returned (classed Permanent) by calls made after Close.
	ErrClosed = errors.New("provider closed")
	// ErrSpecConflict is returned (classed Permanent) by Create when an
	// instance with the spec's Name and UID exists but was created from
	// another spec: the Spec.Digest the backend recorded for it differs
	// from the digest of the spec given now (another Port, UserData,
	// ImageKey or MachineType). The existing instance is left as it is;
	// to apply the new spec, Delete the instance and Create it again (or
	// create it under a new UID). Instances for which the backend has no
	// recorded digest (Instance.SpecDigest empty) are never reported.
	ErrSpecConflict = errors.New("instance exists with another spec")
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

type classError struct {
	code ErrorCode
	msg  string
}

func (e *classError) Error() string { return e.msg }

// Error is an error with an explicit class. Create one with WithCode or
// Errorf. errors.Is(err, ErrTransient|ErrPermanent|ErrNotFound) reports the
// class of the outermost *Error in the chain only: an explicit class wins over
// anything inside it.
type Error struct {
	Code ErrorCode
	Err  error
}

func (e *Error) Error() string {
	if e.Err == nil {
		return e.Code.String()
	}
	return e.Err.Error()
}

// Unwrap returns the cause. Class sentinels of inner errors are hidden
// behind it, so the outer class is the only one errors.Is sees.
func (e *Error) Unwrap() error { return e.Err }

// Is matches the class sentinel of e's code.
func (e *Error) Is(target error) bool {
	if c, ok := target.(*classError); ok {
		return c.code == e.Code
	}
	return false
}

// WithCode returns err classed as code. A nil err returns nil. If err
// already carries a class, the new, outer class wins for Code and errors.Is.
// Context errors keep matching context.Canceled / DeadlineExceeded with
// errors.Is.
func WithCode(code ErrorCode, err error) error {
	if err == nil {
		return nil
	}
	var inner *Error
	if errors.As(err, &inner) {
		if inner.Code == code {
			return err
		}
		err = hideClass{err}
	}
	return &Error{Code: code, Err: err}
}

// Errorf formats an error (fmt.Errorf rules, %w allowed) and classes it.
func Errorf(code ErrorCode, format string, args ...any) error {
	return WithCode(code, fmt.Errorf(format, args...))
}

// hideClass wraps an already classed error so that its class no longer
// matches, while every other errors.Is/As target still does.
type hideClass struct{ err error }

func (h hideClass) Error() string { return h.err.Error() }

func (h hideClass) Is(target error) bool {
	if _, ok := target.(*classError); ok {
		return false
	}
	return errors.Is(h.err, target)
}

func (h hideClass) As(target any) bool {
	if _, ok := target.(**Error); ok {
		return false
	}
	return errors.As(h.err, target)
}

// Code returns the class of err:
//   - OK for nil;
//   - the code of the outermost *Error in the chain (explicit class wins);
//   - Canceled / DeadlineExceeded for context errors without explicit class;
//   - Unknown otherwise.
func Code(err error) ErrorCode {
	if err == nil {
		return OK
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Code
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
