// Package e2e holds the end-to-end test of egressproxy (build tag e2e): a real
// proxy guest created by kvm2 through the portable client answers a CONNECT
// with Squid inside the guest, with nothing faked in between.
//
// The guest boots on lab host 1 when the multi-host lab's environment is
// loaded (scripts/lab env; docs/lab.md), and the CONNECT crosses that host's
// link both ways; without the lab it boots on the local stack
// (scripts/teststack) in a NAT network of the test's own. It needs root, the
// guest image (scripts/guestimage) and, without the lab, a private network
// namespace (scripts/netns); `make test` provides them all (the lab too) and
// runs it. Outside CI a missing piece skips the test with a message naming
// `make test`; with CI=true it fails, and a missing lab fails too. See
// docs/e2e.md.
package e2e
