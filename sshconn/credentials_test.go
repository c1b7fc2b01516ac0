package sshconn

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/internal/testing/sshtest"
	"golang.org/x/crypto/ssh"
	"golang.org/x/crypto/ssh/agent"
	"golang.org/x/crypto/ssh/knownhosts"
)

func TestValidateCredentials(t *testing.T) {
	t.Parallel()
	signer := sshtest.Signer(t, sshtest.GenEd25519(t))
	base := Config{Address: "127.0.0.1:22", User: "root"}
	khLine := []byte(knownhosts.Line([]string{"host"}, signer.PublicKey()) + "\n")
	withSigner := &Options{Signer: signer}
	tests := []struct {
		name   string
		edit   func(*Config)
		opts   *Options
		fields []string // nil: valid
	}{
		{"key file", func(c *Config) { c.KeyFile, c.KnownHostsFile = "/k", "/kh" }, nil, nil},
		{"key bytes", func(c *Config) { c.Key, c.KnownHosts = []byte("pem"), khLine }, nil, nil},
		{"key bytes with passphrase", func(c *Config) { c.Key, c.KeyPassphrase, c.KnownHostsFile = []byte("pem"), []byte("pw"), "/kh" }, nil, nil},
		{"key file with passphrase", func(c *Config) { c.KeyFile, c.KeyPassphrase, c.KnownHostsFile = "/k", []byte("pw"), "/kh" }, nil, nil},
		{"signer", func(c *Config) { c.KnownHostsFile = "/kh" }, withSigner, nil},
		{"agent", func(c *Config) { c.AgentSocket, c.KnownHostsFile = "/run/agent.sock", "/kh" }, nil, nil},
		{"no key source", func(c *Config) { c.KnownHostsFile = "/kh" }, nil, []string{"KeyFile"}},
		{"two key sources", func(c *Config) { c.KeyFile, c.Key, c.KnownHostsFile = "/k", []byte("pem"), "/kh" }, nil, []string{"KeyFile", "Key"}},
		{"all key sources", func(c *Config) {
			c.KeyFile, c.Key, c.AgentSocket, c.KnownHostsFile = "/k", []byte("pem"), "/a", "/kh"
		}, withSigner, []string{"KeyFile", "Key", "AgentSocket", "Signer"}},
		{"passphrase without key", func(c *Config) { c.KeyPassphrase, c.KnownHostsFile = []byte("pw"), "/kh" }, withSigner, []string{"KeyPassphrase"}},
		{"relative agent socket", func(c *Config) { c.AgentSocket, c.KnownHostsFile = "agent.sock", "/kh" }, nil, []string{"AgentSocket"}},
		{"no known_hosts", func(c *Config) { c.KeyFile = "/k" }, nil, []string{"KnownHostsFile"}},
		{"both known_hosts", func(c *Config) { c.KeyFile, c.KnownHostsFile, c.KnownHosts = "/k", "/kh", khLine }, nil, []string{"KnownHostsFile", "KnownHosts"}},
		{"known_hosts bytes without a valid line", func(c *Config) { c.KeyFile, c.KnownHosts = "/k", []byte("# only a comment\nnot a line\n") }, nil, []string{"KnownHosts"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := base
			tc.edit(&c)
			p, err := New(c, tc.opts)
			if tc.fields == nil {
				if err != nil {
					t.Fatalf("New: %v", err)
				}
				_ = p.Close()
				return
			}
			if errKind(err) != KindConfig {
				t.Fatalf("New: kind %v (err %v), want %v", errKind(err), err, KindConfig)
			}
			if got := fieldsOf(err); strings.Join(got, ",") != strings.Join(tc.fields, ",") {
				t.Errorf("fields %v, want %v (err: %v)", got, tc.fields, err)
			}
		})
	}
}

// secretMarker is in every secret a test puts in a Config; it must never
// show up in text.
const secretMarker = "SECRET-4a1f"

