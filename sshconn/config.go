package sshconn

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"time"

	"github.com/go-logr/logr"

	"github.com/egressproxy/egressproxy/provider"
)

// Config describes how to reach one hypervisor's sshd. Every field documents
// its zero value; there is no way to skip host key verification.
type Config struct {
	// Addr is the host:port of sshd. Required. It is also the name looked up
	// in known_hosts ("[host]:port" unless the port is 22).
	Addr string
	// User is the SSH user name. Required.
	User string
	// KeyFile is an unencrypted private key file (OpenSSH or PEM). Required.
	// It is read on every dial, so a rotated key is picked up by the next
	// redial.
	KeyFile string
	// KnownHostsFile is an OpenSSH known_hosts file pinning the host key.
	// Required. A host missing from it (or an empty file) is KindHostUnknown,
	// a different key is KindHostKeyMismatch.
	KnownHostsFile string
	// DialTimeout bounds the TCP dial plus the SSH handshake. Zero: 10s.
	DialTimeout time.Duration
	// KeepaliveInterval is how often a keepalive@openssh.com request is sent
	// on a shared or dedicated connection. Zero: 5s.
	KeepaliveInterval time.Duration
	// KeepaliveCount is how many intervals may pass without any answer from
	// the server before the link is declared dead and torn down. Zero: 3.
	KeepaliveCount int
	// MaxRedialBackoff caps the exponential backoff (starting at 100ms)
	// between failed dial attempts of the shared connection. Zero: 5s.
	MaxRedialBackoff time.Duration
	// Logger receives debug/info lines. Zero value: discard.
	Logger logr.Logger
}

const (
	defaultDialTimeout       = 10 * time.Second
	defaultKeepaliveInterval = 5 * time.Second
	defaultKeepaliveCount    = 3
	defaultMaxRedialBackoff  = 5 * time.Second
	minRedialBackoff         = 100 * time.Millisecond
)

// Validate checks the config without touching the network or the files.
// The error is a *Error of KindConfig wrapping one *provider.FieldError per
// violation (all of them at once, joined), the validation error type of
// every package of this module.
func (c Config) Validate() error {
	var errs []error
	bad := func(field, rule string) {
		errs = append(errs, &provider.FieldError{Field: field, Rule: rule})
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
	if c.KeyFile == "" {
		bad("KeyFile", "is required (path of a private key file)")
	}
	if c.KnownHostsFile == "" {
		bad("KnownHostsFile", "is required (host key verification cannot be skipped)")
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
	if len(errs) == 0 {
		return nil
	}
	return &Error{Kind: KindConfig, Addr: c.Addr, Op: "validate config", Err: errors.Join(errs...)}
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
	return c
}
