package kvm2

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/egressproxy/egressproxy/internal/errs"
	"golang.org/x/crypto/ssh"
	"golang.org/x/crypto/ssh/knownhosts"
)

const credSecret = "SECRET-kvm2-7c3e"

func testSigner(t *testing.T) ssh.Signer {
	t.Helper()
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	s, err := ssh.NewSignerFromKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestConfigCredentials(t *testing.T) {
	t.Parallel()
	signer := testSigner(t)
	kh := []byte(knownhosts.Line([]string{"[127.0.0.1]:2222"}, signer.PublicKey()) + "\n")
	noCreds := func(c *Config) { c.KeyFile, c.KnownHostsFile = "", "" }
	tests := []struct {
		name   string
		mutate func(*Config)
		signer bool     // Options.Signer is set
		fields []string // nil: valid
	}{
		{"key file and known_hosts file", func(*Config) {}, false, nil},
		{"key and known_hosts as bytes", func(c *Config) { noCreds(c); c.Key, c.KnownHosts = []byte("pem"), kh }, false, nil},
		{"encrypted key bytes", func(c *Config) { noCreds(c); c.Key, c.KeyPassphrase, c.KnownHosts = []byte("pem"), []byte("pw"), kh }, false, nil},
		{"encrypted key file", func(c *Config) { c.KeyPassphrase = []byte("pw") }, false, nil},
		{"signer", func(c *Config) { c.KeyFile = "" }, true, nil},
		{"agent", func(c *Config) { c.KeyFile, c.AgentSocket = "", "/run/ssh-agent.sock" }, false, nil},
		{"no key source", func(c *Config) { c.KeyFile = "" }, false, []string{"KeyFile"}},
		{"key file and key bytes", func(c *Config) { c.Key = []byte("pem") }, false, []string{"KeyFile", "Key"}},
		{"signer and agent", func(c *Config) { c.KeyFile, c.AgentSocket = "", "/a" }, true, []string{"AgentSocket"}},
		{"passphrase for a signer", func(c *Config) { c.KeyFile, c.KeyPassphrase = "", []byte("pw") }, true, []string{"KeyPassphrase"}},
		{"agent socket relative", func(c *Config) { c.KeyFile, c.AgentSocket = "", "agent.sock" }, false, []string{"AgentSocket"}},
		{"no known_hosts", func(c *Config) { c.KnownHostsFile = "" }, false, []string{"KnownHostsFile"}},
		{"known_hosts file and bytes", func(c *Config) { c.KnownHosts = kh }, false, []string{"KnownHostsFile", "KnownHosts"}},
		{"known_hosts bytes without a line", func(c *Config) { c.KnownHostsFile, c.KnownHosts = "", []byte("# nothing\n") }, false, []string{"KnownHosts"}},
		{"nothing at all", noCreds, false, []string{"KeyFile", "KnownHostsFile"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := validConfig()
			tt.mutate(&c)
			opts := &Options{}
			if tt.signer {
				opts.Signer = signer
			}
			_, err := c.validate(tt.signer)
			if tt.fields == nil {
				if err != nil {
					t.Fatalf("validate: %v", err)
				}
				return
			}
			if errs.Code(err) != errs.Permanent {
				t.Errorf("code = %v, want Permanent (err %v)", errs.Code(err), err)
			}
			var got []string
			for _, fe := range errs.FieldErrors(err) {
				got = append(got, fe.Field)
			}
			if strings.Join(got, ",") != strings.Join(tt.fields, ",") {
				t.Errorf("fields %v, want %v (err: %v)", got, tt.fields, err)
			}
			// Open reports the same, before touching anything.
			if _, oerr := open(context.Background(), c, opts); errs.Code(oerr) != errs.Permanent ||
				!strings.Contains(oerr.Error(), tt.fields[0]) {
				t.Errorf("Open: %v", oerr)
			}
		})
	}
}

// Key, KeyPassphrase and Options.Signer never appear in a marshalled Config or in
// an error; AgentSocket and KnownHosts marshal under their camelCase names.
func TestConfigCredentialsMarshal(t *testing.T) {
	t.Parallel()
	signer := testSigner(t)
	c := validConfig()
	c.KeyFile = ""
	c.Key = []byte("-----BEGIN OPENSSH PRIVATE KEY-----\n" + credSecret)
	c.KeyPassphrase = []byte(credSecret)
	c.AgentSocket = "agent.sock" // relative: invalid, so validation fails
	c.KnownHostsFile = ""
	c.KnownHosts = []byte(knownhosts.Line([]string{"h"}, signer.PublicKey()) + "\n")
	js, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(js), credSecret) || strings.Contains(string(js), "PRIVATE KEY") {
		t.Errorf("marshalled config shows a secret: %s", js)
	}
	var m map[string]any
	if err := json.Unmarshal(js, &m); err != nil {
		t.Fatal(err)
	}
	if m["agentSocket"] != "agent.sock" || m["knownHosts"] == nil {
		t.Errorf("agentSocket/knownHosts not marshalled by name: %s", js)
	}
	var back Config
	if err := json.Unmarshal(js, &back); err != nil {
		t.Fatal(err)
	}
	if string(back.KnownHosts) != string(c.KnownHosts) || back.Key != nil || back.KeyPassphrase != nil {
		t.Errorf("round trip: %+v", back)
	}
	_, verr := c.validate(true)
	_, oerr := open(context.Background(), c, &Options{Signer: signer})
	for _, err := range []error{verr, oerr} {
		if err == nil {
			t.Fatal("an invalid config was accepted")
		}
		if s := fmt.Sprint(err); strings.Contains(s, credSecret) || strings.Contains(s, "PRIVATE KEY") {
			t.Errorf("error shows a secret: %s", s)
		}
		if !errors.Is(err, errs.ErrPermanent) {
			t.Errorf("not Permanent: %v", err)
		}
	}
}
