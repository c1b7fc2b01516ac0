package kvm2

import (
	"bytes"
	"encoding/xml"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"libvirt.org/go/libvirtxml"

	"github.com/egressproxy/egressproxy/internal/domainmeta"
	"github.com/egressproxy/egressproxy/internal/errs"
)

// metadataNamespace is the XML namespace of the library's own element in a
// domain's <metadata>. Only domains carrying an element of exactly this
// namespace (with this provider's entry and owner) are instances of the
// provider; other namespaces, including older versions, are never ours.
const metadataNamespace = domainmeta.Namespace

// metadataPrefix is the namespace prefix written into the domain XML.
const metadataPrefix = "egressproxy"

// domainPrefix starts every domain (and so overlay and seed volume) name,
// which keeps them apart from imagecache's "base-" and "claim-" volumes.
const domainPrefix = "ep-"

// domainName is "ep-<entry>--<name>". Neither entry nor name contain "--"
// (naming.ValidateName), so the mapping is injective.
func domainName(entry, name string) string { return domainPrefix + entry + "--" + name }

// overlayVolume is the name of the instance's qcow2 overlay.
func overlayVolume(domain string) string { return domain + ".qcow2" }

// seedVolume is the name of the instance's cloud-init seed ISO.
func seedVolume(domain string) string { return domain + "-seed.iso" }

// instanceMeta is what the library records in a domain's metadata; its
// decoding and checks are internal/domainmeta's (shared with benchutil).
type instanceMeta = domainmeta.Meta

// checkXMLText returns an error naming field when s cannot be carried by XML
// 1.0 character data unchanged (invalid UTF-8, or a character outside the
// XML Char production such as most control characters or U+FFFE).
func checkXMLText(field, s string) error {
	if !utf8.ValidString(s) {
		return fieldErr(field, "", "must be valid UTF-8")
	}
	for _, r := range s {
		if !isXMLChar(r) {
			return fieldErr(field, s, fmt.Sprintf("contains %U, which XML cannot carry", r))
		}
	}
	return nil
}

func isXMLChar(r rune) bool {
	return r == 0x09 || r == 0x0A || r == 0x0D ||
		r >= 0x20 && r <= 0xD7FF ||
		r >= 0xE000 && r <= 0xFFFD ||
		r >= 0x10000 && r <= 0x10FFFF
}

// marshalMetadata writes our metadata element with the encoder (every value
// escaped by it):
//
//	<egressproxy:instance xmlns:egressproxy="https://egressproxy.dev/xmlns/instance/v1">
//	  <egressproxy:uid>…</egressproxy:uid> <egressproxy:created>RFC 3339</egressproxy:created>
//	  <egressproxy:entry>…</egressproxy:entry> <egressproxy:owner>…</egressproxy:owner>
//	  <egressproxy:port>3128</egressproxy:port>
//	  <egressproxy:spec-digest>sha256:…</egressproxy:spec-digest>
//	</egressproxy:instance>
//
// spec-digest is written only when m.SpecDigest is set.
func marshalMetadata(m instanceMeta) (string, error) {
	if err := checkXMLText("UID", m.UID); err != nil {
		return "", errs.WithCode(errs.Permanent, err)
	}
	if err := checkXMLText("SpecDigest", m.SpecDigest); err != nil {
		return "", errs.WithCode(errs.Permanent, err)
	}
	var buf bytes.Buffer
	enc := xml.NewEncoder(&buf)
	el := func(local string) xml.Name { return xml.Name{Local: metadataPrefix + ":" + local} }
	root := xml.StartElement{
		Name: el("instance"),
		Attr: []xml.Attr{{Name: xml.Name{Local: "xmlns:" + metadataPrefix}, Value: metadataNamespace}},
	}
	toks := []xml.Token{root}
	fields := [][2]string{
		{"uid", m.UID},
		{"created", m.Created.UTC().Format(time.RFC3339Nano)},
		{"entry", m.Entry},
		{"owner", m.Owner},
		{"port", strconv.Itoa(m.Port)},
	}
	if m.SpecDigest != "" {
		fields = append(fields, [2]string{"spec-digest", m.SpecDigest})
	}
	for _, kv := range fields {
		toks = append(toks, xml.StartElement{Name: el(kv[0])}, xml.CharData(kv[1]), xml.EndElement{Name: el(kv[0])})
	}
	toks = append(toks, root.End())
	for _, t := range toks {
		if err := enc.EncodeToken(t); err != nil {
			return "", fmt.Errorf("encode metadata: %w", err)
		}
	}
	if err := enc.Flush(); err != nil {
		return "", fmt.Errorf("encode metadata: %w", err)
	}
	return buf.String(), nil
}

