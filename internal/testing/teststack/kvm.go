package teststack

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// DevKVM is the KVM device libvirt and QEMU open.
const DevKVM = "/dev/kvm"

// qemuCapsCache is where libvirtd caches what it probed of each QEMU binary
// (a tmpfs of its own inside scripts/netns).
const qemuCapsCache = "/var/cache/libvirt/qemu/capabilities"

// HideKVM makes the stack's libvirtd see a host without usable KVM until t
// ends: it binds /dev/null over /dev/kvm, clears libvirt's QEMU
// capabilities cache (libvirt keeps a cached "KVM works" while /dev/kvm
// stays accessible, and /dev/null is) and restarts libvirtd, which then
// probes QEMU afresh and offers only TCG. t.Cleanup undoes it in reverse:
// unmount, clear the cache again, restart libvirtd.
//
// It refuses (skips locally, fails in CI) unless the test runs as root in
// libvirtd's mount namespace and that namespace is a private one (as
// scripts/netns and `make test` give): anywhere else the bind mount would
// either not reach libvirtd or hide /dev/kvm from the whole machine. On a
// host without /dev/kvm there is nothing to hide and it only returns.
func HideKVM(t testing.TB) {
	t.Helper()
	Require(t)
	if err := privateLibvirtdNamespace(Run(t, "libvirtd-pid")); err != nil {
		if InCI() {
			t.Fatalf("teststack: cannot hide %s: %v", DevKVM, err)
		}
		t.Skipf("teststack: cannot hide %s: %v", DevKVM, err)
	}
	if _, err := os.Stat(DevKVM); os.IsNotExist(err) {
		t.Logf("teststack: %s does not exist: the host offers no KVM already", DevKVM)
		return
	}
	if err := syscall.Mount("/dev/null", DevKVM, "", syscall.MS_BIND, ""); err != nil {
		t.Fatalf("teststack: bind /dev/null over %s: %v", DevKVM, err)
	}
	t.Cleanup(func() {
		if err := syscall.Unmount(DevKVM, 0); err != nil {
			t.Errorf("teststack: unmount %s: %v", DevKVM, err)
		}
		if err := clearQEMUCapsCache(); err != nil {
			t.Errorf("teststack: %v", err)
		}
		Run(t, "libvirtd-restart")
	})
	if err := clearQEMUCapsCache(); err != nil {
		t.Fatalf("teststack: %v", err)
	}
	Run(t, "libvirtd-restart")
}

// privateLibvirtdNamespace returns why binding over /dev/kvm here would not
// be confined to the stack's libvirtd of pid, or nil.
func privateLibvirtdNamespace(pid string) error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("needs root")
	}
	self, err := os.Readlink("/proc/self/ns/mnt")
	if err != nil {
		return err
	}
	daemon, err := os.Readlink(filepath.Join("/proc", strings.TrimSpace(pid), "ns", "mnt"))
	if err != nil {
		return fmt.Errorf("libvirtd's mount namespace: %w", err)
	}
	if self != daemon {
		return fmt.Errorf("the test's mount namespace %s is not libvirtd's %s (run the test inside the stack's namespace, e.g. `make test`)", self, daemon)
	}
	// scripts/netns mounts libvirt's state dirs as tmpfs named "egp-netns"
	// in the mount namespace it unshares: that mount is the proof.
	if init, err := os.Readlink("/proc/1/ns/mnt"); (err == nil && init == self) || !netnsMount(qemuCapsCache) {
		return fmt.Errorf("the stack does not run in a private mount namespace of scripts/netns: the bind mount would hide %s from the whole machine", DevKVM)
	}
	return nil
}

// netnsMount reports whether dir is on a tmpfs that scripts/netns mounted.
func netnsMount(dir string) bool {
	b, err := os.ReadFile("/proc/self/mountinfo")
	return err == nil && netnsMountIn(string(b), dir)
}

// netnsMountIn reports whether the mountinfo text has dir on a tmpfs that
// scripts/netns mounted.
func netnsMountIn(mountinfo, dir string) bool {
	for _, line := range strings.Split(mountinfo, "\n") {
		// ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTIONS
		pre, post, ok := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if ok && len(f) >= 5 && len(g) >= 2 && g[0] == "tmpfs" && g[1] == "egp-netns" &&
			(dir == f[4] || strings.HasPrefix(dir, f[4]+"/")) {
			return true
		}
	}
	return false
}

// clearQEMUCapsCache removes libvirt's cached QEMU capabilities.
func clearQEMUCapsCache() error {
	files, err := filepath.Glob(filepath.Join(qemuCapsCache, "*.xml"))
	if err != nil {
		return err
	}
	for _, f := range files {
		if err := os.Remove(f); err != nil {
			return fmt.Errorf("clear libvirt's QEMU capabilities cache: %w", err)
		}
	}
	return nil
}
