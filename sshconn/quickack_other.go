//go:build !linux

package sshconn

import "net"

// quickAcker: TCP_QUICKACK is Linux's; elsewhere acknowledgements keep
// the kernel's timing.
func quickAcker(net.Conn) func() { return nil }
