package kvm2

import (
	"testing"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy"
)

func TestMapState(t *testing.T) {
	t.Parallel()
	tests := []struct {
		st      libvirt.DomainState
		addr    bool
		want    egressproxy.State
		active  bool
		comment string
	}{
		{libvirt.DomainRunning, true, egressproxy.StateRunning, true, "running with address"},
		{libvirt.DomainRunning, false, egressproxy.StateProvisioning, true, "running, booting"},
		{libvirt.DomainBlocked, true, egressproxy.StateRunning, true, "blocked on I/O"},
		{libvirt.DomainBlocked, false, egressproxy.StateProvisioning, true, "blocked, no address"},
		{libvirt.DomainPaused, true, egressproxy.StateRunning, true, "paused keeps its address"},
		{libvirt.DomainPaused, false, egressproxy.StateProvisioning, true, "paused, no address"},
		{libvirt.DomainNostate, false, egressproxy.StateProvisioning, false, "no state yet"},
		{libvirt.DomainShutdown, false, egressproxy.StateStopped, false, "shutting down"},
		{libvirt.DomainShutoff, false, egressproxy.StateStopped, false, "shut off"},
		{libvirt.DomainShutoff, true, egressproxy.StateStopped, false, "shut off, stale address"},
		{libvirt.DomainPmsuspended, false, egressproxy.StateStopped, false, "suspended by the guest"},
		{libvirt.DomainCrashed, false, egressproxy.StateFailed, false, "crashed"},
		{libvirt.DomainState(99), false, egressproxy.StateFailed, false, "unknown"},
	}
	for _, tt := range tests {
		t.Run(tt.comment, func(t *testing.T) {
			if got := mapState(tt.st, tt.addr); got != tt.want {
				t.Errorf("mapState(%d, %v) = %s, want %s", tt.st, tt.addr, got, tt.want)
			}
			if got := domainActive(tt.st); got != tt.active {
				t.Errorf("domainActive(%d) = %v, want %v", tt.st, got, tt.active)
			}
		})
	}
}
