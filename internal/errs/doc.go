// Package errs is the error machinery of every package of the module: the
// error classes (ErrorCode, the sentinels, Code), the one way to class an
// error (Errorf, WithCode), *FieldError for bad input, and the bounds of an
// error's text (Quote, ClipMessage). Package egressproxy gives the classes
// and FieldError their public names; driver.Errorf is Errorf for backends.
//
// Every error carries exactly one class, and Code and errors.Is agree on it:
// Code(err) is Transient, Permanent or NotFound exactly when errors.Is(err,
// ErrTransient / ErrPermanent / ErrNotFound) holds, and no other class
// sentinel matches. The sentinels are classed themselves, so wrapping one
// with fmt.Errorf keeps its class. WithCode and Errorf give an error one
// class and hide every class inside it. An error without a class is Unknown
// (Canceled or DeadlineExceeded when it wraps a context error).
//
// The text of every *Error and *FieldError is valid UTF-8 of at most
// MaxErrorText bytes, whatever the input; caller input inside it is quoted
// with Quote, escaped and cut to MaxQuoted bytes.
package errs
