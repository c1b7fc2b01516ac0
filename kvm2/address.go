package kvm2

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"sync"

	libvirt "github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/sshconn"
)

// Address sources, in the order of their priority (see discoverAddress).
const (
	SourceAgent = "agent" // QEMU guest agent inside the VM
	SourceLease = "lease" // DHCP lease of the libvirt network
	SourceARP   = "arp"   // the host's ARP table
)

var addressSources = []struct {
	name string
	src  libvirt.DomainInterfaceAddressesSource
}{
	{SourceAgent, libvirt.DomainInterfaceAddressesSrcAgent},
	{SourceLease, libvirt.DomainInterfaceAddressesSrcLease},
	{SourceARP, libvirt.DomainInterfaceAddressesSrcArp},
}

// addrBackend reads a domain's interface addresses from one source
// (DomainInterfaceAddresses). The kvm2 implementation runs it on the shared
// libvirt connection; tests fake it.
type addrBackend interface {
	InterfaceAddresses(ctx context.Context, src libvirt.DomainInterfaceAddressesSource) ([]libvirt.DomainInterface, error)
}

// SourceError is one address source's failure.
type SourceError struct {
	Source string
	Err    error
}

func (e SourceError) Error() string { return e.Source + ": " + e.Err.Error() }
func (e SourceError) Unwrap() error { return e.Err }

// AddressError says why no address could be read: every source failed (each
// one's cause in Sources), or the link died while asking one of them. It is
// classed Transient.
type AddressError struct {
	Sources  []SourceError
	LinkDead bool
}

func (e *AddressError) Error() string {
	parts := make([]string, len(e.Sources))
	for i, s := range e.Sources {
		parts[i] = s.Error()
	}
	if e.LinkDead {
		return "address discovery: link to libvirt died: " + strings.Join(parts, "; ")
	}
	return "address discovery: every source failed: " + strings.Join(parts, "; ")
}

// Unwrap exposes each source's error.
func (e *AddressError) Unwrap() []error {
	out := make([]error, len(e.Sources))
	for i := range e.Sources {
		out[i] = e.Sources[i]
	}
	return out
}

// discoverAddress asks the guest agent, the DHCP lease and ARP for the
// domain's address, all at once, and returns the first usable one in that
// order (agent, then lease, then ARP) with its source: the answers are
// judged in that order exactly as if the sources had been asked one after
// the other, so a source's answer counts only when every source before it
// failed or had no usable address. The result is decided as soon as the
// sources before the deciding one have answered; the others are abandoned
// (their calls are cancelled and waited for before discoverAddress
// returns).
//
// One source failing is normal (a booting guest has no agent yet; some hosts
// have no usable ARP source): the next one's answer counts. When a source
// answers without a usable address and no source has one, the result is
// ("", "", nil): the guest has no address yet. When every source failed, or
// the link died, the error is a Transient *AddressError naming each
// source's failure (up to the one that saw the link die). A context that
// ends is returned as Canceled/DeadlineExceeded; a domain that vanished as
// NotFound. mac, when set, restricts the agent's answer to the interface
// with that hardware address.
func discoverAddress(ctx context.Context, b addrBackend, mac string) (ip, source string, err error) {
	if err := ctx.Err(); err != nil {
		return "", "", errs.FromContext(err)
	}
	type answer struct {
		i      int
		ifaces []libvirt.DomainInterface
		err    error
	}
	actx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()
	answers := make(chan answer, len(addressSources))
	for i, s := range addressSources {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ifaces, err := b.InterfaceAddresses(actx, s.src)
			answers <- answer{i: i, ifaces: ifaces, err: err}
		}()
	}
	got := make([]*answer, len(addressSources))
	next := 0 // the first source not judged yet
	var failed []SourceError
	for range addressSources {
		a := <-answers
		got[a.i] = &a
		for ; next < len(addressSources) && got[next] != nil; next++ {
			s, a := addressSources[next], got[next]
			if a.err != nil {
				if err := sourceFailure(ctx, s.name, a.err); err != nil {
					return "", "", err
				}
				failed = append(failed, SourceError{Source: s.name, Err: a.err})
				if linkDead(a.err) {
					return "", "", errs.WithCode(errs.Transient, &AddressError{Sources: failed, LinkDead: true})
				}
				continue
			}
			if addr := pickAddress(a.ifaces, mac, s.src == libvirt.DomainInterfaceAddressesSrcAgent); addr != "" {
				return addr, s.name, nil
			}
		}
	}
	if len(failed) == len(addressSources) {
		return "", "", errs.WithCode(errs.Transient, &AddressError{Sources: failed})
	}
	return "", "", nil
}

// sourceFailure returns the error that ends discoverAddress when source
// failed with err (ctx ended, the domain vanished, the provider closed),
// or nil when the next source's answer counts.
func sourceFailure(ctx context.Context, source string, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		if !errors.Is(err, cerr) {
			// It failed on its own, but ctx ended before it was judged
			// (another source was still in flight): the class is ctx's.
			err = fmt.Errorf("%w; %v", cerr, err)
		}
		return errs.FromContext(fmt.Errorf("address from %s: %w", source, err))
	}
	switch c := errs.Code(classifyRead(err)); {
	case c == errs.Canceled || c == errs.DeadlineExceeded:
		return classifyRead(fmt.Errorf("address from %s: %w", source, err))
	case c == errs.NotFound:
		return errs.WithCode(errs.NotFound, fmt.Errorf("address from %s: %w", source, err))
	case sshKind(err) == sshconn.KindClosed:
		return classify(err)
	}
	return nil
}

// pickAddress returns the best address among ifaces: a global IPv4 address
// first, else a global IPv6 one; loopback, link-local and unspecified
// addresses never. With filterMAC and mac set, only the interface with that
// hardware address counts.
func pickAddress(ifaces []libvirt.DomainInterface, mac string, filterMAC bool) string {
	var v6 string
	for _, ifc := range ifaces {
		if filterMAC && mac != "" {
			if len(ifc.Hwaddr) == 0 || !strings.EqualFold(ifc.Hwaddr[0], mac) {
				continue
			}
		}
		for _, a := range ifc.Addrs {
			ip, err := netip.ParseAddr(a.Addr)
			if err != nil || ip.IsLoopback() || ip.IsLinkLocalUnicast() || ip.IsUnspecified() || ip.IsMulticast() {
				continue
			}
			if ip.Is4() || ip.Is4In6() {
				return ip.Unmap().String()
			}
			if v6 == "" {
				v6 = ip.String()
			}
		}
	}
	return v6
}