// errNoMetadata: the XML has no element of metadataNamespace.
var errNoMetadata = domainmeta.ErrNoMetadata

// parseMetadata finds our metadata element anywhere in doc (a whole domain
// XML, the inner XML of <metadata>, or the element itself), resolving
// namespace prefixes, and decodes it. errNoMetadata when absent; another
// error when present but malformed. It reads doc only up to that element.
func parseMetadata(doc string) (instanceMeta, error) {
	x := parseDomainXML(doc, false)
	return x.meta, x.metaErr
}

// domainXMLInfo is what kvm2 reads from a domain's XML.
type domainXMLInfo struct {
	meta    instanceMeta
	metaErr error  // nil, errNoMetadata when absent, another error when malformed
	mac     string // hardware address of the first NIC (only when asked for)
}

// parseDomainXML reads our metadata (as parseMetadata) and, with wantMAC,
// the hardware address of the domain's first NIC, in one pass over doc's
// token stream. Without wantMAC it stops at our metadata element, which
// libvirt writes near the top; with it, it reads the root element to its
// end.
//
// The MAC is the one libvirtxml.Domain.Unmarshal would give as
// Devices.Interfaces[0].MAC.Address: the root element must be <domain>
// and well formed to its end, the first <interface> child of a <devices>
// child of the root is the first NIC, and the address attribute of its
// last <mac> child carrying one wins; every <interface> there needs a type
// attribute. Element and attribute names are matched by local name, in any
// namespace, as encoding/xml does for libvirtxml's untagged fields. When
// libvirtxml would refuse the document, the MAC is empty, except for
// refusals of values elsewhere in it (a number that does not parse, a
// device lacking a required attribute), which libvirt never writes and
// which this does not check.
func parseDomainXML(doc string, wantMAC bool) domainXMLInfo {
	out := domainXMLInfo{metaErr: errNoMetadata}
	dec := xml.NewDecoder(strings.NewReader(doc))
	metaDone := false
	nic := firstNIC{done: !wantMAC}
	for !metaDone || !nic.done {
		tok, err := dec.Token()
		if err != nil {
			if !metaDone && err != io.EOF {
				out.metaErr = fmt.Errorf("parse domain metadata: %w", err)
			}
			nic.refuse() // libvirtxml refuses a document it cannot read to the root's end
			break
		}
		switch t := tok.(type) {
		case xml.StartElement:
			nic.root(t)
			if !metaDone && t.Name.Space == metadataNamespace && t.Name.Local == "instance" {
				metaDone = true
				// A syntax error inside it sticks to dec: the next
				// Token ends the loop.
				out.meta, out.metaErr = domainmeta.Decode(dec, &t)
				continue // the element, consumed, was none of the NIC's
			}
			nic.start(t)
		case xml.EndElement:
			nic.end()
		}
	}
	out.mac = nic.mac
	return out
}

// firstNIC follows parseDomainXML's token stream to the hardware address
// of the domain's first NIC, as libvirtxml would read it (see
// parseDomainXML). done: the address is known (or there is none to know);
// elements are still counted so that depths stay right.
type firstNIC struct {
	done      bool
	depth     int  // elements open around the next token
	rootSeen  bool // the root element has started
	inDevices bool // inside a <devices> child of the root
	nic       int  // first NIC: 0 not seen, 1 inside it, 2 passed
	mac       string
}

// root sees every start element before parseDomainXML looks at it: the
// first one is the root, and a root other than <domain> has no NIC
// (libvirtxml refuses the document).
func (n *firstNIC) root(t xml.StartElement) {
	if n.depth == 0 && !n.rootSeen {
		n.rootSeen = true
		if !n.done && t.Name.Local != "domain" {
			n.done = true
		}
	}
}

