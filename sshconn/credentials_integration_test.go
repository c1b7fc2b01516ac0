//go:build integration

package sshconn

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/crypto/ssh"
	"golang.org/x/crypto/ssh/knownhosts"

	"github.com/egressproxy/egressproxy/internal/testing/eventually"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// certStack is a second sshd, started by the test, presenting a host
// certificate signed by a test CA, and authorizing the stack's client key
// and a passphrase-protected key.
type certStack struct {
	env      teststack.Env
	sshd     *teststack.SSHD
	dir      string
	caPub    ssh.PublicKey
	hostPub  ssh.PublicKey
	encKey   string // passphrase-protected private key file
	encPass  string
	stackKey []byte // the stack's client private key (PEM)
}

func readPub(t *testing.T, path string) ssh.PublicKey {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	k, _, _, _, err := ssh.ParseAuthorizedKey(b)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return k
}

func startCertStack(t *testing.T) *certStack {
	t.Helper()
	env := teststack.Require(t)
	dir := t.TempDir()
	ca, host, enc := filepath.Join(dir, "ca"), filepath.Join(dir, "hostkey"), filepath.Join(dir, "id_enc")
	const pass = "a test passphrase"
	teststack.Keygen(t, "-t", "ed25519", "-N", "", "-C", "test-ca", "-f", ca)
	teststack.Keygen(t, "-t", "ed25519", "-N", "", "-C", "test-host", "-f", host)
	// The certificate names 127.0.0.1, the host name sshconn checks.
	teststack.Keygen(t, "-s", ca, "-I", "test-host", "-h", "-n", "127.0.0.1", "-V", "-5m:+1h", host+".pub")
	// -a 4: few KDF rounds, so decrypting stays quick under -race.
	teststack.Keygen(t, "-t", "ed25519", "-a", "4", "-N", pass, "-C", "test-enc", "-f", enc)

	stackKey, err := os.ReadFile(env.SSHKey)
	if err != nil {
		t.Fatal(err)
	}
	signer, err := ssh.ParsePrivateKey(stackKey)
	if err != nil {
		t.Fatal(err)
	}
	encPub, err := os.ReadFile(enc + ".pub")
	if err != nil {
		t.Fatal(err)
	}
	sshd := teststack.StartSSHD(t, teststack.SSHDOptions{
		HostKey:         host,
		HostCertificate: host + "-cert.pub",
		AuthorizedKeys: []string{strings.TrimSpace(string(ssh.MarshalAuthorizedKey(signer.PublicKey()))),
			strings.TrimSpace(string(encPub))},
	})
	return &certStack{env: env, sshd: sshd, dir: dir, caPub: readPub(t, ca+".pub"), hostPub: readPub(t, host+".pub"),
		encKey: enc, encPass: pass, stackKey: stackKey}
}

// hostname dials through cfg and returns the host name libvirtd answers
// on a channel of the connection, proving the link carries real work.
func (cs *certStack) hostname(t *testing.T, cfg Config) (string, error) {
	t.Helper()
	p, err := New(cfg, nil)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	defer p.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := p.Client(ctx)
	if err != nil {
		return "", err
	}
	return libvirtHostname(ctx, cs.env, p, c)
}

func TestIntegrationHostCertificate(t *testing.T) {
	t.Cleanup(func() { goleak.VerifyNone(t, goleak.IgnoreCurrent()) })
	cs := startCertStack(t)
	want, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	addr := cs.sshd.Addr
	_, port, _ := net.SplitHostPort(addr)
	line := func(marker, pattern string, k ssh.PublicKey) string {
		s := pattern + " " + strings.TrimSpace(string(ssh.MarshalAuthorizedKey(k)))
		if marker != "" {
			s = marker + " " + s
		}
		return s
	}
	ca := line("@cert-authority", "[127.0.0.*]:"+port, cs.caPub)
	tests := []struct {
		name  string
		lines []string
		file  bool
		want  Kind // KindUnknown: accepted
	}{
		// Only the CA line pins the host: success proves the certificate
		// was presented and verified (the plain key is pinned nowhere).
		{"CA line with a wildcard pattern", []string{ca}, false, KindUnknown},
		{"CA line with a hashed name, from a file", []string{line("@cert-authority", knownhosts.HashHostname(knownhosts.Normalize(addr)), cs.caPub)}, true, KindUnknown},
		{"CA line and a stale plain pin", []string{ca, line("", knownhosts.Normalize(addr), cs.caPub)}, false, KindUnknown},
		{"CA revoked", []string{ca, line("@revoked", "*", cs.caPub)}, false, KindHostKeyMismatch},
		{"CA revoked, from a file", []string{ca, line("@revoked", "*", cs.caPub)}, true, KindHostKeyMismatch},
		{"plain host key revoked", []string{ca, line("@revoked", "*", cs.hostPub)}, false, KindHostKeyMismatch},
		{"CA absent", []string{line("@cert-authority", "[10.0.0.1]:22", cs.caPub)}, false, KindHostUnknown},
		{"CA absent, nothing for the host", []string{line("", "[10.0.0.1]:22", cs.hostPub)}, false, KindHostUnknown},
		{"another CA for the host", []string{line("@cert-authority", "[127.0.0.*]:"+port, cs.hostPub)}, false, KindHostKeyMismatch},
		{"no CA, plain key pinned", []string{line("", knownhosts.Normalize(addr), cs.hostPub)}, false, KindUnknown},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			content := []byte(strings.Join(tc.lines, "\n") + "\n")
			cfg := Config{Address: addr, User: cs.env.SSHUser, Key: cs.stackKey}
			if tc.file {
				cfg.KnownHostsFile = filepath.Join(t.TempDir(), "known_hosts")
				if err := os.WriteFile(cfg.KnownHostsFile, content, 0o600); err != nil {
					t.Fatal(err)
				}
			} else {
				cfg.KnownHosts = content
			}
			got, err := cs.hostname(t, cfg)
			if tc.want == KindUnknown {
				if err != nil || got != want {
					t.Fatalf("hostname %q, %v; want %q\nsshd log:\n%s", got, err, want, cs.sshd.Log())
				}
				return
			}
			if k := errKind(err); k != tc.want {
				t.Fatalf("kind %v, want %v (err: %v)", k, tc.want, err)
			}
			if tc.lines[0] == ca && !strings.Contains(err.Error(), "certificate") {
				t.Errorf("the refusal does not say a certificate was presented: %v", err)
			}
		})
	}
}

