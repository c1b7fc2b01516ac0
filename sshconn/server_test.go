package sshconn

import (
	"crypto/ed25519"
	"testing"

	"golang.org/x/crypto/ssh"

	"github.com/egressproxy/egressproxy/internal/testing/sshtest"
)

// fixture is a test server plus the client files that reach it.
type fixture struct {
	srv        *sshtest.Server
	dir        string
	keyFile    string
	knownHosts string
	clientPriv ed25519.PrivateKey
}

func newFixture(t *testing.T, hostKeys ...ssh.Signer) *fixture {
	t.Helper()
	x := sshtest.NewFixture(t, hostKeys...)
	return &fixture{srv: x.Server, dir: x.Dir, keyFile: x.KeyFile, knownHosts: x.KnownHosts, clientPriv: x.ClientKey}
}

func (f *fixture) config() Config {
	return Config{Address: f.srv.Addr, User: "root", KeyFile: f.keyFile, KnownHostsFile: f.knownHosts}
}
