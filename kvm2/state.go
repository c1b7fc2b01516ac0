package kvm2

import (
	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy"
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
// egressproxy.State:
//
//	running, blocked, paused  → Running with an address, else Provisioning
//	nostate                   → Provisioning (being set up)
//	shutdown (shutting down), shutoff, pmsuspended → Stopped
//	crashed                   → Failed
//	anything else             → Failed
func mapState(st libvirt.DomainState, hasAddress bool) egressproxy.State {
	switch st {
	case libvirt.DomainRunning, libvirt.DomainBlocked, libvirt.DomainPaused:
		if hasAddress {
			return egressproxy.StateRunning
		}
		return egressproxy.StateProvisioning
	case libvirt.DomainNostate:
		return egressproxy.StateProvisioning
	case libvirt.DomainShutdown, libvirt.DomainShutoff, libvirt.DomainPmsuspended:
		return egressproxy.StateStopped
	case libvirt.DomainCrashed:
		return egressproxy.StateFailed
	}
	return egressproxy.StateFailed
}
