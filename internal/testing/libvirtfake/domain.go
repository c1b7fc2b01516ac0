package libvirtfake

import (
	"fmt"
	"strings"

	"github.com/digitalocean/go-libvirt"
	"libvirt.org/go/libvirtxml"
)

// Domain is a domain as the Host holds it (Host.Domain, Host.UpdateDomain).
type Domain struct {
	Name string
	UUID libvirt.UUID
	// ID is the running domain's ID, -1 while it is not running.
	ID int32
	// XML is the definition, with the UUID and the MAC addresses libvirt
	// fills in.
	XML string
	// MAC is the first interface's MAC address ("" without interfaces).
	MAC   string
	State libvirt.DomainState
	// Reason is the state's reason (libvirt.DomainRunningReason,
	// libvirt.DomainShutoffReason, …).
	Reason int32
	// Persistent is false for a domain undefined while it ran: it goes
	// when it stops.
	Persistent bool
	// AgentAddress is the address the guest agent reports for the first
	// interface; "" when no agent answers.
	AgentAddress string
}

// Handle is the domain's handle, as libvirt returns it.
func (d Domain) Handle() libvirt.Domain { return libvirt.Domain{Name: d.Name, UUID: d.UUID, ID: d.ID} }

// active reports whether the domain runs (running, blocked or paused).
func (d *Domain) active() bool {
	switch d.State {
	case libvirt.DomainRunning, libvirt.DomainBlocked, libvirt.DomainPaused:
		return true
	}
	return false
}

func errNoDomain(name string) error {
	return Errorf(libvirt.ErrNoDomain, "Domain not found: no domain with matching name '%s'", name)
}

func errNotRunning() error {
	return Errorf(libvirt.ErrOperationInvalid, "Requested operation is not valid: domain is not running")
}

// Domain returns a copy of the domain called name.
func (h *Host) Domain(name string) (Domain, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	d, ok := h.domains[name]
	if !ok {
		return Domain{}, false
	}
	return *d, true
}

// DomainNames returns the sorted names of the domains.
func (h *Host) DomainNames() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return sortedKeys(h.domains)
}

// UpdateDomain runs fn on the domain called name, under the Host's lock
// (fn must not call the Host, nor change Name or UUID), and reports whether
// the domain exists. The Host checks nothing fn does: a test sets the
// state, the agent's answer or the MAC address libvirt would not.
func (h *Host) UpdateDomain(name string, fn func(*Domain)) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	d, ok := h.domains[name]
	if ok {
		fn(d)
	}
	return ok
}

// DefineDomain defines a domain from its XML as DomainDefineXMLFlags does,
// without hooks and without being logged: as another client of libvirtd.
func (h *Host) DefineDomain(xml string) (Domain, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	d, err := h.defineLocked(xml)
	if err != nil {
		return Domain{}, err
	}
	return *d, nil
}

// StartDomain starts the domain called name as DomainCreate does, without
// hooks and without being logged.
func (h *Host) StartDomain(name string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	d, ok := h.domains[name]
	if !ok {
		return errNoDomain(name)
	}
	return h.startLocked(d)
}

// SetLease makes the network's DHCP server answer ip for mac.
func (h *Host) SetLease(mac, ip string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.leases[mac] = ip
}

// SetARP puts mac at ip in the host's ARP table.
func (h *Host) SetARP(mac, ip string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.arp[mac] = ip
}

// SetDomainCapabilities sets the document ConnectGetDomainCapabilities
// answers ("": none, the call fails as unsupported).
func (h *Host) SetDomainCapabilities(doc string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.domcaps = doc
}

