package main

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/crypto/ssh"
)

// writeKVM2Config writes, into a temporary directory, a fresh SSH key, a
// known_hosts file pinning that key for addr (a loopback host:port), and a
// configuration with one kvm2 entry named entry at addr that uses both,
// followed by extra (more YAML of the entry, indented by four spaces). It
// returns the configuration's path.
func writeKVM2Config(t *testing.T, addr, entry, extra string) string {
	t.Helper()
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	_, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	block, err := ssh.MarshalPrivateKey(key, "")
	if err != nil {
		t.Fatal(err)
	}
	signer, err := ssh.NewSignerFromKey(key)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	keyFile, khFile, cfgFile := filepath.Join(dir, "id"), filepath.Join(dir, "known_hosts"), filepath.Join(dir, "ctl.yaml")
	for path, body := range map[string]string{
		keyFile: string(pem.EncodeToMemory(block)),
		khFile:  fmt.Sprintf("[127.0.0.1]:%s %s", port, ssh.MarshalAuthorizedKey(signer.PublicKey())),
		cfgFile: fmt.Sprintf("entries:\n  - entry: %s\n    owner: tests\n    address: %s\n    user: root\n    keyFile: %s\n    knownHostsFile: %s\n    pool: default\n    domainType: qemu\n%s", entry, addr, keyFile, khFile, extra),
	} {
		if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return cfgFile
}
