//go:build !linux

package sshconn

import (
	"os"

	"golang.org/x/crypto/ssh"
	"golang.org/x/crypto/ssh/knownhosts"
)

// knownHostsFromBytes returns knownhosts.New's callback for content held in
// memory. knownhosts reads only named files (its database type is not
// exported); without Linux's memfd the content goes through a private
// temporary file, removed before this returns.
func knownHostsFromBytes(content []byte) (ssh.HostKeyCallback, error) {
	f, err := os.CreateTemp("", "egressproxy-known-hosts-*")
	if err != nil {
		return nil, err
	}
	name := f.Name()
	defer os.Remove(name)
	_, werr := f.Write(content)
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr != nil {
		return nil, werr
	}
	cb, err := knownhosts.New(name)
	if err != nil {
		return nil, renameErr{err: err, from: name, to: "Config.KnownHosts"}
	}
	return cb, nil
}
