package controller

import (
	"errors"
	"strings"

	"github.com/egressproxy/egressproxy"
)

// Condition reasons the operator sets besides the library's own names
// (egressproxy.ErrorCode's String, egressproxy.HealthReason, egressproxy.State).
const (
	ReasonUnknownProvider    = "UnknownProvider"
	ReasonCredentialsInvalid = "CredentialsInvalid"
	ReasonProxyConfigInvalid = "ProxyConfigInvalid"
	ReasonSpecConflict       = "SpecConflict"
	ReasonRecreating         = "Recreating"
	ReasonSuperseded         = "Superseded"
	ReasonReachable          = "Reachable"
	ReasonHealthy            = "Healthy"
	ReasonNoAddress          = "NoAddress"
	ReasonPending            = "Pending"
	ReasonShuttingDown       = "ShuttingDown"
)

// Decision is what the reconciler does after a failed library call.
type Decision struct {
	// Reason is the Ready condition's reason: the error's class name.
	Reason string
	// Backoff: requeue after the object's exponential backoff.
	Backoff bool
	// Stop: the reconciler's own context ended (the manager stops); no
	// requeue, the next leader reconciles every object.
	Stop bool
	// Neither Backoff nor Stop: Permanent. The condition says why; the
	// object is retried only when it changes, or after
	// Options.PermanentRetry (no hot loop).
}

// Outcome maps a library error to the reconciler's decision by its class
// (egressproxy.Code), the table of the README:
//
//	Transient         -> Backoff
//	Unknown           -> Backoff (the client classes these Transient anyway)
//	DeadlineExceeded  -> Backoff (a call's budget ran out; retrying is safe)
//	Canceled          -> Stop
//	Permanent         -> condition, slow retry (SpecConflict has its own reason)
//	NotFound          -> condition, slow retry (the reconciler handles the
//	                     NotFound it expects, of Get and Delete, before this)
func Outcome(err error) Decision {
	code := egressproxy.Code(err)
	switch code {
	case egressproxy.Transient, egressproxy.Unknown, egressproxy.DeadlineExceeded:
		return Decision{Reason: code.String(), Backoff: true}
	case egressproxy.Canceled:
		return Decision{Reason: ReasonShuttingDown, Stop: true}
	case egressproxy.Permanent:
		if errors.Is(err, egressproxy.ErrSpecConflict) {
			return Decision{Reason: ReasonSpecConflict}
		}
	}
	return Decision{Reason: code.String()}
}

// Credentials are a proxy's basic-auth credentials (empty User: none).
type Credentials struct {
	User, Password string
}

func (c Credentials) validate() error {
	switch {
	case c.User == "" && c.Password != "":
		return errors.New(`key "password" is set without "username"`)
	case strings.ContainsAny(c.User, ":\r\n"):
		return errors.New(`key "username" must not contain ':' or a line break`)
	case strings.ContainsAny(c.Password, "\r\n"):
		return errors.New(`key "password" must not contain a line break`)
	}
	return nil
}
