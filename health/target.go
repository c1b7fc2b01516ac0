package health

import (
	"errors"
	"net"
	"strconv"
	"strings"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
)

// TargetFor turns a provider instance and its proxy credentials into what a
// probe of its proxy needs: the Target (ID the instance name, ProxyAddr its
// address inst.Address(), TargetAddr connectTarget, and the credentials as
// its own Username and Password) and the ProbeOptions carrying the same
// credentials (user empty: none are sent; the other fields are zero, to be
// set by the caller). Probe one with
//
//	t, o, err := health.TargetFor(inst, "example.com:443", user, password)
//	res := health.Probe(ctx, t.ProxyAddr, t.TargetAddr, &o)
//
// or give many Targets, each with its own credentials, to ProbeAll.
//
// An instance without an address is an error: Transient when it is
// Provisioning (it gets one as it boots; probe it later), Permanent in any
// other state (Stopped or Failed: nothing changes until someone acts). A
// port outside 1–65535, a connectTarget that is not host:port, a user with
// ':' (RFC 7617) or a password without a user is a *errs.FieldError
// classed Permanent. Error texts never contain the password.
func TargetFor(inst egressproxy.Instance, connectTarget, user, password string) (Target, ProbeOptions, error) {
	var problems []error
	if inst.IP == "" {
		code := errs.Permanent
		if inst.State == egressproxy.StateProvisioning {
			code = errs.Transient
		}
		state := string(inst.State)
		if state == "" {
			state = "no state"
		}
		return Target{}, ProbeOptions{}, errs.Errorf(code, "health: instance %s (%s) has no address to probe", errs.Quote(inst.Name), state)
	}
	if inst.Port < 1 || inst.Port > 65535 {
		problems = append(problems, &errs.FieldError{Field: "Instance.Port", Value: strconv.Itoa(inst.Port), Rule: "must be 1-65535"})
	}
	if host, port, err := net.SplitHostPort(connectTarget); err != nil || host == "" || port == "" || strings.ContainsAny(connectTarget, " \t\r\n") {
		problems = append(problems, &errs.FieldError{Field: "connectTarget", Value: connectTarget, Rule: "must be host:port with a non-empty host and port, without spaces"})
	}
	if strings.IndexByte(user, ':') >= 0 {
		problems = append(problems, &errs.FieldError{Field: "user", Value: user, Rule: "must not contain ':' (RFC 7617 basic auth)"})
	}
	if user == "" && password != "" {
		problems = append(problems, &errs.FieldError{Field: "password", Rule: "is set without a user"})
	}
	if len(problems) > 0 {
		return Target{}, ProbeOptions{}, errs.WithCode(errs.Permanent, errors.Join(problems...))
	}
	t := Target{ID: inst.Name, ProxyAddr: inst.Address(), TargetAddr: connectTarget, Username: user, Password: password}
	return t, ProbeOptions{Username: user, Password: password}, nil
}
