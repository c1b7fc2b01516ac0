//go:build integration

package kvm2

import (
	"context"
	"os"
	"testing"

	"github.com/go-logr/logr/testr"
	"golang.org/x/crypto/ssh"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// The credential fields reach sshconn: a provider configured only with
// values (key and known_hosts as bytes, Options.Signer, or an ssh-agent) is
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
		mutate func(c *Config, o *Options)
		want   egressproxy.HealthReason
	}{
		{"key and known_hosts as bytes", func(c *Config, _ *Options) {
			c.KeyFile, c.Key, c.KnownHostsFile, c.KnownHosts = "", key, "", knownHosts
		}, egressproxy.ReasonNone},
		{"ssh-agent", func(c *Config, _ *Options) { c.KeyFile, c.AgentSocket = "", agent }, egressproxy.ReasonNone},
		// The embedder's own ssh.Signer (a token, a KMS) is the only key.
		{"signer", func(c *Config, o *Options) { c.KeyFile, o.Signer = "", signer }, egressproxy.ReasonNone},
		{"passphrase for an unencrypted key", func(c *Config, _ *Options) {
			c.KeyFile, c.Key, c.KeyPassphrase = "", key, []byte("not this key's")
		}, egressproxy.ReasonCredentialsUnavailable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := stackConfig(t)
			opts := &Options{Logger: testr.New(t)}
			tt.mutate(&cfg, opts)
			p, err := open(context.Background(), cfg, opts)
			if err != nil {
				t.Fatalf("Open: %v", err)
			}
			t.Cleanup(func() { p.Close() })
			h := checkT(t, p)
			if h.Reason != tt.want || h.Reachable != (tt.want == egressproxy.ReasonNone) {
				t.Fatalf("Check = reachable %v reason %q (%s), want reason %q", h.Reachable, h.Reason, h.Message, tt.want)
			}
		})
	}
}
