// Package teststack connects tests to the real test stack that
// scripts/teststack starts: an sshd on loopback, a private libvirtd socket
// with an active storage pool, and a squid with an open and an
// authenticating CONNECT port.
//
// It owns reading the stack's environment (the `export K=V` lines printed by
// `scripts/teststack env`, loaded by `make test`) and running the script's
// subcommands from tests. It does not start the stack itself: a test that
// calls Require without the environment is skipped locally and fails in CI
// (CI=true), so a misconfigured CI run can never pass by skipping.
//
// Tests that use it live in files tagged `//go:build integration` and run
// with `go test -race -p 1 -tags integration ./...` (packages serially, so a
// test may stop sshd or restart libvirtd, provided it restores them with
// t.Cleanup before it returns).
package teststack
