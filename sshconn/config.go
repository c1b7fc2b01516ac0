package sshconn

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/go-logr/logr"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"golang.org/x/crypto/ssh"

	"github.com/egressproxy/egressproxy/internal/duration"
	"github.com/egressproxy/egressproxy/internal/errs"
)

// Config describes how to reach one host's sshd, as a person writes it in
// a file: it marshals to JSON and YAML with camelCase keys and durations as
// strings ("30s"), secrets left out. Every field documents its zero value;
// there is no way to skip host key verification.
type Config struct {
	// Address is the host:port of sshd. Required. It is also the name
	// looked up in known_hosts ("[host]:port" unless the port is 22).
	Address string `json:"address"`
	// User is the SSH user name. Required.
	User string `json:"user"`
	// The client key comes from exactly one of KeyFile, Key, AgentSocket and
	// Options.Signer; New names the fields when none or several are set.
	// None of them (nor KeyPassphrase) ever appears in an error, a log line,
	// String or a marshalled Config.

	// KeyFile is a private key file (OpenSSH or PEM), encrypted with
	// KeyPassphrase or unencrypted. Zero: the key comes from Key,
	// AgentSocket or Options.Signer. It is read on every dial, so a rotated
	// key is picked up by the next redial.
	KeyFile string `json:"keyFile,omitempty"`
	// Key is a private key in PEM form (OpenSSH or PKCS#1/PKCS#8/SEC 1),
	// encrypted with KeyPassphrase or unencrypted: for a key held in memory,
	// e.g. read from a Kubernetes Secret. New keeps its own copy. Zero: the
	// key comes from KeyFile, AgentSocket or Options.Signer.
	Key []byte `json:"-"`
	// KeyPassphrase decrypts KeyFile or Key. Zero: the key is unencrypted
	// (an encrypted key is then KindKeyUnreadable at dial). Setting it
	// without KeyFile or Key is invalid. New keeps its own copy.
	KeyPassphrase []byte `json:"-"`
	// AgentSocket is the path of an ssh-agent's unix socket (what
	// SSH_AUTH_SOCK names). Each dial opens its own agent connection, offers
	// every key the agent holds, and closes it when the handshake ends, so
	// keys added or removed later are seen by the next dial. An agent that
	// cannot be reached or holds no key is KindKeyUnreadable. Zero: the key
	// comes from KeyFile, Key or Options.Signer.
	AgentSocket string `json:"agentSocket,omitempty"`

	// Host keys are pinned by exactly one of KnownHostsFile and KnownHosts
	// (OpenSSH known_hosts format: plain and hashed host names, "[host]:port",
	// wildcard and negated patterns, @cert-authority lines that accept host
	// certificates signed by that CA, @revoked lines that refuse a key, a
	// CA's certificates and a certified host key). There is no way to skip
	// host key verification. A host missing from it is KindHostUnknown; a
	// different, revoked or invalidly certified key is KindHostKeyMismatch.

	// KnownHostsFile is an OpenSSH known_hosts file, read on every dial. An
	// empty or missing file makes every host unknown. Zero: KnownHosts.
	KnownHostsFile string `json:"knownHostsFile,omitempty"`
	// KnownHosts is the content of a known_hosts file, for host keys held in
	// memory (a ConfigMap, a Secret). It must contain at least one valid
	// line. New keeps its own copy. Zero: KnownHostsFile.
	KnownHosts []byte `json:"knownHosts,omitempty"`
	// DialTimeout bounds the TCP dial plus the SSH handshake. Zero: 10s.
	// When it (not the caller's context) ends a dial, the error is
	// KindUnreachable and says so; it does not match
	// context.DeadlineExceeded, which is kept for the caller's deadline.
	DialTimeout time.Duration `json:"dialTimeout,omitempty"`
	// KeepaliveInterval is how often a keepalive@openssh.com request is sent
	// on a shared or dedicated connection. Zero: 5s.
	KeepaliveInterval time.Duration `json:"keepaliveInterval,omitempty"`
	// KeepaliveCount is how many intervals may pass without any answer from
	// the server before the connection is declared dead and torn down.
	// Zero: 3.
	KeepaliveCount int `json:"keepaliveCount,omitempty"`
	// MaxRedialBackoff caps the exponential backoff (starting at 100ms)
	// between failed dial attempts of the shared connection. Zero: 5s.
	MaxRedialBackoff time.Duration `json:"maxRedialBackoff,omitempty"`
}

