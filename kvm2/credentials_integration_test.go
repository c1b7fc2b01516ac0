//go:build integration

package kvm2

import (
	"os"
	"testing"

	"github.com/go-logr/logr/testr"
	"golang.org/x/crypto/ssh"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// The credential fields reach sshconn: a provider configured only with
// values (key and known_hosts as bytes, an ssh.Signer, or an ssh-agent) is
// reachable, and one whose key cannot be decrypted reports
// CredentialsUnavailable.
func TestIntegrationCredentialsAsValues(t *testing.T) {
	env := teststack.Require(t)
	key, err := os.ReadFile(env.SSHKey)
	if err != nil {
		t.Fatal(err)
	}
	knownHosts, err := os.ReadFile(env.KnownHosts)
	if err != nil {
		t.Fatal(err)
	}
	signer, err := ssh.ParsePrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	agent := teststack.StartAgent(t, env.SSHKey)
	tests := []struct {
		name   string
		mutate func(c *Config)
		want   egressproxy.HealthReason
	}{
		{"key and known_hosts as bytes", func(c *Config) {
			c.KeyFile, c.Key, c.KnownHostsFile, c.KnownHosts = "", key, "", knownHosts
		}, egressproxy.ReasonNone},
		{"ssh-agent", func(c *Config) { c.KeyFile, c.AgentSocket = "", agent }, egressproxy.ReasonNone},
		// The embedder's own ssh.Signer (a token, a KMS) is the only key.
		{"signer", func(c *Config) { c.KeyFile, c.Signer = "", signer }, egressproxy.ReasonNone},
		{"passphrase for an unencrypted key", func(c *Config) {
			c.KeyFile, c.Key, c.KeyPassphrase = "", key, []byte("not this key's")
		}, egressproxy.ReasonCredentialsUnavailable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := stackConfig(t)
			tt.mutate(&cfg)
			p := openT(t, cfg, testr.New(t))
			h := checkT(t, p)
			if h.Reason != tt.want || h.Reachable != (tt.want == egressproxy.ReasonNone) {
				t.Fatalf("Check = reachable %v reason %q (%s), want reason %q", h.Reachable, h.Reason, h.Message, tt.want)
			}
		})
	}
}
