package kvm2

import (
	libvirt "github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy/provider"
)

// domainActive reports whether a domain in state st has a running QEMU, so
// that looking for its address makes sense.
func domainActive(st libvirt.DomainState) bool {
	switch st {
	case libvirt.DomainRunning, libvirt.DomainBlocked, libvirt.DomainPaused:
		return true
	}
	return false
}

// mapState maps a libvirt domain state and the presence of an address to a
// provider.State:
//
//	running, blocked, paused  → Running with an address, else Provisioning
//	nostate                   → Provisioning (being set up)
//	shutdown (shutting down), shutoff, pmsuspended → Stopped
//	crashed                   → Failed
//	anything else             → Failed
func mapState(st libvirt.DomainState, hasAddress bool) provider.State {
	switch st {
	case libvirt.DomainRunning, libvirt.DomainBlocked, libvirt.DomainPaused:
		if hasAddress {
			return provider.StateRunning
		}
		return provider.StateProvisioning
	case libvirt.DomainNostate:
		return provider.StateProvisioning
	case libvirt.DomainShutdown, libvirt.DomainShutoff, libvirt.DomainPmsuspended:
		return provider.StateStopped
	case libvirt.DomainCrashed:
		return provider.StateFailed
	}
	return provider.StateFailed
}
