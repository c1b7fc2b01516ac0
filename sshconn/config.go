package sshconn

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/go-logr/logr"
	"golang.org/x/crypto/ssh"
)

// Config describes how to reach one hypervisor's sshd. Every field documents
// its zero value; there is no way to skip host key verification.
type Config struct {
	// Addr is the host:port of sshd. Required. It is also the name looked up
	// in known_hosts ("[host]:port" unless the port is 22).
	Addr string `json:"addr"`
	// User is the SSH user name. Required.
	User string `json:"user"`
	// The client key comes from exactly one of KeyFile, Key, Signer and
	// AgentSocket; Validate names the fields when none or several are set.
	// None of them (nor KeyPassphrase) ever appears in an error, a log line,
	// String or a marshalled Config.

	// KeyFile is a private key file (OpenSSH or PEM), encrypted with
	// KeyPassphrase or unencrypted. Zero: the key comes from Key, Signer or
	// AgentSocket. It is read on every dial, so a rotated key is picked up by
	// the next redial.
	KeyFile string `json:"keyFile,omitempty"`
	// Key is a private key in PEM form (OpenSSH or PKCS#1/PKCS#8/SEC 1),
	// encrypted with KeyPassphrase or unencrypted: for a key held in memory,
	// e.g. read from a Kubernetes Secret. New keeps its own copy. Zero: the
	// key comes from KeyFile, Signer or AgentSocket.
	Key []byte `json:"-"`
	// KeyPassphrase decrypts KeyFile or Key. Zero: the key is unencrypted
	// (an encrypted key is then KindKeyUnreadable at dial). Setting it
	// without KeyFile or Key is invalid. New keeps its own copy.
	KeyPassphrase []byte `json:"-"`
	// Signer signs with a key the embedder holds (a hardware token, its own
	// agent client...). It must be safe for concurrent use. Zero: the key
	// comes from KeyFile, Key or AgentSocket.
	Signer ssh.Signer `json:"-"`
	// AgentSocket is the path of an ssh-agent's unix socket (what
	// SSH_AUTH_SOCK names). Each dial opens its own agent connection, offers
	// every key the agent holds, and closes it when the handshake ends, so
	// keys added or removed later are seen by the next dial. An agent that
	// cannot be reached or holds no key is KindKeyUnreadable. Zero: the key
	// comes from KeyFile, Key or Signer.
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
	// the server before the link is declared dead and torn down. Zero: 3.
	KeepaliveCount int `json:"keepaliveCount,omitempty"`
	// MaxRedialBackoff caps the exponential backoff (starting at 100ms)
	// between failed dial attempts of the shared connection. Zero: 5s.
	MaxRedialBackoff time.Duration `json:"maxRedialBackoff,omitempty"`
	// Logger receives debug/info lines. Zero value: discard.
	Logger logr.Logger `json:"-"`
}

const (
	defaultDialTimeout       = 10 * time.Second
	defaultKeepaliveInterval = 5 * time.Second
	defaultKeepaliveCount    = 3
	defaultMaxRedialBackoff  = 5 * time.Second
	minRedialBackoff         = 100 * time.Millisecond
)

