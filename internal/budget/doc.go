// Package budget bounds a context by one of the module's own time budgets
// (sshconn's DialTimeout, a libvirt session's or kvm2's CallTimeout) and
// tells, once the context has ended, whether that budget or the caller
// ended it; and Wait bounds how long a Close waits for its goroutines.
//
// A budget that runs out is a *TimeoutError, which does not match
// context.DeadlineExceeded: that is kept for the caller's own deadline, so
// a caller without one never sees "deadline exceeded" (errs.DeadlineExceeded
// means the caller's context deadline passed).
package budget