func TestIntegrationKeyFromBytes(t *testing.T) {
	t.Cleanup(func() { goleak.VerifyNone(t, goleak.IgnoreCurrent()) })
	cs := startCertStack(t)
	want, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	stackKnownHosts, err := os.ReadFile(cs.env.KnownHosts)
	if err != nil {
		t.Fatal(err)
	}
	encPEM, err := os.ReadFile(cs.encKey)
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(cs.sshd.Addr)
	caKnownHosts := []byte("@cert-authority [127.0.0.*]:" + port + " " + string(ssh.MarshalAuthorizedKey(cs.caPub)))
	tests := []struct {
		name string
		cfg  Config
		want Kind
	}{
		{"stack sshd, key and known_hosts as bytes", Config{Address: cs.env.SSHAddr, Key: cs.stackKey, KnownHosts: stackKnownHosts}, KindUnknown},
		{"encrypted key as bytes", Config{Address: cs.sshd.Addr, Key: encPEM, KeyPassphrase: []byte(cs.encPass), KnownHosts: caKnownHosts}, KindUnknown},
		{"encrypted key file", Config{Address: cs.sshd.Addr, KeyFile: cs.encKey, KeyPassphrase: []byte(cs.encPass), KnownHosts: caKnownHosts}, KindUnknown},
		{"encrypted key, wrong passphrase", Config{Address: cs.sshd.Addr, Key: encPEM, KeyPassphrase: []byte("wrong " + secretMarker), KnownHosts: caKnownHosts}, KindKeyUnreadable},
		{"encrypted key, no passphrase", Config{Address: cs.sshd.Addr, Key: encPEM, KnownHosts: caKnownHosts}, KindKeyUnreadable},
		// The stack's sshd does not authorize the encrypted key.
		{"encrypted key not authorized", Config{Address: cs.env.SSHAddr, Key: encPEM, KeyPassphrase: []byte(cs.encPass), KnownHosts: stackKnownHosts}, KindAuthRefused},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.cfg
			cfg.User = cs.env.SSHUser
			got, err := cs.hostname(t, cfg)
			if tc.want == KindUnknown {
				if err != nil || got != want {
					t.Fatalf("hostname %q, %v; want %q", got, err, want)
				}
				return
			}
			if k := errKind(err); k != tc.want {
				t.Fatalf("kind %v, want %v (err: %v)", k, tc.want, err)
			}
			if s := err.Error(); strings.Contains(s, secretMarker) || strings.Contains(s, cs.encPass) || strings.Contains(s, "PRIVATE KEY") {
				t.Errorf("error shows a secret: %v", err)
			}
		})
	}
}

func TestIntegrationAgent(t *testing.T) {
	t.Cleanup(func() { goleak.VerifyNone(t, goleak.IgnoreCurrent()) })
	env := teststack.Require(t)
	want, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	sock := teststack.StartAgent(t, env.SSHKey)
	empty := teststack.StartAgent(t)
	cfg := Config{Address: env.SSHAddr, User: env.SSHUser, AgentSocket: sock, KnownHostsFile: env.KnownHosts}

	p := newPool(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := p.Client(ctx)
	if err != nil {
		t.Fatalf("Client through the agent's key: %v", err)
	}
	if got, err := libvirtHostname(ctx, env, p, c); err != nil || got != want {
		t.Fatalf("hostname through the agent's key: %q, %v; want %q", got, err, want)
	}
	// A dedicated connection dials the agent again.
	d, err := p.Dedicated(ctx)
	if err != nil {
		t.Fatalf("Dedicated: %v", err)
	}
	if h, err := libvirtHostname(ctx, env, p, d); err != nil || h != want {
		t.Errorf("dedicated: hostname %q %v", h, err)
	}
	// Both links are up, and no agent connection is held by them.
	waitAgentIdle(t, sock)
	p.Kill(d, nil)
	if err := p.Close(); err != nil {
		t.Errorf("Pool Close: %v", err)
	}
	waitAgentIdle(t, sock)

	// An agent without keys: credentials unavailable, sshd never contacted.
	pe := newPool(t, Config{Address: env.SSHAddr, User: env.SSHUser, AgentSocket: empty, KnownHostsFile: env.KnownHosts})
	if _, err := pe.Client(ctx); errKind(err) != KindKeyUnreadable {
		t.Errorf("empty agent: kind %v, want %v (err: %v)", errKind(err), KindKeyUnreadable, err)
	}
	waitAgentIdle(t, empty)
}

// waitAgentIdle waits (bounded) until the agent on sock has no client
// connection: it sees our close only when it next reads the socket.
func waitAgentIdle(t *testing.T, sock string) {
	t.Helper()
	eventually.True(t, 10*time.Second, func() bool { return teststack.AgentConnections(t, sock) == 0 },
		"ssh-agent %s has no connection open", sock)
}
