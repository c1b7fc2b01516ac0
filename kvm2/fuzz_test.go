package kvm2

import (
	"errors"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
	"libvirt.org/go/libvirtxml"
	"sigs.k8s.io/yaml"
)

// FuzzDomainXML: for any instance name, UID, owner, port, kernel command
// line and network name, the builder either refuses with a Permanent error
// naming a field, or produces XML that libvirtxml parses back to the same
// name, metadata, command line and network: no input can break out of its
// element or attribute.
func FuzzDomainXML(f *testing.F) {
	f.Add("proxy-a", "6f1c2a4e-uid", "operator-a", 3128, "console=ttyS0", "default", int64(1764500000))
	f.Add("p", `</egressproxy:uid><x a="b">&amp;'"`, "o", 1, `a"b<c>&d'e`, "net'work\"<&>", int64(0))
	f.Add("a-b", "ünï©ødé ✓ 🚀", "owner", 65535, "", "n", int64(-1))
	f.Add("x", "a\uFFFEb", "o", 80, "\x00", "n", int64(1))
	f.Fuzz(func(t *testing.T, name, uid, owner string, port int, cmdline, network string, created int64) {
		if naming.ValidateName("Name", name) != nil || naming.ValidateName("Owner", owner) != nil ||
			(egressproxy.Spec{Name: "x", UID: uid}).Validate() != nil || port < 1 || port > 65535 {
			return // the portable layer rejects these before the builder
		}
		p := testParams()
		p.Name = domainName("lab-1", name)
		p.Overlay, p.Seed = overlayVolume(p.Name), seedVolume(p.Name)
		p.Kernel, p.Cmdline = "/boot/vmlinuz", cmdline
		p.Network = network
		p.Meta = instanceMeta{UID: uid, Created: time.Unix(created%(1<<40), created%1e9).UTC(), Entry: "lab-1", Owner: owner, Port: port}
		s, err := buildDomainXML(p)
		if err != nil {
			var fe *errs.FieldError
			if errs.Code(err) != errs.Permanent || !errors.As(err, &fe) {
				t.Fatalf("refusal %v is not a Permanent field error", err)
			}
			if checkXMLText("UID", uid) == nil && checkXMLText("Cmdline", cmdline) == nil && checkXMLText("Network", network) == nil && network != "" {
				t.Fatalf("refused valid input: %v", err)
			}
			return
		}
		var d libvirtxml.Domain
		if err := d.Unmarshal(s); err != nil {
			t.Fatalf("built XML does not parse: %v\n%s", err, s)
		}
		if d.Name != p.Name || d.OS.Cmdline != cmdline {
			t.Fatalf("name/cmdline changed: %q %q", d.Name, d.OS.Cmdline)
		}
		if d.Devices.Interfaces[0].Source.Network.Network != network {
			t.Fatalf("network changed: %q -> %q", network, d.Devices.Interfaces[0].Source.Network.Network)
		}
		m, err := parseMetadata(s)
		if err != nil {
			t.Fatalf("metadata does not parse: %v\n%s", err, s)
		}
		if m.UID != uid || m.Owner != owner || m.Port != port || !m.Created.Equal(p.Meta.Created) {
			t.Fatalf("metadata round trip: got %+v want %+v", m, p.Meta)
		}
		if strings.Count(s, "<egressproxy:instance ") != 1 {
			t.Fatalf("metadata element appears %d times", strings.Count(s, "<egressproxy:instance "))
		}
	})
}

// FuzzSeed: any valid instance (UID, name) and user-data of allowed size
// gives an ISO 9660 image labelled cidata whose user-data is the input byte
// for byte and whose meta-data parses to the same instance-id and hostname.
func FuzzSeed(f *testing.F) {
	f.Add("uid-1", "proxy-a", "#cloud-config\npackages: [squid]\n")
	f.Add(`a: b # "c" 'd'`, "p", "")
	f.Add("- [x, y]", "h", "---\n...\n\x00\xff")
	f.Add("ünï ✓", "a-b", strings.Repeat("é", 1000))
	f.Fuzz(func(t *testing.T, uid, name, userData string) {
		if (egressproxy.Spec{Name: name, UID: uid}).Validate() != nil {
			return
		}
		iso, err := buildSeed(seedData{InstanceID: uid, Hostname: name, UserData: userData})
		if len(userData) > naming.MaxUserDataBytes {
			if errs.Code(err) != errs.Permanent {
				t.Fatalf("oversized user-data: err %v", err)
			}
			return
		}
		if err != nil {
			t.Fatalf("buildSeed: %v", err)
		}
		label, files := readSeed(t, iso)
		if label != "cidata" {
			t.Fatalf("label %q", label)
		}
		if files["user-data"] != userData {
			t.Fatalf("user-data changed: %q -> %q", userData, files["user-data"])
		}
		var md map[string]string
		if err := yaml.Unmarshal([]byte(files["meta-data"]), &md); err != nil {
			t.Fatalf("meta-data %q: %v", files["meta-data"], err)
		}
		if utf8.ValidString(uid) && (md["instance-id"] != uid || md["local-hostname"] != name) {
			t.Fatalf("meta-data = %v, want %q/%q", md, uid, name)
		}
	})
}