// Validate checks the config without touching the network or the files.
// The error is a *Error of KindConfig wrapping one *errs.FieldError per
// violation (all of them at once, joined), the validation error type of
// every package of this module.
func (c Config) Validate() error {
	var problems []error
	bad := func(field, rule string) {
		problems = append(problems, &errs.FieldError{Field: field, Rule: rule})
	}
	if c.Addr == "" {
		bad("Addr", "is required (host:port)")
	} else if host, port, err := net.SplitHostPort(c.Addr); err != nil {
		bad("Addr", fmt.Sprintf("must be host:port (%v)", err))
	} else {
		if host == "" {
			bad("Addr", "host part must not be empty")
		}
		if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
			bad("Addr", "port must be a number in 1..65535")
		}
	}
	if c.User == "" {
		bad("User", "is required")
	}
	keySources := map[string]bool{
		"KeyFile":     c.KeyFile != "",
		"Key":         len(c.Key) > 0,
		"Signer":      c.Signer != nil,
		"AgentSocket": c.AgentSocket != "",
	}
	oneOf(bad, keySources, []string{"KeyFile", "Key", "Signer", "AgentSocket"},
		"KeyFile", "a client key is required: set one of KeyFile, Key, Signer or AgentSocket")
	if len(c.KeyPassphrase) > 0 && c.KeyFile == "" && len(c.Key) == 0 {
		bad("KeyPassphrase", "applies only to KeyFile or Key")
	}
	hostSources := map[string]bool{
		"KnownHostsFile": c.KnownHostsFile != "",
		"KnownHosts":     len(c.KnownHosts) > 0,
	}
	oneOf(bad, hostSources, []string{"KnownHostsFile", "KnownHosts"},
		"KnownHostsFile", "is required, or KnownHosts (host key verification cannot be skipped)")
	if len(c.KnownHosts) > 0 && !hasKnownHostsLine(c.KnownHosts) {
		bad("KnownHosts", "must contain at least one valid known_hosts line")
	}
	if c.AgentSocket != "" && !filepath.IsAbs(c.AgentSocket) {
		bad("AgentSocket", "must be an absolute path (the agent's unix socket)")
	}
	if c.DialTimeout < 0 {
		bad("DialTimeout", "must not be negative (zero means 10s)")
	}
	if c.KeepaliveInterval < 0 {
		bad("KeepaliveInterval", "must not be negative (zero means 5s)")
	}
	if c.KeepaliveCount < 0 {
		bad("KeepaliveCount", "must not be negative (zero means 3)")
	}
	if c.MaxRedialBackoff < 0 {
		bad("MaxRedialBackoff", "must not be negative (zero means 5s)")
	}
	if len(problems) == 0 {
		return nil
	}
	return &Error{Kind: KindConfig, Addr: c.Addr, Op: "validate config", Err: errors.Join(problems...)}
}

// oneOf reports, through bad, a source group of which not exactly one is
// set: none names the field missing, several name every one that is set.
func oneOf(bad func(field, rule string), set map[string]bool, order []string, missing, rule string) {
	var given []string
	for _, f := range order {
		if set[f] {
			given = append(given, f)
		}
	}
	switch {
	case len(given) == 0:
		bad(missing, rule)
	case len(given) > 1:
		for _, f := range given {
			others := slices.DeleteFunc(slices.Clone(given), func(g string) bool { return g == f })
			bad(f, "set exactly one of "+strings.Join(order, ", ")+" (also set: "+strings.Join(others, ", ")+")")
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
// path, an agent socket, a signer's key type and fingerprint, or the size of
// in-memory key bytes), never its content.
func (c Config) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "sshconn.Config{Addr: %q, User: %q", c.Addr, c.User)
	if c.KeyFile != "" {
		fmt.Fprintf(&b, ", KeyFile: %q", c.KeyFile)
	}
	if len(c.Key) > 0 {
		fmt.Fprintf(&b, ", Key: [redacted, %d bytes]", len(c.Key))
	}
	if len(c.KeyPassphrase) > 0 {
		b.WriteString(", KeyPassphrase: [redacted]")
	}
	if c.Signer != nil {
		b.WriteString(", Signer: " + describeSigner(c.Signer))
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

// describeSigner names a signer by its public key's type and fingerprint
// (public information), recovering from a signer that panics.
func describeSigner(s ssh.Signer) (d string) {
	defer func() {
		if recover() != nil {
			d = "[signer]"
		}
	}()
	pub := s.PublicKey()
	if pub == nil {
		return "[signer]"
	}
	return "[signer " + pub.Type() + " " + ssh.FingerprintSHA256(pub) + "]"
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
	if c.Logger.GetSink() == nil {
		c.Logger = logr.Discard()
	}
	// Private copies: the caller may reuse or wipe its buffers.
	c.Key = bytes.Clone(c.Key)
	c.KeyPassphrase = bytes.Clone(c.KeyPassphrase)
	c.KnownHosts = bytes.Clone(c.KnownHosts)
	return c
}
