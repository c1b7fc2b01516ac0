package kvm2

import (
	"testing"

	libvirt "github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy/provider"
)

func TestMapState(t *testing.T) {
	t.Parallel()
	tests := []struct {
		st      libvirt.DomainState
		addr    bool
		want    provider.State
		active  bool
		comment string
	}{
		{libvirt.DomainRunning, true, provider.StateRunning, true, "running with address"},
		{libvirt.DomainRunning, false, provider.StateProvisioning, true, "running, booting"},
		{libvirt.DomainBlocked, true, provider.StateRunning, true, "blocked on I/O"},
		{libvirt.DomainBlocked, false, provider.StateProvisioning, true, "blocked, no address"},
		{libvirt.DomainPaused, true, provider.StateRunning, true, "paused keeps its address"},
		{libvirt.DomainPaused, false, provider.StateProvisioning, true, "paused, no address"},
		{libvirt.DomainNostate, false, provider.StateProvisioning, false, "no state yet"},
		{libvirt.DomainShutdown, false, provider.StateStopped, false, "shutting down"},
		{libvirt.DomainShutoff, false, provider.StateStopped, false, "shut off"},
		{libvirt.DomainShutoff, true, provider.StateStopped, false, "shut off, stale address"},
		{libvirt.DomainPmsuspended, false, provider.StateStopped, false, "suspended by the guest"},
		{libvirt.DomainCrashed, false, provider.StateFailed, false, "crashed"},
		{libvirt.DomainState(99), false, provider.StateFailed, false, "unknown"},
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
