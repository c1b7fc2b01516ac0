package kvm2

import (
	"encoding/xml"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"libvirt.org/go/libvirtxml"

	"github.com/egressproxy/egressproxy/internal/domainmeta"
)

// refParseMetadata is how parseMetadata read the metadata before
// parseDomainXML: a token scan up to the element, then its decoding
// (internal/domainmeta.Parse, which benchutil decodes with too), the
// reference the single pass must agree with.
func refParseMetadata(doc string) (instanceMeta, error) { return domainmeta.Parse(doc) }

// refMAC is how readDomain read the first NIC's MAC before
// parseDomainXML: a whole libvirtxml.Domain.Unmarshal. uerr is
// libvirtxml's error.
func refMAC(doc string) (mac string, uerr error) {
	var d libvirtxml.Domain
	if err := d.Unmarshal(doc); err != nil {
		return "", err
	}
	if d.Devices != nil && len(d.Devices.Interfaces) > 0 && d.Devices.Interfaces[0].MAC != nil {
		return d.Devices.Interfaces[0].MAC.Address, nil
	}
	return "", nil
}

// twoPassParse is the whole decoding readDomain did before: the metadata
// token scan, then libvirtxml for the MAC (the "before" of
// BenchmarkParseDomainXML).
func twoPassParse(doc string) (instanceMeta, string, error) {
	m, err := refParseMetadata(doc)
	mac, _ := refMAC(doc)
	return m, mac, err
}

// libvirtDomainXML returns the XML libvirt 9.0 gave for a domain built by
// buildDomainXML (testdata, captured with virsh dumpxml on the stack):
// running (live XML: aliases, PCI addresses, runtime paths) and shut off.
// Both carry the NIC's MAC 52:54:00:75:01:e1.
func libvirtDomainXML(t testing.TB, state string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "domain-"+state+".xml"))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func errText(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}

// checkAgainstReference fails t unless parseDomainXML(doc, wantMAC) gives
// the reference's metadata and metadata error, and — with wantMAC, where
// libvirtxml reads the document or refuses it as not well formed — the
// reference's MAC; without wantMAC, no MAC.
func checkAgainstReference(t *testing.T, doc string, wantMAC bool) domainXMLInfo {
	t.Helper()
	got := parseDomainXML(doc, wantMAC)
	m, err := refParseMetadata(doc)
	if got.meta != m || errText(got.metaErr) != errText(err) {
		t.Errorf("metadata = %+v, %v; reference %+v, %v\n%s", got.meta, got.metaErr, m, err, doc)
	}
	if errors.Is(err, errNoMetadata) != errors.Is(got.metaErr, errNoMetadata) {
		t.Errorf("errNoMetadata: got %v, reference %v", got.metaErr, err)
	}
	if !wantMAC {
		if got.mac != "" {
			t.Errorf("MAC %q read without wantMAC", got.mac)
		}
		return got
	}
	mac, uerr := refMAC(doc)
	var se *xml.SyntaxError
	if (uerr == nil || errors.As(uerr, &se)) && got.mac != mac {
		t.Errorf("MAC = %q, libvirtxml %q (error %v)\n%s", got.mac, mac, uerr, doc)
	}
	return got
}

const testMeta = `<metadata><ep:instance xmlns:ep="https://egressproxy.dev/xmlns/instance/v1"><ep:uid>u1</ep:uid>` +
	`<ep:created>2026-11-30T11:00:00Z</ep:created><ep:entry>lab-1</ep:entry><ep:owner>o</ep:owner><ep:port>3128</ep:port></ep:instance></metadata>`

