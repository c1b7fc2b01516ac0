//go:build integration

package sshconn

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/go-logr/logr/testr"
	"golang.org/x/crypto/ssh"

	"github.com/egressproxy/egressproxy/internal/testing/sshtest"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

func stackConfig(env teststack.Env) Config {
	return Config{Address: env.SSHAddr, User: env.SSHUser, KeyFile: env.SSHKey, KnownHostsFile: env.KnownHosts}
}

// stackPool is a Pool of cfg that logs to t.
func stackPool(t *testing.T, cfg Config) *Pool {
	t.Helper()
	return newPoolWith(t, cfg, &Options{Logger: testr.NewWithOptions(t, testr.Options{Verbosity: 1})})
}

// libvirtHostname opens a channel to the stack's libvirtd socket on c (a
// connection of p), asks libvirtd for its host name over it with
// go-libvirt and disconnects: proof that the connection carries real work.
func libvirtHostname(ctx context.Context, env teststack.Env, p *Pool, c *ssh.Client) (string, error) {
	conn, err := p.DialUnix(ctx, c, env.LibvirtSocket)
	if err != nil {
		return "", err
	}
	l := libvirt.NewWithDialer(onceDialer{conn})
	if err := l.ConnectToURI(libvirt.ConnectURI(env.LibvirtURI)); err != nil {
		_ = conn.Close()
		return "", err
	}
	defer func() { _ = l.Disconnect() }()
	return l.ConnectGetHostname()
}

// onceDialer hands go-libvirt a channel already open.
type onceDialer struct{ c net.Conn }

func (d onceDialer) Dial() (net.Conn, error) { return d.c, nil }

// The shared connection and a dedicated one both carry a libvirt session
// to the stack's libvirtd; a killed dedicated connection is Done and
// refuses channels, the shared one is unaffected.
func TestIntegrationChannel(t *testing.T) {
	env := teststack.Require(t)
	want, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	p := stackPool(t, stackConfig(env))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	shared, err := p.Client(ctx)
	if err != nil {
		t.Fatalf("Client: %v", err)
	}
	d, err := p.Dedicated(ctx)
	if err != nil {
		t.Fatalf("Dedicated: %v", err)
	}
	for name, c := range map[string]*ssh.Client{"shared": shared, "dedicated": d} {
		if h, err := libvirtHostname(ctx, env, p, c); err != nil || h != want {
			t.Errorf("%s: hostname %q, %v; want %q", name, h, err, want)
		}
	}
	p.Kill(d, nil)
	select {
	case <-p.Done(d):
	default:
		t.Error("a killed dedicated connection is not Done")
	}
	if _, err := p.DialUnix(ctx, d, env.LibvirtSocket); errKind(err) != KindUnreachable {
		t.Errorf("DialUnix on a killed connection: %v (kind %v), want unreachable", err, errKind(err))
	}
	if h, err := libvirtHostname(ctx, env, p, shared); err != nil || h != want {
		t.Errorf("shared after the dedicated one was killed: %q, %v", h, err)
	}
}

func TestIntegrationErrors(t *testing.T) {
	env := teststack.Require(t)
	dir := t.TempDir()
	other := sshtest.Signer(t, sshtest.GenEd25519(t)).PublicKey()
	tests := []struct {
		name string
		edit func(*Config)
		want Kind
	}{
		{"missing key file", func(c *Config) { c.KeyFile = filepath.Join(dir, "missing") }, KindKeyUnreadable},
		{"key not authorized", func(c *Config) { c.KeyFile = sshtest.WriteKey(t, dir, "stranger", sshtest.GenEd25519(t)) }, KindAuthRefused},
		{"empty known_hosts", func(c *Config) { c.KnownHostsFile = sshtest.WriteKnownHosts(t, dir, "kh-empty", env.SSHAddr) }, KindHostUnknown},
		{"known_hosts with another key", func(c *Config) {
			c.KnownHostsFile = sshtest.WriteKnownHosts(t, dir, "kh-other", env.SSHAddr, other)
		}, KindHostKeyMismatch},
		{"known_hosts pins another key type (host rebuilt or intercepted)", func(c *Config) {
			c.KnownHostsFile = sshtest.WriteKnownHosts(t, dir, "kh-ecdsa", env.SSHAddr, sshtest.Signer(t, sshtest.GenECDSA(t)).PublicKey())
		}, KindHostKeyMismatch},
		{"unprivileged user cannot open the socket", func(c *Config) { c.User = env.UnprivUser }, KindForbidden},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := stackConfig(env)
			tc.edit(&cfg)
			p := stackPool(t, cfg)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			c, err := p.Client(ctx)
			if err == nil {
				_, err = libvirtHostname(ctx, env, p, c)
			}
			if got := errKind(err); got != tc.want {
				t.Fatalf("kind %v, want %v (err: %v)", got, tc.want, err)
			}
			t.Logf("%v", err)
		})
	}
}

func TestIntegrationSSHDStopped(t *testing.T) {
	env := teststack.Require(t)
	teststack.Run(t, "sshd-stop")
	restarted := false
	t.Cleanup(func() {
		if !restarted {
			teststack.Run(t, "sshd-start")
		}
	})
	cfg := stackConfig(env)
	cfg.MaxRedialBackoff = 200 * time.Millisecond
	p := stackPool(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := p.Client(ctx)
	if errKind(err) != KindUnreachable {
		t.Fatalf("kind %v, want unreachable (err: %v)", errKind(err), err)
	}
	teststack.Run(t, "sshd-start")
	restarted = true
	c, err := p.Client(ctx)
	if err != nil {
		t.Fatalf("Client after sshd-start: %v", err)
	}
	if _, err := libvirtHostname(ctx, env, p, c); err != nil {
		t.Fatalf("a channel after sshd-start: %v", err)
	}
}
