// Package e2e holds the end-to-end test of egressproxy (build tag e2e): a real
// proxy guest created by kvm2 through the portable client answers a CONNECT
// with Squid inside the guest, with nothing faked in between.
//
// The test needs root, the real test stack (scripts/teststack), the guest
// image (scripts/guestimage) and a private network namespace
// (scripts/netns); `make test` provides all three and runs it. Outside CI a
// missing piece skips the test with a message naming `make test`; with
// CI=true it fails. See docs/e2e.md.
package e2e