// start sees a start element that parseDomainXML did not consume.
func (n *firstNIC) start(t xml.StartElement) {
	n.depth++
	if n.done {
		return
	}
	switch {
	case n.depth == 2 && t.Name.Local == "devices":
		n.inDevices = true
	case n.depth == 3 && n.inDevices && t.Name.Local == "interface":
		if !hasAttr(t.Attr, "type") {
			n.refuse() // libvirtxml: missing interface type attribute
			return
		}
		if n.nic == 0 {
			n.nic = 1
		}
	case n.depth == 4 && n.nic == 1 && t.Name.Local == "mac":
		for _, a := range t.Attr {
			if a.Name.Local == "address" {
				n.mac = a.Value
			}
		}
	}
}

// end sees an end element.
func (n *firstNIC) end() {
	n.depth--
	if n.done {
		return
	}
	switch n.depth {
	case 0:
		n.done = true // libvirtxml reads nothing after the root
	case 1:
		n.inDevices = false
	case 2:
		if n.nic == 1 {
			n.nic = 2
		}
	}
}

// refuse ends the scan without an address, unless it had ended already:
// libvirtxml would refuse the document.
func (n *firstNIC) refuse() {
	if !n.done {
		n.mac, n.done = "", true
	}
}

func hasAttr(attrs []xml.Attr, local string) bool {
	for _, a := range attrs {
		if a.Name.Local == local {
			return true
		}
	}
	return false
}

// domainParams is everything the domain definition is built from.
type domainParams struct {
	Name       string // libvirt domain name
	Type       string // "qemu" or "kvm"
	VCPUs      int
	MemoryMiB  int
	Pool       string // storage pool of the overlay and the seed
	Overlay    string // overlay volume name (qcow2)
	Seed       string // seed ISO volume name
	Network    string // libvirt network, or
	Bridge     string // host bridge
	Kernel     string // direct kernel boot (optional)
	Initrd     string
	Cmdline    string
	ConsoleLog string // host file receiving the serial console (optional)
	Meta       instanceMeta
}

// guestAgentChannel is the virtio-serial name of the QEMU guest agent.
const guestAgentChannel = "org.qemu.guest_agent.0"