// Options holds a Pool's runtime dependencies. nil is valid: every field's
// zero value is its default.
type Options struct {
	// Logger receives the pool's lines (named "sshconn", with the
	// address). Zero: discard.
	Logger logr.Logger
	// Signer signs with a key the embedder holds (a hardware token, its own
	// agent client...), as the client key instead of one of Config's key
	// sources. It must be safe for concurrent use. Zero: the key comes from
	// Config's KeyFile, Key or AgentSocket.
	Signer ssh.Signer
	// MeterProvider records the state of the shared connection
	// (egressproxy.ssh.connection.state, reported until Close) and its
	// redials (egressproxy.ssh.redials). Nil: no-op.
	MeterProvider metric.MeterProvider
	// MetricAttributes are added to every measurement of the pool: what
	// tells pools apart, e.g. kvm2's egressproxy.entry. They should be
	// few and constant; empty string values are left out. Zero: none (the
	// series of every pool of a MeterProvider are then one).
	MetricAttributes []attribute.KeyValue
}

const (
	defaultDialTimeout       = 10 * time.Second
	defaultKeepaliveInterval = 5 * time.Second
	defaultKeepaliveCount    = 3
	defaultMaxRedialBackoff  = 5 * time.Second
	minRedialBackoff         = 100 * time.Millisecond
)

// validate checks c, with signer set when Options.Signer is, without
// touching the network or the files. The error is an *Error of KindConfig
// wrapping one *errs.FieldError per violation (all of them at once,
// joined), naming the Go field.
func (c Config) validate(signer bool) error {
	var problems []error
	bad := func(field, value, rule string) {
		problems = append(problems, &errs.FieldError{Field: field, Value: value, Rule: rule})
	}
	c.validateAddress(bad)
	if c.User == "" {
		bad("User", "", "is required")
	}
	keySources := map[string]bool{
		"KeyFile":     c.KeyFile != "",
		"Key":         len(c.Key) > 0,
		"AgentSocket": c.AgentSocket != "",
		"Signer":      signer,
	}
	oneOf(bad, keySources, []string{"KeyFile", "Key", "AgentSocket", "Signer"},
		"KeyFile", "a client key is required: set one of KeyFile, Key, AgentSocket or Options.Signer")
	if len(c.KeyPassphrase) > 0 && c.KeyFile == "" && len(c.Key) == 0 {
		bad("KeyPassphrase", "", "applies only to KeyFile or Key")
	}
	hostSources := map[string]bool{
		"KnownHostsFile": c.KnownHostsFile != "",
		"KnownHosts":     len(c.KnownHosts) > 0,
	}
	oneOf(bad, hostSources, []string{"KnownHostsFile", "KnownHosts"},
		"KnownHostsFile", "is required, or KnownHosts (host key verification cannot be skipped)")
	if len(c.KnownHosts) > 0 && !hasKnownHostsLine(c.KnownHosts) {
		bad("KnownHosts", "", "must contain at least one valid known_hosts line")
	}
	if c.AgentSocket != "" && !filepath.IsAbs(c.AgentSocket) {
		bad("AgentSocket", c.AgentSocket, "must be an absolute path (the agent's unix socket)")
	}
	for _, d := range []struct {
		field string
		v     time.Duration
		zero  string
	}{
		{"DialTimeout", c.DialTimeout, "10s"},
		{"KeepaliveInterval", c.KeepaliveInterval, "5s"},
		{"MaxRedialBackoff", c.MaxRedialBackoff, "5s"},
	} {
		if d.v < 0 {
			bad(d.field, d.v.String(), "must not be negative (zero means "+d.zero+")")
		}
	}
	if c.KeepaliveCount < 0 {
		bad("KeepaliveCount", strconv.Itoa(c.KeepaliveCount), "must not be negative (zero means 3)")
	}
	if len(problems) == 0 {
		return nil
	}
	return &Error{Kind: KindConfig, Op: "new pool", Err: errors.Join(problems...)}
}

// validateAddress reports, through bad, an Address that is not host:port
// with a host and a port in 1..65535.
func (c Config) validateAddress(bad func(field, value, rule string)) {
	if c.Address == "" {
		bad("Address", "", "is required (host:port)")
		return
	}
	host, port, err := net.SplitHostPort(c.Address)
	if err != nil {
		bad("Address", c.Address, "must be host:port")
		return
	}
	if host == "" {
		bad("Address", c.Address, "host part must not be empty")
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		bad("Address", c.Address, "port must be a number in 1..65535")
	}
}

// oneOf reports, through bad, a source group of which not exactly one is
// set: none names the field missing, several name every one that is set.
func oneOf(bad func(field, value, rule string), set map[string]bool, order []string, missing, rule string) {
	var given []string
	for _, f := range order {
		if set[f] {
			given = append(given, f)
		}
	}
	switch {
	case len(given) == 0:
		bad(missing, "", rule)
	case len(given) > 1:
		for _, f := range given {
			others := slices.DeleteFunc(slices.Clone(given), func(g string) bool { return g == f })
			bad(f, "", "set exactly one of "+strings.Join(order, ", ")+" (also set: "+strings.Join(others, ", ")+")")
		}
	}
}

