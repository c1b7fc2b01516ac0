// Package guesttest holds what the tests that boot the proxy guest share
// (e2e, the egressproxyctl and operator end-to-end tests): the user-data that starts
// Squid, the check that the test runs inside its private network namespace,
// and a raw libvirt connection to look at and clean up the host (the local
// stack or a lab host). It is for tests only.
package guesttest
