package sshconn

import (
	"net"
	"syscall"
)

// quickAcker returns a function that makes the kernel acknowledge what c
// received at once (TCP_QUICKACK), or nil when c is not a TCP socket.
func quickAcker(c net.Conn) func() {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	set := func(fd uintptr) { _ = syscall.SetsockoptInt(int(fd), syscall.IPPROTO_TCP, syscall.TCP_QUICKACK, 1) }
	return func() { _ = rc.Control(set) }
}
