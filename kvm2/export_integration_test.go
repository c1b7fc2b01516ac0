//go:build integration

package kvm2

import (
	"fmt"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy/internal/basecache"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// Helpers exported for the external test package kvm2_test, whose files
// may import internal/benchutil (which imports kvm2).

// LifecycleConfigT returns the Config of a fresh lifecycle env: its own
// entry, a tiny base image served over HTTP (key "tiny"), machine type
// "tiny" and an isolated network, all removed when the test ends.
func LifecycleConfigT(t *testing.T) Config {
	t.Helper()
	return newLifecycleEnv(t).cfg
}

// HostInstance is what the host holds of one instance, read with a libvirt
// connection of its own.
type HostInstance struct {
	Defined        bool
	State          libvirt.DomainState
	Overlay, Seed  bool
	OverlayBacking string // backing store path of the overlay
	BasePath       string // path of the entry's "tiny" base volume
	UserData       string // user-data in the seed ISO
}

// HostInstanceT reads instance name of cfg's entry from the host.
func HostInstanceT(t *testing.T, cfg Config, name string) HostInstance {
	t.Helper()
	facts := readHost(t, cfg)
	dn := domainName(cfg.Entry, name)
	var h HostInstance
	h.State, h.Defined = facts.domains[dn]
	h.OverlayBacking, h.Overlay = facts.volumes[overlayVolume(dn)]
	_, h.Seed = facts.volumes[seedVolume(dn)]
	h.BasePath = facts.paths[basecache.BaseName(cfg.Entry, "tiny", "qcow2")]
	if h.Seed {
		_, files := readSeed(t, downloadVolume(t, cfg, seedVolume(dn)))
		h.UserData = files["user-data"]
	}
	return h
}

// AssertOnlyBasesT fails t if a domain or a volume other than a base of
// cfg's entry is on the host, or if the "tiny" base is gone.
func AssertOnlyBasesT(t *testing.T, cfg Config, when string) {
	t.Helper()
	facts := assertOnlyBases(t, cfg, when)
	if _, ok := facts.volumes[basecache.BaseName(cfg.Entry, "tiny", "qcow2")]; !ok {
		t.Errorf("the base is gone%s: %v", when, facts.volumes)
	}
}

// SSHDPidT returns the pid of the stack's listening sshd.
func SSHDPidT(t *testing.T) int {
	t.Helper()
	pid, err := strconv.Atoi(strings.TrimSpace(teststack.Run(t, "sshd-pid")))
	if err != nil {
		t.Fatalf("sshd pid: %v", err)
	}
	return pid
}

// KillSSHSessions SIGKILLs every descendant of the listening sshd (its
// per-connection processes), so every SSH link to the stack dies at once.
// It does not use t beyond Helper, so it may run on any goroutine.
func KillSSHSessions(t *testing.T, sshdPid int) error {
	sessions := teststack.Descendants(sshdPid)
	if len(sessions) == 0 {
		return fmt.Errorf("sshd %d has no session process to kill", sshdPid)
	}
	for _, pid := range sessions {
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && err != syscall.ESRCH {
			return fmt.Errorf("kill sshd session %d: %w", pid, err)
		}
	}
	return nil
}

// AssertInstanceGoneT fails t if anything of instance name of cfg's entry
// (its domain, overlay or seed) is on the host, or if the "tiny" base is
// gone.
func AssertInstanceGoneT(t *testing.T, cfg Config, name string, when string) {
	t.Helper()
	h := HostInstanceT(t, cfg, name)
	if h.Defined || h.Overlay || h.Seed {
		t.Errorf("instance %s left%s: domain %v overlay %v seed %v", name, when, h.Defined, h.Overlay, h.Seed)
	}
	if h.BasePath == "" {
		t.Errorf("the base is gone%s", when)
	}
}

// SettledHostInstanceT is HostInstanceT after waiting (at most a minute)
// for a domain that libvirt is still starting — QEMU runs paused until its
// start completes — to leave the paused state, so that a start still in
// flight (e.g. one an interrupted call sent) is not read half-way.
func SettledHostInstanceT(t *testing.T, cfg Config, name string) HostInstance {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		h := HostInstanceT(t, cfg, name)
		if h.State != libvirt.DomainPaused || time.Now().After(deadline) {
			return h
		}
		time.Sleep(100 * time.Millisecond)
	}
}