// defineLocked defines a persistent domain as libvirt does: the UUID is the
// XML's or a new one; a name taken by another UUID (or by any domain, when
// the XML has none) is refused, as is a UUID taken by another name; each
// interface without a MAC address gets one. Defining an existing domain
// again (same name and UUID) replaces its definition and keeps it running
// if it runs.
func (h *Host) defineLocked(xml string) (*Domain, error) {
	var dx libvirtxml.Domain
	if err := dx.Unmarshal(xml); err != nil {
		return nil, Errorf(libvirt.ErrXMLError, "XML error: %v", err)
	}
	if dx.Name == "" {
		return nil, Errorf(libvirt.ErrXMLError, "XML error: missing domain name information")
	}
	old := h.domains[dx.Name]
	var u libvirt.UUID
	if dx.UUID != "" {
		var err error
		if u, err = parseUUID(dx.UUID); err != nil {
			return nil, err
		}
	}
	switch {
	case old != nil && (dx.UUID == "" || u != old.UUID):
		return nil, Errorf(libvirt.ErrOperationFailed, "operation failed: domain '%s' already exists with uuid %s", dx.Name, uuidString(old.UUID))
	case old == nil && dx.UUID == "":
		u = h.uuidLocked()
	case old == nil:
		for _, d := range h.domains {
			if d.UUID == u {
				return nil, Errorf(libvirt.ErrOperationFailed, "operation failed: domain '%s' is already defined with uuid %s", d.Name, dx.UUID)
			}
		}
	}
	dx.UUID = uuidString(u)
	mac := ""
	if dx.Devices != nil {
		for i := range dx.Devices.Interfaces {
			ifc := &dx.Devices.Interfaces[i]
			if ifc.MAC == nil {
				h.seq++
				ifc.MAC = &libvirtxml.DomainInterfaceMAC{Address: fmt.Sprintf("52:54:00:%02x:%02x:%02x", byte(h.seq>>16), byte(h.seq>>8), byte(h.seq))}
			}
			if i == 0 {
				mac = ifc.MAC.Address
			}
		}
	}
	out, err := dx.Marshal()
	if err != nil {
		return nil, Errorf(libvirt.ErrXMLError, "XML error: %v", err)
	}
	if old != nil {
		old.XML, old.MAC, old.Persistent = out, mac, true
		return old, nil
	}
	d := &Domain{
		Name: dx.Name, UUID: u, ID: -1, XML: out, MAC: mac,
		State: libvirt.DomainShutoff, Reason: int32(libvirt.DomainShutoffUnknown), Persistent: true,
	}
	h.domains[dx.Name] = d
	return d, nil
}

// startLocked starts a defined domain; the volumes its disks name must
// exist in active pools.
func (h *Host) startLocked(d *Domain) error {
	if d.active() {
		return Errorf(libvirt.ErrOperationInvalid, "Requested operation is not valid: domain is already running")
	}
	var dx libvirtxml.Domain
	if err := dx.Unmarshal(d.XML); err != nil {
		return Errorf(libvirt.ErrXMLError, "XML error: %v", err)
	}
	if dx.Devices != nil {
		for _, disk := range dx.Devices.Disks {
			if disk.Source == nil || disk.Source.Volume == nil {
				continue
			}
			p, err := h.activePoolLocked(disk.Source.Volume.Pool)
			if err != nil {
				return err
			}
			if _, ok := p.vols[disk.Source.Volume.Volume]; !ok {
				return errNoVol(disk.Source.Volume.Volume)
			}
		}
	}
	h.ids++
	d.State, d.Reason, d.ID = libvirt.DomainRunning, int32(libvirt.DomainRunningBooted), h.ids
	return nil
}

// domainByHandleLocked finds a domain by its handle's UUID, as the remote
// driver does.
func (h *Host) domainByHandleLocked(dom libvirt.Domain) (*Domain, error) {
	for _, d := range h.domains {
		if d.UUID == dom.UUID {
			return d, nil
		}
	}
	return nil, Errorf(libvirt.ErrNoDomain, "Domain not found: no domain with matching uuid '%s' (%s)", uuidString(dom.UUID), dom.Name)
}

// ConnectGetHostname answers Hostname.
func (s *Session) ConnectGetHostname() (rHostname string, err error) {
	err = s.run(Call{Method: "ConnectGetHostname"}, func() error {
		rHostname = Hostname
		return nil
	})
	return rHostname, err
}

// ConnectGetLibVersion answers LibVersion.
func (s *Session) ConnectGetLibVersion() (rLibVer uint64, err error) {
	err = s.run(Call{Method: "ConnectGetLibVersion"}, func() error {
		rLibVer = LibVersion
		return nil
	})
	return rLibVer, err
}

// ConnectGetDomainCapabilities answers the document SetDomainCapabilities
// set, whatever the arguments (which the call log keeps in Call.Args).
func (s *Session) ConnectGetDomainCapabilities(Emulatorbin libvirt.OptString, Arch libvirt.OptString, Machine libvirt.OptString, Virttype libvirt.OptString, Flags libvirt.ConnectGetDomainCapabilitiesFlags) (rCapabilities string, err error) {
	args := fmt.Sprintf("emulator=%q arch=%q machine=%q virttype=%q flags=%d", Emulatorbin, Arch, Machine, Virttype, Flags)
	err = s.run(Call{Method: "ConnectGetDomainCapabilities", Args: args}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		if s.h.domcaps == "" {
			return Errorf(libvirt.ErrNoSupport, "this function is not supported by the connection driver: virConnectGetDomainCapabilities")
		}
		rCapabilities = s.h.domcaps
		return nil
	})
	return rCapabilities, err
}

