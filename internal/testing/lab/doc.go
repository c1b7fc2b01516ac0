// Package lab connects tests to the multi-host lab that scripts/lab starts:
// K emulated hypervisors, each in its own network namespace with its own
// libvirtd, sshd, storage pool and libvirt network, joined to the caller's
// namespace by a shaped veth pair, each with a delay proxy in front of its
// sshd (docs/lab.md).
//
// It owns reading the lab's environment (the `export K=V` lines printed by
// `scripts/lab env`). It does not start the lab: a test that calls Require
// without the environment is skipped locally and fails in CI (CI=true), like
// internal/teststack's Require.
package lab
