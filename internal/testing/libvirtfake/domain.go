package libvirtfake

import (
	"github.com/digitalocean/go-libvirt"
	"libvirt.org/go/libvirtxml"
)

// domain is one defined domain. There is no lifecycle: every domain is
// shut off. A kvm2 fake adds state (running, paused) here.
type domain struct {
	uuid libvirt.UUID
	xml  string
}

func errNoDomain(name string) error {
	return lverr(libvirt.ErrNoDomain, "Domain not found: no domain with matching name '%s'", name)
}

// DomainDefineXML defines a domain from its XML (name required); defining
// an existing name replaces its XML and keeps its UUID.
func (s *Session) DomainDefineXML(XML string) (rDom libvirt.Domain, err error) {
	var d libvirtxml.Domain
	perr := d.Unmarshal(XML)
	if err := s.h.enter(Call{Method: "DomainDefineXML", Session: s}); err != nil {
		return libvirt.Domain{}, err
	}
	if perr != nil {
		return libvirt.Domain{}, lverr(libvirt.ErrXMLError, "XML error: %v", perr)
	}
	if d.Name == "" {
		return libvirt.Domain{}, lverr(libvirt.ErrXMLError, "XML error: missing domain name information")
	}
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	dom, ok := s.h.domains[d.Name]
	if !ok {
		dom = &domain{uuid: s.h.uuidLocked()}
		s.h.domains[d.Name] = dom
	}
	dom.xml = XML
	return libvirt.Domain{Name: d.Name, UUID: dom.uuid, ID: -1}, nil
}

// DomainUndefine forgets a domain.
func (s *Session) DomainUndefine(Dom libvirt.Domain) (err error) {
	if err := s.h.enter(Call{Method: "DomainUndefine", Session: s}); err != nil {
		return err
	}
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	if _, ok := s.h.domains[Dom.Name]; !ok {
		return errNoDomain(Dom.Name)
	}
	delete(s.h.domains, Dom.Name)
	return nil
}

// ConnectListAllDomains lists the defined domains, sorted by name. Every
// domain is inactive: ConnectListDomainsActive alone lists none.
func (s *Session) ConnectListAllDomains(NeedResults int32, Flags libvirt.ConnectListAllDomainsFlags) (rDomains []libvirt.Domain, rRet uint32, err error) {
	if err := s.h.enter(Call{Method: "ConnectListAllDomains", Session: s}); err != nil {
		return nil, 0, err
	}
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	if Flags&(libvirt.ConnectListDomainsActive|libvirt.ConnectListDomainsInactive) == libvirt.ConnectListDomainsActive {
		return nil, 0, nil
	}
	for _, n := range sortedKeys(s.h.domains) {
		rDomains = append(rDomains, libvirt.Domain{Name: n, UUID: s.h.domains[n].uuid, ID: -1})
	}
	return rDomains, uint32(len(rDomains)), nil
}

// DomainGetXMLDesc returns the XML the domain was defined with.
func (s *Session) DomainGetXMLDesc(Dom libvirt.Domain, Flags libvirt.DomainXMLFlags) (rXML string, err error) {
	if err := s.h.enter(Call{Method: "DomainGetXMLDesc", Session: s}); err != nil {
		return "", err
	}
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	d, ok := s.h.domains[Dom.Name]
	if !ok {
		return "", errNoDomain(Dom.Name)
	}
	return d.xml, nil
}