func TestConfigTextHasNoSecrets(t *testing.T) {
	t.Parallel()
	signer := sshtest.Signer(t, sshtest.GenEd25519(t))
	c := Config{Address: "127.0.0.1:22", User: "root",
		Key: []byte("-----BEGIN " + secretMarker + "-----"), KeyPassphrase: []byte(secretMarker),
		KnownHosts: []byte(plainLine("host", signer.PublicKey()) + "\n")}
	js, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{c.String(), fmt.Sprint(c), fmt.Sprintf("%+v", c), fmt.Sprintf("%#v", c),
		fmt.Sprintf("%v", &c), string(js)} {
		if strings.Contains(s, secretMarker) || strings.Contains(s, "BEGIN") {
			t.Errorf("text shows a secret: %s", s)
		}
	}
	if s := c.String(); !strings.Contains(s, "Key: [redacted") || !strings.Contains(s, "KnownHosts: [") {
		t.Errorf("String does not name the key sources: %s", s)
	}
	// New keeps its own copies of the byte fields.
	p, err := New(Config{Address: "127.0.0.1:22", User: "u", Key: c.Key, KnownHosts: c.KnownHosts}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	c.Key[0], c.KnownHosts[0] = 'x', 'x'
	if p.cfg.Key[0] == 'x' || p.cfg.KnownHosts[0] == 'x' {
		t.Error("New aliases the caller's buffers")
	}
}

// hostCert returns a host certificate of hostKey signed by ca, valid for
// principals (none: any host) during [after, before).
func hostCert(t *testing.T, ca ssh.Signer, hostKey ssh.PublicKey, after, before time.Time, principals ...string) *ssh.Certificate {
	t.Helper()
	cert := &ssh.Certificate{
		Key: hostKey, Serial: 7, CertType: ssh.HostCert, KeyId: "test-host",
		ValidPrincipals: principals,
		ValidAfter:      uint64(after.Unix()), ValidBefore: uint64(before.Unix()),
	}
	if err := cert.SignCert(rand.Reader, ca); err != nil {
		t.Fatal(err)
	}
	return cert
}

func caLine(patterns string, ca ssh.PublicKey) string {
	return "@cert-authority " + patterns + " " + strings.TrimSpace(string(ssh.MarshalAuthorizedKey(ca)))
}

func plainLine(patterns string, k ssh.PublicKey) string {
	return patterns + " " + strings.TrimSpace(string(ssh.MarshalAuthorizedKey(k)))
}

func revokedLine(k ssh.PublicKey) string {
	return "@revoked * " + strings.TrimSpace(string(ssh.MarshalAuthorizedKey(k)))
}

// TestKnownHostsCases checks the host key callback, from bytes and from a
// file alike, for the known_hosts features an operator relies on.
func TestKnownHostsCases(t *testing.T) {
	t.Parallel()
	host := sshtest.Signer(t, sshtest.GenEd25519(t)).PublicKey()
	other := sshtest.Signer(t, sshtest.GenEd25519(t)).PublicKey()
	ca := sshtest.Signer(t, sshtest.GenEd25519(t))
	otherCA := sshtest.Signer(t, sshtest.GenEd25519(t))
	now := time.Now()
	valid := func(principals ...string) *ssh.Certificate {
		return hostCert(t, ca, host, now.Add(-time.Hour), now.Add(time.Hour), principals...)
	}
	tests := []struct {
		name  string
		lines []string
		addr  string
		key   ssh.PublicKey
		want  Kind // KindUnknown: accepted
	}{
		{"plain port 22", []string{plainLine("h.example.com", host)}, "h.example.com:22", host, KindUnknown},
		{"[host]:port", []string{plainLine("[10.0.0.5]:2222", host)}, "10.0.0.5:2222", host, KindUnknown},
		{"[host]:port does not pin port 22", []string{plainLine("[10.0.0.5]:2222", host)}, "10.0.0.5:22", host, KindHostUnknown},
		{"host without port does not pin 2222", []string{plainLine("10.0.0.5", host)}, "10.0.0.5:2222", host, KindHostUnknown},
		{"hashed name", []string{plainLine(knownhosts.HashHostname("h.example.com"), host)}, "h.example.com:22", host, KindUnknown},
		{"hashed [host]:port", []string{plainLine(knownhosts.HashHostname(knownhosts.Normalize("10.0.0.5:2222")), host)}, "10.0.0.5:2222", host, KindUnknown},
		{"hashed name of another host", []string{plainLine(knownhosts.HashHostname("g.example.com"), host)}, "h.example.com:22", host, KindHostUnknown},
		{"wildcard", []string{plainLine("*.example.com", host)}, "h.example.com:22", host, KindUnknown},
		{"negated pattern", []string{plainLine("*.example.com,!h.example.com", host)}, "h.example.com:22", host, KindHostUnknown},
		{"mismatch", []string{plainLine("h.example.com", other)}, "h.example.com:22", host, KindHostKeyMismatch},
		{"revoked plain key", []string{plainLine("h.example.com", host), revokedLine(host)}, "h.example.com:22", host, KindHostKeyMismatch},
		{"cert accepted by CA", []string{caLine("*.example.com", ca.PublicKey())}, "h.example.com:22", valid("h.example.com"), KindUnknown},
		{"cert accepted by CA with [pattern]:port", []string{caLine("[10.0.0.*]:2222", ca.PublicKey())}, "10.0.0.5:2222", valid("10.0.0.5"), KindUnknown},
		// Go's knownhosts reads a pattern without brackets as port 22 only
		// (OpenSSH would match "[10.0.0.5]:2222" against "*" too): a CA for
		// every host on another port is "[*]:2222".
		{"cert, CA pattern * is port 22 only", []string{caLine("*", ca.PublicKey())}, "10.0.0.5:2222", valid("10.0.0.5"), KindHostUnknown},
		{"cert, CA pattern [*]:port", []string{caLine("[*]:2222", ca.PublicKey())}, "10.0.0.5:2222", valid("10.0.0.5"), KindUnknown},
		{"cert, CA pattern *", []string{caLine("*", ca.PublicKey())}, "10.0.0.5:22", valid("10.0.0.5"), KindUnknown},
		{"cert, CA for other hosts", []string{caLine("*.example.org", ca.PublicKey())}, "h.example.com:22", valid("h.example.com"), KindHostUnknown},
		{"cert, CA negated for the host", []string{caLine("*.example.com,!h.example.com", ca.PublicKey())}, "h.example.com:22", valid("h.example.com"), KindHostUnknown},
		{"cert, another CA", []string{caLine("*.example.com", otherCA.PublicKey())}, "h.example.com:22", valid("h.example.com"), KindHostKeyMismatch},
		{"cert, CA revoked", []string{caLine("*.example.com", ca.PublicKey()), revokedLine(ca.PublicKey())}, "h.example.com:22", valid("h.example.com"), KindHostKeyMismatch},
		{"cert, host key revoked", []string{caLine("*.example.com", ca.PublicKey()), revokedLine(host)}, "h.example.com:22", valid("h.example.com"), KindHostKeyMismatch},
		{"cert, wrong principal", []string{caLine("*.example.com", ca.PublicKey())}, "h.example.com:22", valid("g.example.com"), KindHostKeyMismatch},
		{"cert expired", []string{caLine("*.example.com", ca.PublicKey())}, "h.example.com:22", hostCert(t, ca, host, now.Add(-2*time.Hour), now.Add(-time.Hour), "h.example.com"), KindHostKeyMismatch},
		{"plain key, only a CA for the host", []string{caLine("*.example.com", ca.PublicKey())}, "h.example.com:22", host, KindHostUnknown},
		{"comments and a bad line are skipped", []string{"# comment", "", "garbage line", plainLine("h.example.com", host)}, "h.example.com:22", host, KindUnknown},
	}
	dir := t.TempDir()
	for i, tc := range tests {
		content := []byte(strings.Join(tc.lines, "\n") + "\n")
		file := filepath.Join(dir, fmt.Sprintf("kh%d", i))
		if err := os.WriteFile(file, content, 0o600); err != nil {
			t.Fatal(err)
		}
		for _, src := range []string{"bytes", "file"} {
			t.Run(tc.name+"/"+src, func(t *testing.T) {
				cfg := Config{Address: tc.addr}
				if src == "bytes" {
					cfg.KnownHosts = content
				} else {
					cfg.KnownHostsFile = file
				}
				hk, err := loadKnownHosts(cfg)
				if err != nil {
					t.Fatalf("loadKnownHosts: %v", err)
				}
				err = hk.check(tc.addr, &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 22}, tc.key)
				if tc.want == KindUnknown {
					if err != nil {
						t.Fatalf("refused: %v", err)
					}
					return
				}
				if err == nil {
					t.Fatal("accepted")
				}
				if got := classifyHandshake(fmt.Errorf("ssh: handshake failed: %w", err)); got != tc.want {
					t.Errorf("kind %v, want %v (err: %v)", got, tc.want, err)
				}
				if !strings.Contains(err.Error(), "SHA256:") {
					t.Errorf("error does not show the presented key: %v", err)
				}
			})
		}
	}
}

