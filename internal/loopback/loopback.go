// Package loopback tells loopback addresses apart, for the parts of the
// project that must reach nothing beyond the host (memprovider's default
// dialer, the example operator's memory host).
package loopback

import "net"

// HostPort reports whether hostport's host is a loopback IP or
// "localhost" (no name is looked up).
func HostPort(hostport string) bool {
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