// hasKnownHostsLine reports whether b holds at least one line that parses
// as a known_hosts entry (knownhosts refuses content without any).
func hasKnownHostsLine(b []byte) bool {
	for _, line := range bytes.Split(b, []byte("\n")) {
		if _, _, _, _, _, err := ssh.ParseKnownHosts(line); err == nil {
			return true
		}
	}
	return false
}

// String describes c without any secret: the key source is named (a file
// path, an agent socket, or the size of in-memory key bytes), never its
// content.
func (c Config) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "sshconn.Config{Address: %q, User: %q", c.Address, c.User)
	if c.KeyFile != "" {
		fmt.Fprintf(&b, ", KeyFile: %q", c.KeyFile)
	}
	if len(c.Key) > 0 {
		fmt.Fprintf(&b, ", Key: [redacted, %d bytes]", len(c.Key))
	}
	if len(c.KeyPassphrase) > 0 {
		b.WriteString(", KeyPassphrase: [redacted]")
	}
	if c.AgentSocket != "" {
		fmt.Fprintf(&b, ", AgentSocket: %q", c.AgentSocket)
	}
	if c.KnownHostsFile != "" {
		fmt.Fprintf(&b, ", KnownHostsFile: %q", c.KnownHostsFile)
	}
	if len(c.KnownHosts) > 0 {
		fmt.Fprintf(&b, ", KnownHosts: [%d bytes]", len(c.KnownHosts))
	}
	fmt.Fprintf(&b, ", DialTimeout: %v, KeepaliveInterval: %v, KeepaliveCount: %d, MaxRedialBackoff: %v}",
		c.DialTimeout, c.KeepaliveInterval, c.KeepaliveCount, c.MaxRedialBackoff)
	return b.String()
}

// GoString is String, so that %#v does not print key bytes either.
func (c Config) GoString() string { return c.String() }

// MarshalJSON writes c with durations as strings ("30s", zero left out)
// and without its secrets.
func (c Config) MarshalJSON() ([]byte, error) {
	type plain Config
	d := func(v time.Duration) *duration.Duration {
		if v == 0 {
			return nil
		}
		return (*duration.Duration)(&v)
	}
	// The duration fields below shadow plain's of the same JSON names.
	return json.Marshal(struct {
		plain
		DialTimeout       *duration.Duration `json:"dialTimeout,omitempty"`
		KeepaliveInterval *duration.Duration `json:"keepaliveInterval,omitempty"`
		MaxRedialBackoff  *duration.Duration `json:"maxRedialBackoff,omitempty"`
	}{plain(c), d(c.DialTimeout), d(c.KeepaliveInterval), d(c.MaxRedialBackoff)})
}

// UnmarshalJSON reads c strictly (an unknown key is an error), durations
// as strings in time.ParseDuration syntax ("30s"; a bare number, which
// would read as nanoseconds, is refused).
func (c *Config) UnmarshalJSON(b []byte) error {
	type plain Config
	v := struct {
		*plain
		DialTimeout       *duration.Duration `json:"dialTimeout,omitempty"`
		KeepaliveInterval *duration.Duration `json:"keepaliveInterval,omitempty"`
		MaxRedialBackoff  *duration.Duration `json:"maxRedialBackoff,omitempty"`
	}{(*plain)(c), (*duration.Duration)(&c.DialTimeout), (*duration.Duration)(&c.KeepaliveInterval),
		(*duration.Duration)(&c.MaxRedialBackoff)}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	return dec.Decode(&v)
}

// withDefaults returns c with zero values replaced by their defaults.
func (c Config) withDefaults() Config {
	if c.DialTimeout == 0 {
		c.DialTimeout = defaultDialTimeout
	}
	if c.KeepaliveInterval == 0 {
		c.KeepaliveInterval = defaultKeepaliveInterval
	}
	if c.KeepaliveCount == 0 {
		c.KeepaliveCount = defaultKeepaliveCount
	}
	if c.MaxRedialBackoff == 0 {
		c.MaxRedialBackoff = defaultMaxRedialBackoff
	}
	// Private copies: the caller may reuse or wipe its buffers.
	c.Key = bytes.Clone(c.Key)
	c.KeyPassphrase = bytes.Clone(c.KeyPassphrase)
	c.KnownHosts = bytes.Clone(c.KnownHosts)
	return c
}