// Certificate algorithms come first exactly when a CA line matches the
// host; pinned plain types come before the other plain types.
func TestHostKeyAlgorithmsWithCA(t *testing.T) {
	t.Parallel()
	ca := sshtest.Signer(t, sshtest.GenEd25519(t)).PublicKey()
	ec := sshtest.Signer(t, sshtest.GenECDSA(t)).PublicKey()
	for _, tc := range []struct {
		name      string
		lines     []string
		firstCert bool
		first     string
	}{
		{"CA for the host", []string{caLine("*.example.com", ca)}, true, ""},
		{"CA and pinned ecdsa", []string{caLine("*.example.com", ca), plainLine("h.example.com", ec)}, true, ""},
		{"CA for other hosts, pinned ecdsa", []string{caLine("*.example.org", ca), plainLine("h.example.com", ec)}, false, ssh.KeyAlgoECDSA256},
		{"nothing for the host", []string{plainLine("g.example.com", ec)}, false, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hk, err := loadKnownHosts(Config{Address: "h.example.com:22", KnownHosts: []byte(strings.Join(tc.lines, "\n"))})
			if err != nil {
				t.Fatal(err)
			}
			certs := 0
			for _, a := range hk.algos {
				if strings.Contains(a, "-cert-") {
					certs++
				}
			}
			if tc.firstCert != (certs > 0) || (tc.firstCert && !strings.Contains(hk.algos[0], "-cert-")) {
				t.Errorf("algorithms %v: certificate algorithms first = %v, want %v", hk.algos, certs > 0, tc.firstCert)
			}
			if tc.first != "" && hk.algos[0] != tc.first {
				t.Errorf("algorithms %v, want %s first", hk.algos, tc.first)
			}
			if tc.firstCert {
				if i := indexOf(hk.algos, ssh.KeyAlgoECDSA256); len(tc.lines) > 1 && i != certs {
					t.Errorf("pinned ecdsa at %d of %v, want right after the %d certificate algorithms", i, hk.algos, certs)
				}
			}
		})
	}
}