// buildDomain returns the domain definition built from libvirtxml structs.
func buildDomain(p domainParams) (*libvirtxml.Domain, error) {
	for _, f := range []struct{ field, val string }{
		{"Name", p.Name}, {"Pool", p.Pool}, {"Overlay", p.Overlay}, {"Seed", p.Seed},
		{"Network", p.Network}, {"Bridge", p.Bridge}, {"Kernel", p.Kernel}, {"Initrd", p.Initrd},
		{"Cmdline", p.Cmdline}, {"ConsoleLog", p.ConsoleLog}, {"Entry", p.Meta.Entry}, {"Owner", p.Meta.Owner},
	} {
		if err := checkXMLText(f.field, f.val); err != nil {
			return nil, errs.WithCode(errs.Permanent, err)
		}
	}
	switch {
	case p.Name == "":
		return nil, errs.WithCode(errs.Permanent, fieldErr("Name", "", "is required"))
	case p.VCPUs < 1:
		return nil, errs.WithCode(errs.Permanent, fieldErr("VCPUs", strconv.Itoa(p.VCPUs), "must be at least 1"))
	case p.MemoryMiB < 1:
		return nil, errs.WithCode(errs.Permanent, fieldErr("MemoryMiB", strconv.Itoa(p.MemoryMiB), "must be at least 1"))
	case (p.Network == "") == (p.Bridge == ""):
		return nil, errs.WithCode(errs.Permanent, fieldErr("Network", p.Network, "exactly one of Network and Bridge must be set"))
	}
	meta, err := marshalMetadata(p.Meta)
	if err != nil {
		return nil, err
	}
	typ := p.Type
	if typ == "" {
		typ = defaultDomainType
	}
	zero := uint(0)
	os := &libvirtxml.DomainOS{
		Type: &libvirtxml.DomainOSType{Arch: "x86_64", Type: "hvm"},
	}
	if p.Kernel != "" {
		os.Kernel, os.Initrd, os.Cmdline = p.Kernel, p.Initrd, p.Cmdline
	} else {
		os.BootDevices = []libvirtxml.DomainBootDevice{{Dev: "hd"}}
	}
	nic := libvirtxml.DomainInterface{
		Model: &libvirtxml.DomainInterfaceModel{Type: "virtio"},
	}
	if p.Network != "" {
		nic.Source = &libvirtxml.DomainInterfaceSource{Network: &libvirtxml.DomainInterfaceSourceNetwork{Network: p.Network}}
	} else {
		nic.Source = &libvirtxml.DomainInterfaceSource{Bridge: &libvirtxml.DomainInterfaceSourceBridge{Bridge: p.Bridge}}
	}
	serial := libvirtxml.DomainSerial{
		Source: &libvirtxml.DomainChardevSource{Pty: &libvirtxml.DomainChardevSourcePty{}},
		Target: &libvirtxml.DomainSerialTarget{Port: &zero},
	}
	if p.ConsoleLog != "" {
		serial.Log = &libvirtxml.DomainChardevLog{File: p.ConsoleLog, Append: "on"}
	}
	d := &libvirtxml.Domain{
		Type:     typ,
		Name:     p.Name,
		Metadata: &libvirtxml.DomainMetadata{XML: meta},
		Memory:   &libvirtxml.DomainMemory{Value: uint(p.MemoryMiB), Unit: "MiB"},
		VCPU:     &libvirtxml.DomainVCPU{Value: uint(p.VCPUs)},
		OS:       os,
		Features: &libvirtxml.DomainFeatureList{
			ACPI: &libvirtxml.DomainFeature{},
			APIC: &libvirtxml.DomainFeatureAPIC{},
		},
		OnPoweroff: "destroy",
		OnReboot:   "restart",
		OnCrash:    "destroy",
		Devices: &libvirtxml.DomainDeviceList{
			Disks: []libvirtxml.DomainDisk{
				{
					Device: "disk",
					Driver: &libvirtxml.DomainDiskDriver{Name: "qemu", Type: "qcow2"},
					Source: &libvirtxml.DomainDiskSource{Volume: &libvirtxml.DomainDiskSourceVolume{Pool: p.Pool, Volume: p.Overlay}},
					Target: &libvirtxml.DomainDiskTarget{Dev: "vda", Bus: "virtio"},
				},
				{
					Device:   "cdrom",
					Driver:   &libvirtxml.DomainDiskDriver{Name: "qemu", Type: "raw"},
					Source:   &libvirtxml.DomainDiskSource{Volume: &libvirtxml.DomainDiskSourceVolume{Pool: p.Pool, Volume: p.Seed}},
					Target:   &libvirtxml.DomainDiskTarget{Dev: "sda", Bus: "sata"},
					ReadOnly: &libvirtxml.DomainDiskReadOnly{},
				},
			},
			Interfaces: []libvirtxml.DomainInterface{nic},
			Serials:    []libvirtxml.DomainSerial{serial},
			Consoles: []libvirtxml.DomainConsole{{
				Source: &libvirtxml.DomainChardevSource{Pty: &libvirtxml.DomainChardevSourcePty{}},
				Target: &libvirtxml.DomainConsoleTarget{Type: "serial", Port: &zero},
			}},
			Channels: []libvirtxml.DomainChannel{{
				Source: &libvirtxml.DomainChardevSource{UNIX: &libvirtxml.DomainChardevSourceUNIX{Mode: "bind"}},
				Target: &libvirtxml.DomainChannelTarget{VirtIO: &libvirtxml.DomainChannelTargetVirtIO{Name: guestAgentChannel}},
			}},
		},
	}
	return d, nil
}

// buildDomainXML returns the domain XML text of p.
func buildDomainXML(p domainParams) (string, error) {
	d, err := buildDomain(p)
	if err != nil {
		return "", err
	}
	s, err := d.Marshal()
	if err != nil {
		return "", errs.WithCode(errs.Permanent, fmt.Errorf("marshal domain %q: %w", p.Name, err))
	}
	return s, nil
}
