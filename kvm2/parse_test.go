package kvm2

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"libvirt.org/go/libvirtxml"
)

// twoPassParse is how readDomain decoded a domain's XML before it was
// made a single pass (kept as the reference the single pass must agree
// with, and as the "before" of BenchmarkParseDomainXML): a token scan for
// our metadata, then a whole libvirtxml.Domain.Unmarshal only for the
// first NIC's MAC.
func twoPassParse(doc string) (instanceMeta, error, string) {
	m, err := parseMetadata(doc)
	var d libvirtxml.Domain
	mac := ""
	if uerr := d.Unmarshal(doc); uerr == nil && d.Devices != nil && len(d.Devices.Interfaces) > 0 && d.Devices.Interfaces[0].MAC != nil {
		mac = d.Devices.Interfaces[0].MAC.Address
	}
	return m, err, mac
}

// libvirtDomainXML returns the XML libvirt 9.0 gave for a domain built by
// buildDomainXML (testdata, captured with virsh dumpxml on the stack):
// running (live XML: MAC, aliases, PCI addresses) and shut off.
func libvirtDomainXML(t testing.TB, state string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "domain-"+state+".xml"))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// BenchmarkParseDomainXML measures decoding one domain's XML as Get and
// List do, on XML libvirt produced.
func BenchmarkParseDomainXML(b *testing.B) {
	for _, state := range []string{"running", "shutoff"} {
		doc := libvirtDomainXML(b, state)
		b.Run("two-pass/"+state, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err, _ := twoPassParse(doc); err != nil && !errors.Is(err, errNoMetadata) {
					b.Fatal(err)
				}
			}
		})
	}
}
