package guesttest

import (
	"context"
	"net"
	"runtime"

	"golang.org/x/sys/unix"
)

// DialFromNetns returns a DialContext whose connections are opened inside
// the network namespace at path (a /run/netns file): each dial runs on an
// OS thread of its own moved into that namespace, so its socket belongs
// there and keeps its source address wherever it is used afterwards. The
// thread is never moved back: it ends with its goroutine.
func DialFromNetns(path string) func(ctx context.Context, network, address string) (net.Conn, error) {
	return func(ctx context.Context, network, address string) (net.Conn, error) {
		type result struct {
			c   net.Conn
			err error
		}
		done := make(chan result, 1)
		go func() {
			runtime.LockOSThread() // not unlocked: the thread leaves with the goroutine
			fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				done <- result{nil, err}
				return
			}
			err = unix.Setns(fd, unix.CLONE_NEWNET)
			unix.Close(fd)
			if err != nil {
				done <- result{nil, err}
				return
			}
			var d net.Dialer
			c, err := d.DialContext(ctx, network, address)
			done <- result{c, err}
		}()
		r := <-done
		return r.c, r.err
	}
}
