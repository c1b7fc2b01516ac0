package kvm2

import (
	"context"
	"fmt"
	"sync"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/internal/errs"
	"libvirt.org/go/libvirtxml"
)

// Acceleration: the libvirt domain type Create defines.
//
// An explicit Config.DomainType wins: "qemu" is used without asking the
// host; "kvm" is used once the host's domain capabilities show that it
// offers KVM, and is a Permanent error naming DomainType when it does not.
// The zero value is automatic: "kvm" when the host offers it, else "qemu"
// (TCG, software emulation), which Check reports as a degraded detail.
//
// Open touches nothing, so the host's answer is read when first needed: by
// the first Create of a new instance (before the base image is fetched and
// the domain defined) and by every Check, which refreshes what Create uses
// (so a host that gains or loses KVM is noticed by the next Check, or by a
// new provider). Either read is one ConnectGetDomainCapabilities call for
// the guests' architecture with no domain type asked for: libvirt answers
// with its default for that emulator, "kvm" exactly when KVM is usable.
//
// A host may offer KVM that does not work (nested virtualisation can look
// like this: KVM guests hang in their firmware). Pin "qemu" there; see
// docs/config.md.

const (
	domainTypeKVM  = "kvm"
	domainTypeQEMU = "qemu"
	// guestArch is the architecture buildDomainXML's guests have.
	guestArch = "x86_64"
)

// The Details keys Check sets about acceleration.
const (
	detailDomainType   = "domainType"   // the type Create defines: "kvm" or "qemu"
	detailAcceleration = "acceleration" // "kvm", or "none" (TCG)
	detailDegraded     = "degraded"     // set when DomainType is automatic and the host offers no KVM
)

// degradedNoKVM is the degraded detail of an automatic DomainType on a host
// without KVM.
const degradedNoKVM = "guests run without acceleration: the host's domain capabilities offer no KVM, " +
	`so instances use TCG (software emulation, many times slower); enable KVM on the host, ` +
	`or set DomainType "qemu" to choose TCG on purpose`

// accelCache is what the host last said about KVM (known once read).
type accelCache struct {
	mu    sync.Mutex
	known bool
	kvm   bool
}

func (a *accelCache) get() (kvm, known bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.kvm, a.known
}

// set records the host's answer and reports whether it differs from what
// was known (or nothing was).
func (a *accelCache) set(kvm bool) (changed bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	changed = !a.known || a.kvm != kvm
	a.known, a.kvm = true, kvm
	return changed
}

// readKVMOffered asks the host whether it offers KVM for guestArch: one
// ConnectGetDomainCapabilities call, its document parsed with libvirtxml.
func readKVMOffered(l lvAPI) (bool, error) {
	doc, err := l.ConnectGetDomainCapabilities(nil, libvirt.OptString{guestArch}, nil, nil, 0)
	if err != nil {
		return false, fmt.Errorf("get domain capabilities: %w", err)
	}
	return kvmOffered(doc)
}

// kvmOffered parses a domain capabilities document (virsh domcapabilities)
// and reports whether its domain type is kvm.
func kvmOffered(doc string) (bool, error) {
	var caps libvirtxml.DomainCaps
	if err := caps.Unmarshal(doc); err != nil {
		return false, fmt.Errorf("parse domain capabilities: %w", err)
	}
	if caps.Domain == "" {
		return false, fmt.Errorf("parse domain capabilities: no domain type in the document")
	}
	return caps.Domain == domainTypeKVM, nil
}

// decideDomainType returns the domain type to define given whether the host
// offers KVM: the configured one, or for the zero value kvm or qemu. An
// explicit "kvm" on a host without it is a Permanent *errs.FieldError
// naming DomainType.
func (p *provider) decideDomainType(kvm bool) (string, error) {
	switch p.cfg.DomainType {
	case "":
		if kvm {
			return domainTypeKVM, nil
		}
		return domainTypeQEMU, nil
	case domainTypeKVM:
		if !kvm {
			return "", errs.WithCode(errs.Permanent, fieldErr("DomainType", domainTypeKVM,
				`the host does not offer KVM (its domain capabilities for `+guestArch+` have no kvm domain type); `+
					`leave DomainType empty to fall back to "qemu" (TCG), or set "qemu"`))
		}
		return domainTypeKVM, nil
	default:
		return p.cfg.DomainType, nil
	}
}

// learnAccel records the host's answer and logs a change: falling back to
// TCG is a fact a human may want (V(0)), using KVM is routine (V(1)).
func (p *provider) learnAccel(kvm bool) {
	if !p.accel.set(kvm) || p.cfg.DomainType == domainTypeQEMU {
		return
	}
	switch {
	case kvm:
		p.log.V(1).Info("acceleration: the host offers KVM", "domainType", domainTypeKVM)
	case p.cfg.DomainType == "":
		p.log.Info("acceleration: the host offers no KVM; guests run under TCG", "domainType", domainTypeQEMU)
	}
}

// createDomainType returns the domain type a Create of a new instance
// defines. It reads the host's capabilities only when the decision needs
// them and they are not known yet (span kvm2.libvirt.Create.capabilities).
func (p *provider) createDomainType(ctx context.Context) (string, error) {
	if p.cfg.DomainType == domainTypeQEMU {
		return domainTypeQEMU, nil
	}
	kvm, known := p.accel.get()
	if !known {
		var got bool
		err := p.do(ctx, "kvm2.Create.capabilities", func(l lvAPI) error {
			var err error
			got, err = readKVMOffered(l)
			return err
		})
		if err != nil {
			return "", err // fn may still be running: never read what it writes
		}
		p.learnAccel(got)
		kvm = got
	}
	return p.decideDomainType(kvm)
}

// accelDetails sets Check's acceleration details for the decided type, or
// for an explicit "kvm" the host does not offer (decided is "").
func accelDetails(set func(k, v string), explicit, decided string) {
	switch decided {
	case domainTypeKVM:
		set(detailDomainType, domainTypeKVM)
		set(detailAcceleration, domainTypeKVM)
	case "":
		set(detailAcceleration, "none")
	default:
		set(detailDomainType, decided)
		set(detailAcceleration, "none")
		if explicit == "" {
			set(detailDegraded, degradedNoKVM)
		}
	}
}