func indexOf(s []string, v string) int {
	for i, x := range s {
		if x == v {
			return i
		}
	}
	return -1
}

// Building the callback from bytes leaves no file descriptor behind.
func TestKnownHostsBytesNoFDLeak(t *testing.T) {
	fds := func() int {
		ents, err := os.ReadDir("/proc/self/fd")
		if err != nil {
			t.Skipf("no /proc/self/fd: %v", err)
		}
		return len(ents)
	}
	k := sshtest.Signer(t, sshtest.GenEd25519(t)).PublicKey()
	cfg := Config{Address: "h:22", KnownHosts: []byte(plainLine("h", k) + "\n")}
	before := fds()
	for range 50 {
		if _, err := loadKnownHosts(cfg); err != nil {
			t.Fatal(err)
		}
	}
	if after := fds(); after > before+2 {
		t.Errorf("open fds %d -> %d after 50 loads", before, after)
	}
	// Content that knownhosts refuses names the field, not the memfd.
	_, err := loadKnownHosts(Config{Address: "h:22", KnownHosts: []byte("@bogus-marker h ssh-ed25519 AAAA\n")})
	if errKind(err) != KindHostUnknown || !strings.Contains(err.Error(), "Config.KnownHosts") || strings.Contains(err.Error(), "/proc/") {
		t.Errorf("bad content: %v", err)
	}
}

// testAgent is an in-process ssh-agent on a unix socket that counts the
// connections it serves.
type testAgent struct {
	path   string
	ln     net.Listener
	wg     sync.WaitGroup
	mu     sync.Mutex
	open   int
	served int
	ended  chan struct{} // one value per connection served to its end
}

