package sshconn

import (
	"fmt"
	"os"

	"golang.org/x/crypto/ssh"
	"golang.org/x/crypto/ssh/knownhosts"
	"golang.org/x/sys/unix"
)

// knownHostsFromBytes returns knownhosts.New's callback for content held in
// memory. knownhosts reads only named files (its database type is not
// exported), so the content is handed to it as an anonymous in-memory file
// (memfd), opened by its /proc/self/fd name: nothing touches the disk or
// TMPDIR, and the file is gone when this returns.
func knownHostsFromBytes(content []byte) (ssh.HostKeyCallback, error) {
	fd, err := unix.MemfdCreate("egressproxy-known-hosts", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("known_hosts from memory: memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), "Config.KnownHosts")
	defer f.Close()
	if _, err := f.Write(content); err != nil {
		return nil, fmt.Errorf("known_hosts from memory: %w", err)
	}
	name := fmt.Sprintf("/proc/self/fd/%d", fd)
	cb, err := knownhosts.New(name)
	if err != nil {
		return nil, renameErr{err: err, from: name, to: "Config.KnownHosts"}
	}
	return cb, nil
}
