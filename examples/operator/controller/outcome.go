package controller

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"strings"

	"github.com/GehirnInc/crypt/sha512_crypt"
	"github.com/egressproxy/egressproxy"
)

// Condition reasons the operator sets besides the library's own names
// (egressproxy.ErrorCode's String, egressproxy.HealthReason, egressproxy.State).
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

// UserData is the cloud-init user-data of a proxy VM, for a guest image
// that follows the project's first-boot contract (docs/e2e.md: Squid starts
// after cloud-init has written user-data's files): it writes
// /etc/squid/squid.conf to serve CONNECT on port and, with credentials, to
// require them (Squid's basic_ncsa_auth over /etc/squid/passwd, which holds
// a SHA-512 crypt hash, never the password). salt makes the hash; the
// reconciler derives it from the object's UID (SaltFor), so the user-data,
// and with it the spec's digest, is the same at every reconcile while
// rotating the password changes it (and so recreates the VM).
//
// Without credentials the proxy tunnels CONNECT for anyone who reaches its
// port: restrict that with the guest network, or set credentials.
func UserData(port int, c Credentials, salt string) (string, error) {
	var b strings.Builder
	b.WriteString("#cloud-config\nwrite_files:\n- path: /etc/squid/squid.conf\n  content: |\n")
	conf := []string{
		fmt.Sprintf("http_port %d", port),
		"acl CONNECT method CONNECT",
	}
	if c.User != "" {
		conf = append(conf,
			"auth_param basic program /usr/lib/squid/basic_ncsa_auth /etc/squid/passwd",
			"auth_param basic realm egressproxy",
			"acl proxyusers proxy_auth REQUIRED",
			"http_access allow CONNECT proxyusers")
	} else {
		conf = append(conf, "http_access allow CONNECT")
	}
	conf = append(conf, "http_access deny all", "cache deny all", "pinger_enable off",
		"shutdown_lifetime 1 second", "coredump_dir /var/spool/squid")
	for _, l := range conf {
		b.WriteString("    " + l + "\n")
	}
	if c.User != "" {
		hash, err := sha512_crypt.New().Generate([]byte(c.Password), []byte("$6$"+salt))
		if err != nil {
			return "", fmt.Errorf("hash the proxy password: %w", err)
		}
		b.WriteString("- path: /etc/squid/passwd\n  owner: root:proxy\n  permissions: '0640'\n  content: |\n")
		b.WriteString("    " + c.User + ":" + hash + "\n")
	}
	return b.String(), nil
}

// saltAlphabet is crypt(3)'s salt alphabet.
const saltAlphabet = "./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"

// SaltFor is the crypt salt of the object with uid: 16 characters of
// crypt's alphabet taken from sha256(uid), stable for the object's life.
func SaltFor(uid string) string {
	sum := sha256.Sum256([]byte("egressproxy-operator-salt/" + uid))
	out := make([]byte, 16)
	for i := range out {
		out[i] = saltAlphabet[sum[i]%64]
	}
	return string(out)
}