func startAgent(t *testing.T, keys ...any) *testAgent {
	t.Helper()
	kr := agent.NewKeyring()
	for _, k := range keys {
		if err := kr.Add(agent.AddedKey{PrivateKey: k}); err != nil {
			t.Fatal(err)
		}
	}
	a := &testAgent{path: filepath.Join(t.TempDir(), "agent.sock"), ended: make(chan struct{}, 64)}
	ln, err := net.Listen("unix", a.path)
	if err != nil {
		t.Fatal(err)
	}
	a.ln = ln
	a.wg.Add(1)
	go func() {
		defer a.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			a.mu.Lock()
			a.open++
			a.served++
			a.mu.Unlock()
			a.wg.Add(1)
			go func() {
				defer a.wg.Done()
				_ = agent.ServeAgent(kr, c)
				_ = c.Close()
				a.mu.Lock()
				a.open--
				a.mu.Unlock()
				a.ended <- struct{}{}
			}()
		}
	}()
	t.Cleanup(a.stop)
	return a
}

func (a *testAgent) stop() {
	_ = a.ln.Close()
	a.wg.Wait()
}

// waitIdle waits (bounded) until the agent has no connection open: it
// notices a client's close only when it reads EOF, after the dial returned.
func (a *testAgent) waitIdle(t *testing.T) {
	t.Helper()
	timeout := time.After(5 * time.Second)
	for {
		if open, _ := a.counts(); open == 0 {
			return
		}
		select {
		case <-a.ended:
		case <-timeout:
			open, _ := a.counts()
			t.Errorf("agent %s: %d connections left open after the dial", a.path, open)
			return
		}
	}
}

func (a *testAgent) counts() (open, served int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.open, a.served
}

// encryptedPEM returns priv as an OpenSSH private key encrypted with pass.
func encryptedPEM(t *testing.T, priv any, pass string) []byte {
	t.Helper()
	blk, err := ssh.MarshalPrivateKeyWithPassphrase(priv, "", []byte(pass))
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(blk)
}

func TestDialKeySources(t *testing.T) {
	f := newFixture(t)
	plainPEM, err := os.ReadFile(f.keyFile)
	if err != nil {
		t.Fatal(err)
	}
	const pass = "correct horse " + secretMarker
	// One encrypted key only: x/crypto encrypts with 16 bcrypt rounds, slow
	// under -race. The real-stack test covers encrypted key files and a
	// wrong passphrase with a key made by ssh-keygen -a 4.
	encPEM := encryptedPEM(t, f.clientPriv, pass)
	knownHosts, err := os.ReadFile(f.knownHosts)
	if err != nil {
		t.Fatal(err)
	}
	goodAgent := startAgent(t, f.clientPriv)
	emptyAgent := startAgent(t)
	otherAgent := startAgent(t, sshtest.GenEd25519(t))
	signer := &Options{Signer: sshtest.Signer(t, f.clientPriv)}
	tests := []struct {
		name      string
		edit      func(*Config)
		want      Kind // KindUnknown: connects
		noNetwork bool
		opts      *Options
	}{
		{"key bytes", func(c *Config) { c.KeyFile, c.Key = "", plainPEM }, KindUnknown, false, nil},
		{"key bytes and known_hosts bytes", func(c *Config) { c.KeyFile, c.Key, c.KnownHostsFile, c.KnownHosts = "", plainPEM, "", knownHosts }, KindUnknown, false, nil},
		{"encrypted key bytes", func(c *Config) { c.KeyFile, c.Key, c.KeyPassphrase = "", encPEM, []byte(pass) }, KindUnknown, false, nil},
		{"signer", func(c *Config) { c.KeyFile = "" }, KindUnknown, false, signer},
		{"agent", func(c *Config) { c.KeyFile, c.AgentSocket = "", goodAgent.path }, KindUnknown, false, nil},
		{"encrypted key without passphrase", func(c *Config) { c.KeyFile, c.Key = "", encPEM }, KindKeyUnreadable, true, nil},
		{"passphrase for an unencrypted key", func(c *Config) { c.KeyFile, c.Key, c.KeyPassphrase = "", plainPEM, []byte(secretMarker) }, KindKeyUnreadable, true, nil},
		{"garbage key bytes", func(c *Config) { c.KeyFile, c.Key = "", []byte("not a key "+secretMarker) }, KindKeyUnreadable, true, nil},
		{"agent socket missing", func(c *Config) { c.KeyFile, c.AgentSocket = "", filepath.Join(f.dir, "no-agent") }, KindKeyUnreadable, true, nil},
		{"agent without keys", func(c *Config) { c.KeyFile, c.AgentSocket = "", emptyAgent.path }, KindKeyUnreadable, true, nil},
		{"agent with another key", func(c *Config) { c.KeyFile, c.AgentSocket = "", otherAgent.path }, KindAuthRefused, false, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := f.config()
			tc.edit(&cfg)
			p := newPoolWith(t, cfg, tc.opts)
			before := f.srv.Accepts()
			// Generous: decrypting a key runs bcrypt, which is slow under -race.
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			c, err := p.Client(ctx)
			if tc.want == KindUnknown {
				if err != nil {
					t.Fatalf("Client: %v", err)
				}
				if _, _, err := c.SendRequest("keepalive@openssh.com", true, nil); err != nil {
					t.Fatalf("request on the client: %v", err)
				}
				if cfg.Key != nil || cfg.KeyFile != "" {
					// A redial reuses the parsed key (no second bcrypt).
					p.Kill(c, errors.New("test: redial"))
					start := time.Now()
					if _, err := p.Client(ctx); err != nil {
						t.Fatalf("Client after Kill: %v", err)
					}
					if p.keys.signer == nil {
						t.Error("the parsed key was not kept")
					}
					t.Logf("redial: %v", time.Since(start))
				}
			} else {
				if got := errKind(err); got != tc.want {
					t.Fatalf("kind %v, want %v (err: %v)", got, tc.want, err)
				}
				if s := err.Error(); strings.Contains(s, secretMarker) || strings.Contains(s, "PRIVATE KEY") {
					t.Errorf("error shows a secret: %v", err)
				}
				if tc.noNetwork && f.srv.Accepts() != before {
					t.Errorf("the server was contacted although the failure is local")
				}
			}
			// No agent connection outlives the dial.
			for _, a := range []*testAgent{goodAgent, emptyAgent, otherAgent} {
				a.waitIdle(t)
			}
		})
	}
	if _, served := goodAgent.counts(); served != 1 {
		t.Errorf("agent served %d connections, want 1 (one dial)", served)
	}
}

