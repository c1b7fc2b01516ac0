// Package sshconn is a pooled SSH transport to one host with pinned host
// keys and liveness, built on golang.org/x/crypto/ssh.
//
// A Pool keeps one shared connection, dialed on first use and redialed
// after it dies (with a bounded exponential backoff between failed dials),
// and dials dedicated connections for long transfers. Every connection
// sends keepalive@openssh.com probes and is declared dead when
// KeepaliveCount intervals pass without any answer; Done reports it, Kill
// abandons a connection at once. DialUnix opens a channel to a remote unix
// socket, bounded by a context.
//
// The host key is always verified against known_hosts content (a file or
// bytes: plain and hashed names, patterns, @cert-authority for host
// certificates, @revoked); there is no way to skip it. The client key
// comes from a file, from PEM bytes (optionally passphrase-protected),
// from an ssh.Signer or from an ssh-agent.
//
// Every classified failure is an *Error whose Kind says why (key
// unreadable, auth refused, host unknown, host key mismatch, unreachable,
// forbidden, closed, invalid config); match it with errors.As.
//
// With Options.MeterProvider a Pool reports its shared connection's state
// (idle, connected, disconnected) until Close and counts its redials.
//
// Close never blocks on an unresponsive (even SIGSTOPped) peer and ends
// the dials and channel opens in flight: a connection is first declared
// dead, then its TCP connection is closed, and only then anything that may
// wait. Every goroutine the package starts ends by Close.
package sshconn