// ConnectListAllDomains lists the domains, sorted by name; flags
// ConnectListDomainsActive/Inactive filter (none: all). NeedResults 0
// asks for the count only.
func (s *Session) ConnectListAllDomains(NeedResults int32, Flags libvirt.ConnectListAllDomainsFlags) (rDomains []libvirt.Domain, rRet uint32, err error) {
	err = s.run(Call{Method: "ConnectListAllDomains"}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		wantActive := Flags&libvirt.ConnectListDomainsActive != 0
		wantInactive := Flags&libvirt.ConnectListDomainsInactive != 0
		for _, n := range sortedKeys(s.h.domains) {
			d := s.h.domains[n]
			if (wantActive || wantInactive) && !(wantActive && d.active() || wantInactive && !d.active()) {
				continue
			}
			rDomains = append(rDomains, d.Handle())
		}
		rRet = uint32(len(rDomains))
		if NeedResults == 0 {
			rDomains = nil
		}
		return nil
	})
	return rDomains, rRet, err
}

// ConnectGetAllDomainStats answers the "state" group (state.state,
// state.reason) of every domain, sorted by name; other groups, a list of
// domains and flags are not implemented.
func (s *Session) ConnectGetAllDomainStats(Doms []libvirt.Domain, Stats uint32, Flags uint32) (rRetStats []libvirt.DomainStatsRecord, err error) {
	err = s.run(Call{Method: "ConnectGetAllDomainStats"}, func() error {
		if Doms != nil || Flags != 0 || Stats != uint32(libvirt.DomainStatsState) {
			return Errorf(libvirt.ErrArgumentUnsupported, "argument unsupported: libvirtfake answers only the state stats of every domain")
		}
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		for _, n := range sortedKeys(s.h.domains) {
			d := s.h.domains[n]
			rRetStats = append(rRetStats, libvirt.DomainStatsRecord{Dom: d.Handle(), Params: []libvirt.TypedParam{
				{Field: "state.state", Value: *libvirt.NewTypedParamValueInt(int32(d.State))},
				{Field: "state.reason", Value: *libvirt.NewTypedParamValueInt(d.Reason)},
			}})
		}
		return nil
	})
	return rRetStats, err
}

// DomainLookupByName finds a domain by name.
func (s *Session) DomainLookupByName(Name string) (rDom libvirt.Domain, err error) {
	err = s.run(Call{Method: "DomainLookupByName", Domain: Name}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		d, ok := s.h.domains[Name]
		if !ok {
			return errNoDomain(Name)
		}
		rDom = d.Handle()
		return nil
	})
	return rDom, err
}

// DomainGetXMLDesc returns the domain's definition.
func (s *Session) DomainGetXMLDesc(Dom libvirt.Domain, Flags libvirt.DomainXMLFlags) (rXML string, err error) {
	err = s.run(Call{Method: "DomainGetXMLDesc", Domain: Dom.Name}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		d, err := s.h.domainByHandleLocked(Dom)
		if err != nil {
			return err
		}
		rXML = d.XML
		return nil
	})
	return rXML, err
}

// DomainGetState returns the domain's state and its reason.
func (s *Session) DomainGetState(Dom libvirt.Domain, Flags uint32) (rState int32, rReason int32, err error) {
	err = s.run(Call{Method: "DomainGetState", Domain: Dom.Name}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		d, err := s.h.domainByHandleLocked(Dom)
		if err != nil {
			return err
		}
		rState, rReason = int32(d.State), d.Reason
		return nil
	})
	return rState, rReason, err
}

// DomainDefineXMLFlags defines a persistent domain (see DefineDomain for
// what libvirt checks and fills in).
func (s *Session) DomainDefineXMLFlags(XML string, Flags libvirt.DomainDefineFlags) (rDom libvirt.Domain, err error) {
	err = s.run(Call{Method: "DomainDefineXMLFlags", Domain: domainName(XML)}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		d, err := s.h.defineLocked(XML)
		if err != nil {
			return err
		}
		rDom = d.Handle()
		return nil
	})
	return rDom, err
}

// DomainDefineXML is DomainDefineXMLFlags without flags.
func (s *Session) DomainDefineXML(XML string) (rDom libvirt.Domain, err error) {
	err = s.run(Call{Method: "DomainDefineXML", Domain: domainName(XML)}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		d, err := s.h.defineLocked(XML)
		if err != nil {
			return err
		}
		rDom = d.Handle()
		return nil
	})
	return rDom, err
}

// domainName is the name an XML definition gives ("" when it gives none).
func domainName(xml string) string {
	var dx libvirtxml.Domain
	if dx.Unmarshal(xml) != nil {
		return ""
	}
	return dx.Name
}