// A host presenting a certificate is accepted through an @cert-authority
// line (the algorithms offered make it present the certificate), refused
// when the CA is revoked or absent.
func TestDialHostCertificate(t *testing.T) {
	ca := sshtest.Signer(t, sshtest.GenEd25519(t))
	hostSigner := sshtest.Signer(t, sshtest.GenEd25519(t))
	now := time.Now()
	cert := hostCert(t, ca, hostSigner.PublicKey(), now.Add(-time.Hour), now.Add(time.Hour), "127.0.0.1")
	certSigner, err := ssh.NewCertSigner(cert, hostSigner)
	if err != nil {
		t.Fatal(err)
	}
	f := newFixture(t, certSigner, hostSigner)
	_, port, _ := net.SplitHostPort(f.srv.Addr)
	pattern := "[127.0.0.*]:" + port
	tests := []struct {
		name  string
		lines []string
		want  Kind
	}{
		{"CA line", []string{caLine(pattern, ca.PublicKey())}, KindUnknown},
		{"CA line and a stale plain pin", []string{caLine(pattern, ca.PublicKey()), plainLine(knownhosts.Normalize(f.srv.Addr), sshtest.Signer(t, sshtest.GenEd25519(t)).PublicKey())}, KindUnknown},
		{"CA revoked", []string{caLine(pattern, ca.PublicKey()), revokedLine(ca.PublicKey())}, KindHostKeyMismatch},
		{"host key revoked", []string{caLine(pattern, ca.PublicKey()), revokedLine(hostSigner.PublicKey())}, KindHostKeyMismatch},
		{"CA absent", []string{caLine("[10.0.0.1]:22", ca.PublicKey())}, KindHostUnknown},
		{"CA absent, plain pin", []string{plainLine(knownhosts.Normalize(f.srv.Addr), hostSigner.PublicKey())}, KindUnknown},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := f.config()
			cfg.KnownHostsFile, cfg.KnownHosts = "", []byte(strings.Join(tc.lines, "\n")+"\n")
			p := newPool(t, cfg)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, err := p.Client(ctx)
			if tc.want == KindUnknown {
				if err != nil {
					t.Fatalf("Client: %v", err)
				}
				return
			}
			if got := errKind(err); got != tc.want {
				t.Fatalf("kind %v, want %v (err: %v)", got, tc.want, err)
			}
		})
	}
}