func TestParseDomainXML(t *testing.T) {
	t.Parallel()
	running, shutoff := libvirtDomainXML(t, "running"), libvirtDomainXML(t, "shutoff")
	built, err := buildDomainXML(testParams())
	if err != nil {
		t.Fatal(err)
	}
	nic := func(mac string) string {
		return `<interface type="network"><mac address="` + mac + `"/><source network="n"/></interface>`
	}
	dom := func(devices string) string {
		return `<domain type="qemu"><name>x</name>` + testMeta + `<devices>` + devices + `</devices></domain>`
	}
	tests := []struct {
		name    string
		doc     string
		wantMAC string // with wantMAC
		wantErr bool   // metadata error other than errNoMetadata
		noMeta  bool
	}{
		{"libvirt running", running, "52:54:00:75:01:e1", false, false},
		{"libvirt shut off", shutoff, "52:54:00:75:01:e1", false, false},
		{"built (no MAC yet)", built, "", false, false},
		{"first of two NICs", dom(nic("52:54:00:00:00:01") + nic("52:54:00:00:00:02")), "52:54:00:00:00:01", false, false},
		{"NIC after other devices", dom(`<disk type="file" device="disk"><mac address="no"/></disk>` + nic("52:54:00:00:00:03")), "52:54:00:00:00:03", false, false},
		{"NIC in a second devices", `<domain><devices><disk type="file" device="disk"/></devices>` + testMeta + `<devices>` + nic("52:54:00:00:00:04") + `</devices></domain>`, "52:54:00:00:00:04", false, false},
		{"first NIC has no mac", dom(`<interface type="network"/>` + nic("52:54:00:00:00:05")), "", false, false},
		{"mac without address", dom(`<interface type="network"><mac/></interface>`), "", false, false},
		{"last address of two macs", dom(`<interface type="network"><mac address="a"/><mac/><mac address="b"/><mac type="x"/></interface>`), "b", false, false},
		{"namespaced names", `<d:domain xmlns:d="urn:x" xmlns:q="urn:q">` + testMeta + `<q:devices><d:interface d:type="network"><q:mac q:address="m1"/></d:interface></q:devices></d:domain>`, "m1", false, false},
		{"nested mac is not the NIC's", dom(`<interface type="network"><source><mac address="no"/></source></interface>`), "", false, false},
		{"interface outside devices", `<domain>` + testMeta + nic("no") + `<devices>` + nic("52:54:00:00:00:06") + `</devices></domain>`, "52:54:00:00:00:06", false, false},
		{"interface without type", dom(nic("52:54:00:00:00:07") + `<interface><mac address="x"/></interface>`), "", false, false},
		{"not a domain", `<network>` + testMeta + `<devices>` + nic("no") + `</devices></network>`, "", false, false},
		{"syntax error after the NIC", dom(nic("52:54:00:00:00:08")+`<video>`) + `</x>`, "", false, false},
		{"unclosed root", strings.TrimSuffix(dom(nic("52:54:00:00:00:09")), "</domain>"), "", false, false},
		{"garbage after the root", dom(nic("52:54:00:00:00:0a")) + `<<<`, "52:54:00:00:00:0a", false, false},
		{"metadata after the NIC", `<domain><devices>` + nic("52:54:00:00:00:0b") + `</devices>` + testMeta + `</domain>`, "52:54:00:00:00:0b", false, false},
		{"metadata after the root", `<domain><devices>` + nic("52:54:00:00:00:0c") + `</devices></domain>` + testMeta, "52:54:00:00:00:0c", false, false},
		{"metadata prefix declared on the root", `<domain xmlns:ep="https://egressproxy.dev/xmlns/instance/v1"><metadata><ep:instance><ep:uid>u</ep:uid><ep:created>2026-11-30T11:00:00Z</ep:created><ep:entry>e</ep:entry><ep:owner>o</ep:owner><ep:port>1</ep:port></ep:instance></metadata><devices>` + nic("52:54:00:00:00:0d") + `</devices></domain>`, "52:54:00:00:00:0d", false, false},
		{"malformed metadata, NIC still read", strings.Replace(dom(nic("52:54:00:00:00:0e")), "3128", "0", 1), "52:54:00:00:00:0e", true, false},
		{"metadata not well formed", strings.Replace(dom(nic("52:54:00:00:00:0f")), "</ep:uid>", "</ep:uidx>", 1), "", true, false},
		{"no metadata", `<domain><devices>` + nic("52:54:00:00:00:10") + `</devices></domain>`, "52:54:00:00:00:10", false, true},
		{"foreign namespace", strings.ReplaceAll(dom(nic("m")), "https://egressproxy.dev/xmlns/instance/v1", "https://egressproxy.dev/xmlns/instance/v0"), "m", false, true},
		{"metadata element alone", strings.TrimSuffix(strings.TrimPrefix(testMeta, "<metadata>"), "</metadata>"), "", false, false},
		{"empty", "", "", false, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, wantMAC := range []bool{true, false} {
				got := checkAgainstReference(t, tt.doc, wantMAC)
				if wantMAC && got.mac != tt.wantMAC {
					t.Errorf("MAC = %q, want %q", got.mac, tt.wantMAC)
				}
				switch {
				case tt.noMeta:
					if !errors.Is(got.metaErr, errNoMetadata) {
						t.Errorf("metadata error %v, want errNoMetadata", got.metaErr)
					}
				case tt.wantErr:
					if got.metaErr == nil || errors.Is(got.metaErr, errNoMetadata) {
						t.Errorf("metadata error %v, want a parse error", got.metaErr)
					}
				case got.metaErr != nil:
					t.Errorf("metadata error %v", got.metaErr)
				}
			}
		})
	}
}

// FuzzParseDomainXML: for any document, the single pass gives exactly the
// metadata and metadata error of the two-pass decoding it replaced, and the
// MAC libvirtxml gives whenever libvirtxml reads the document (or refuses
// it as not well formed); without wantMAC it reads no MAC.
func FuzzParseDomainXML(f *testing.F) {
	f.Add(libvirtDomainXML(f, "running"), true)
	f.Add(libvirtDomainXML(f, "shutoff"), false)
	built, err := buildDomainXML(testParams())
	if err != nil {
		f.Fatal(err)
	}
	f.Add(built, true)
	f.Add(`<domain>`+testMeta+`<devices><interface type="t"><mac address="a"/><mac address="b"/></interface><interface type="u"/></devices></domain>`, true)
	f.Add(`<d:domain xmlns:d="urn:x"><devices><interface xmlns:type="t"><mac xmlns:address="a"/></interface></devices></d:domain>`, true)
	f.Add(`<domain><devices><interface type="t"><mac address="a"/></interface><interface/></devices></domain>`, true)
	f.Fuzz(func(t *testing.T, doc string, wantMAC bool) {
		checkAgainstReference(t, doc, wantMAC)
	})
}

// BenchmarkParseDomainXML measures decoding one domain's XML as Get and
// List do, on XML libvirt produced: before (two-pass: metadata token scan,
// then libvirtxml.Domain.Unmarshal for the MAC, whatever the state) and
// after (one pass; MAC only for an active domain, so a shut-off one stops
// at the metadata).
func BenchmarkParseDomainXML(b *testing.B) {
	for _, state := range []string{"running", "shutoff"} {
		doc := libvirtDomainXML(b, state)
		b.Run("two-pass/"+state, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, mac, err := twoPassParse(doc); err != nil || mac == "" {
					b.Fatal(err, mac)
				}
			}
		})
		b.Run("one-pass/"+state, func(b *testing.B) {
			b.ReportAllocs()
			active := state == "running"
			for b.Loop() {
				if x := parseDomainXML(doc, active); x.metaErr != nil || (x.mac == "") == active {
					b.Fatal(x.metaErr, x.mac)
				}
			}
		})
	}
}