// DomainCreate starts a defined domain; the volumes its disks name must
// exist in active pools.
func (s *Session) DomainCreate(Dom libvirt.Domain) (err error) {
	return s.run(Call{Method: "DomainCreate", Domain: Dom.Name}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		d, err := s.h.domainByHandleLocked(Dom)
		if err != nil {
			return err
		}
		return s.h.startLocked(d)
	})
}

// DomainDestroy stops a running domain at once; a domain that is not
// persistent goes with it.
func (s *Session) DomainDestroy(Dom libvirt.Domain) (err error) {
	return s.run(Call{Method: "DomainDestroy", Domain: Dom.Name}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		d, err := s.h.domainByHandleLocked(Dom)
		if err != nil {
			return err
		}
		if !d.active() {
			return errNotRunning()
		}
		d.State, d.Reason, d.ID = libvirt.DomainShutoff, int32(libvirt.DomainShutoffDestroyed), -1
		if !d.Persistent {
			delete(s.h.domains, d.Name)
		}
		return nil
	})
}

// DomainUndefineFlags removes a domain's definition: a stopped domain
// goes, a running one stays until it stops (it is no longer persistent);
// a transient domain is refused, as libvirtd's qemu driver refuses it
// (operation invalid).
func (s *Session) DomainUndefineFlags(Dom libvirt.Domain, Flags libvirt.DomainUndefineFlagsValues) (err error) {
	return s.run(Call{Method: "DomainUndefineFlags", Domain: Dom.Name}, func() error { return s.h.undefine(Dom) })
}

// DomainUndefine is DomainUndefineFlags without flags.
func (s *Session) DomainUndefine(Dom libvirt.Domain) (err error) {
	return s.run(Call{Method: "DomainUndefine", Domain: Dom.Name}, func() error { return s.h.undefine(Dom) })
}

func (h *Host) undefine(dom libvirt.Domain) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	d, err := h.domainByHandleLocked(dom)
	if err != nil {
		return err
	}
	if !d.Persistent {
		return Errorf(libvirt.ErrOperationInvalid, "cannot undefine transient domain")
	}
	if d.active() {
		d.Persistent = false
		return nil
	}
	delete(h.domains, d.Name)
	return nil
}

// DomainInterfaceAddresses answers for a running domain from the source
// asked: the guest agent (its AgentAddress on the first interface, beside
// the loopback; an error when no agent answers), the DHCP leases
// (SetLease) or the ARP table (SetARP) for its first interface's MAC.
func (s *Session) DomainInterfaceAddresses(Dom libvirt.Domain, Source uint32, Flags uint32) (rIfaces []libvirt.DomainInterface, err error) {
	err = s.run(Call{Method: "DomainInterfaceAddresses", Domain: Dom.Name}, func() error {
		s.h.mu.Lock()
		defer s.h.mu.Unlock()
		d, err := s.h.domainByHandleLocked(Dom)
		if err != nil {
			return err
		}
		if !d.active() {
			return errNotRunning()
		}
		rIfaces, err = s.h.addressesLocked(d, libvirt.DomainInterfaceAddressesSource(Source))
		return err
	})
	return rIfaces, err
}

func (h *Host) addressesLocked(d *Domain, source libvirt.DomainInterfaceAddressesSource) ([]libvirt.DomainInterface, error) {
	nic := func(name, mac, ip string) libvirt.DomainInterface {
		typ := int32(libvirt.IPAddrTypeIpv4)
		if strings.Contains(ip, ":") {
			typ = int32(libvirt.IPAddrTypeIpv6)
		}
		return libvirt.DomainInterface{Name: name, Hwaddr: libvirt.OptString{mac}, Addrs: []libvirt.DomainIPAddr{{Type: typ, Addr: ip, Prefix: 24}}}
	}
	var table map[string]string
	switch source {
	case libvirt.DomainInterfaceAddressesSrcAgent:
		if d.AgentAddress == "" {
			return nil, Errorf(libvirt.ErrAgentUnresponsive, "Guest agent is not responding: QEMU guest agent is not connected")
		}
		return []libvirt.DomainInterface{nic("lo", "00:00:00:00:00:00", "127.0.0.1"), nic("eth0", d.MAC, d.AgentAddress)}, nil
	case libvirt.DomainInterfaceAddressesSrcLease:
		table = h.leases
	case libvirt.DomainInterfaceAddressesSrcArp:
		table = h.arp
	default:
		return nil, Errorf(libvirt.ErrInvalidArg, "invalid argument: Unknown IP address data source %d", source)
	}
	if ip, ok := table[d.MAC]; ok {
		return []libvirt.DomainInterface{nic("vnet0", d.MAC, ip)}, nil
	}
	return nil, nil
}
