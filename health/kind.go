package health

import (
	"fmt"
	"strconv"
)

// Kind classifies the outcome of a probe. The zero value, KindNone, means
// "no failure": it is the Kind of every successful Result. A failure is a
// *ProbeError carrying its Kind; match it with errors.As.
type Kind uint8

const (
	// KindNone: the probe succeeded (or has not run).
	KindNone Kind = iota
	// KindRefused: the proxy's address actively refused the TCP connection.
	KindRefused
	// KindTimeout: the probe's deadline (ProbeOptions.Timeout or the
	// context's deadline) passed before the probe finished.
	KindTimeout
	// KindDNS: the proxy's host name could not be resolved.
	KindDNS
	// KindAuthRequired: the proxy answered 407 Proxy Authentication
	// Required (no or wrong credentials).
	KindAuthRequired
	// KindProxyStatus: the proxy answered a complete, well-formed response
	// with a status other than 2xx and 407 (for example 403 for a denied
	// port or 502/503 for an unreachable target). Result.StatusCode holds it.
	KindProxyStatus
	// KindMalformed: the proxy's answer is not a valid HTTP/1.x response
	// head (bad status line, truncated head, head too large).
	KindMalformed
	// KindTunnelFailed: the proxy answered 2xx but the tunnel proof (TLS
	// handshake or exchange) failed.
	KindTunnelFailed
	// KindCanceled: the caller's context was canceled.
	KindCanceled
	// KindNetwork: any other network failure (connection reset, closed
	// without an answer, unreachable network, ...).
	KindNetwork
	// KindBadInput: the probe's input is invalid (empty proxy address,
	// target that is not host:port, ...). Nothing was sent.
	KindBadInput
	// KindTLS: the TLS handshake with the proxy (ProbeOptions.ProxyTLS)
	// failed: its certificate is not trusted or not for its name, it does
	// not speak TLS, or it ended the connection during the handshake.
	KindTLS

	kindCount
)

var kindNames = [...]string{
	KindNone:         "none",
	KindRefused:      "refused",
	KindTimeout:      "timeout",
	KindDNS:          "dns",
	KindAuthRequired: "auth-required",
	KindProxyStatus:  "proxy-status",
	KindMalformed:    "malformed",
	KindTunnelFailed: "tunnel-failed",
	KindCanceled:     "canceled",
	KindNetwork:      "network",
	KindBadInput:     "bad-input",
	KindTLS:          "tls",
}

// String returns a short, stable, lowercase name (suitable as a metric label).
func (k Kind) String() string {
	if k < kindCount {
		return kindNames[k]
	}
	return "kind(" + strconv.Itoa(int(k)) + ")"
}

var kindReasons = [...]string{
	KindNone:         "None",
	KindRefused:      "Refused",
	KindTimeout:      "Timeout",
	KindDNS:          "DNS",
	KindAuthRequired: "AuthRequired",
	KindProxyStatus:  "ProxyStatus",
	KindMalformed:    "Malformed",
	KindTunnelFailed: "TunnelFailed",
	KindCanceled:     "Canceled",
	KindNetwork:      "Network",
	KindBadInput:     "BadInput",
	KindTLS:          "TLS",
}

// Reason returns the kind's name in CamelCase ("AuthRequired"), stable and
// valid as a Kubernetes condition reason, which String's lowercase names
// with dashes are not.
func (k Kind) Reason() string {
	if k < kindCount {
		return kindReasons[k]
	}
	return "Kind" + strconv.Itoa(int(k))
}

// ProbeError is the error of a failed probe (Result.Err). Read its Kind
// after errors.As:
//
//	var pe *health.ProbeError
//	if errors.As(err, &pe) && pe.Kind == health.KindAuthRequired { ... }
type ProbeError struct {
	Kind       Kind
	Op         string // phase that failed: "input", "dial", "handshake", "write", "read", "tunnel"
	Proxy      string // proxy address as given
	Target     string // CONNECT target as given
	StatusCode int    // the proxy's status code when one was read, else 0
	Err        error  // underlying cause, may be nil
}

func (e *ProbeError) Error() string {
	s := "health: probe via " + e.Proxy + " to " + e.Target + ": " + e.Op + ": " + e.Kind.String()
	if e.StatusCode != 0 {
		s += " (status " + strconv.Itoa(e.StatusCode) + ")"
	}
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Unwrap returns the underlying cause.
func (e *ProbeError) Unwrap() error { return e.Err }

// malformedError describes what is wrong with a response head.
type malformedError struct{ what string }

func (e *malformedError) Error() string { return "malformed response: " + e.what }

func errMalformed(format string, args ...any) error {
	return &malformedError{what: fmt.Sprintf(format, args...)}
}
