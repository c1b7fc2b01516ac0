package controller

import (
	"errors"
	"fmt"
	"strings"

	"github.com/egressproxy/egressproxy/provider"
)

// Condition reasons the operator sets besides the library's own names
// (provider.ErrorCode's String, provider.HealthReason, provider.State).
const (
	ReasonUnknownProvider    = "UnknownProvider"
	ReasonCredentialsInvalid = "CredentialsInvalid"
	ReasonSpecConflict       = "SpecConflict"
	ReasonRecreating         = "Recreating"
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
// (provider.Code), the table of the README:
//
//	Transient         -> Backoff
//	Unknown           -> Backoff (the client classes these Transient anyway)
//	DeadlineExceeded  -> Backoff (a call's budget ran out; retrying is safe)
//	Canceled          -> Stop
//	Permanent         -> condition, slow retry (SpecConflict has its own reason)
//	NotFound          -> condition, slow retry (the reconciler handles the
//	                     NotFound it expects, of Get and Delete, before this)
func Outcome(err error) Decision {
	code := provider.Code(err)
	switch code {
	case provider.Transient, provider.Unknown, provider.DeadlineExceeded:
		return Decision{Reason: code.String(), Backoff: true}
	case provider.Canceled:
		return Decision{Reason: ReasonShuttingDown, Stop: true}
	case provider.Permanent:
		if errors.Is(err, provider.ErrSpecConflict) {
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

// UserData is the cloud-init user-data of a proxy VM: it tells the guest
// image the port to serve and the credentials to require. The guest reads
// /etc/egressproxy/proxy.env (PORT, USER, PASSWORD). The credentials are
// part of the spec (so of its digest): rotating them recreates the VM.
func UserData(port int, c Credentials) string {
	var b strings.Builder
	b.WriteString("#cloud-config\nwrite_files:\n- path: /etc/egressproxy/proxy.env\n  permissions: '0600'\n  content: |\n")
	fmt.Fprintf(&b, "    PORT=%d\n", port)
	if c.User != "" {
		fmt.Fprintf(&b, "    USER=%s\n    PASSWORD=%s\n", shellQuote(c.User), shellQuote(c.Password))
	}
	return b.String()
}

func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
