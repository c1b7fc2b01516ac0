package kvm2

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"libvirt.org/go/libvirtxml"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/domainmeta"
	"github.com/egressproxy/egressproxy/internal/errs"
)

func testParams() domainParams {
	return domainParams{
		Name:      domainName("lab-1", "proxy-a"),
		Type:      "qemu",
		VCPUs:     2,
		MemoryMiB: 768,
		Pool:      "pool",
		Overlay:   overlayVolume(domainName("lab-1", "proxy-a")),
		Seed:      seedVolume(domainName("lab-1", "proxy-a")),
		Network:   "default",
		Meta: instanceMeta{
			UID:        "6f1c2a4e-uid",
			Created:    time.Date(2026, 11, 30, 11, 0, 0, 123456789, time.UTC),
			Entry:      "lab-1",
			Owner:      "operator-a",
			Port:       3128,
			SpecDigest: egressproxy.Spec{Name: "proxy-a", UID: "6f1c2a4e-uid"}.Digest(),
		},
	}
}

func TestNames(t *testing.T) {
	t.Parallel()
	d := domainName("lab-1", "proxy-a")
	if d != "ep-lab-1--proxy-a" || overlayVolume(d) != "ep-lab-1--proxy-a.qcow2" || seedVolume(d) != "ep-lab-1--proxy-a-seed.iso" {
		t.Errorf("names: %s %s %s", d, overlayVolume(d), seedVolume(d))
	}
	// "--" cannot occur in entry or name, so these differ.
	if domainName("a-b", "c") == domainName("a", "b-c") {
		t.Error("domain names collide")
	}
}

func TestBuildDomain(t *testing.T) {
	t.Parallel()
	p := testParams()
	s, err := buildDomainXML(p)
	if err != nil {
		t.Fatalf("build: %v", err)
	}
	var d libvirtxml.Domain
	if err := d.Unmarshal(s); err != nil {
		t.Fatalf("unmarshal built XML: %v\n%s", err, s)
	}
	checks := []struct {
		what      string
		got, want any
	}{
		{"type", d.Type, "qemu"},
		{"name", d.Name, p.Name},
		{"memory", d.Memory.Value, uint(768)},
		{"memory unit", d.Memory.Unit, "MiB"},
		{"vcpus", d.VCPU.Value, uint(2)},
		{"disks", len(d.Devices.Disks), 2},
		{"overlay driver", d.Devices.Disks[0].Driver.Type, "qcow2"},
		{"overlay volume", d.Devices.Disks[0].Source.Volume.Volume, p.Overlay},
		{"overlay pool", d.Devices.Disks[0].Source.Volume.Pool, "pool"},
		{"cdrom device", d.Devices.Disks[1].Device, "cdrom"},
		{"seed volume", d.Devices.Disks[1].Source.Volume.Volume, p.Seed},
		{"cdrom readonly", d.Devices.Disks[1].ReadOnly != nil, true},
		{"nics", len(d.Devices.Interfaces), 1},
		{"network", d.Devices.Interfaces[0].Source.Network.Network, "default"},
		{"nic model", d.Devices.Interfaces[0].Model.Type, "virtio"},
		{"agent channel", d.Devices.Channels[0].Target.VirtIO.Name, "org.qemu.guest_agent.0"},
		{"agent unix", d.Devices.Channels[0].Source.UNIX != nil, true},
		{"serial", len(d.Devices.Serials), 1},
		{"console", d.Devices.Consoles[0].Target.Type, "serial"},
		{"boot from disk", d.OS.BootDevices[0].Dev, "hd"},
		{"no serial log", d.Devices.Serials[0].Log == nil, true},
	}
	for _, c := range checks {
		if !cmp.Equal(c.got, c.want) {
			t.Errorf("%s = %v, want %v", c.what, c.got, c.want)
		}
	}
	if !strings.Contains(s, `<egressproxy:instance xmlns:egressproxy="https://egressproxy.dev/xmlns/instance/v1">`) {
		t.Errorf("metadata element not in the expected form:\n%s", s)
	}
	m, err := parseMetadata(s)
	if err != nil {
		t.Fatalf("parseMetadata: %v", err)
	}
	if diff := cmp.Diff(p.Meta, m); diff != "" {
		t.Errorf("metadata round trip (-want +got):\n%s", diff)
	}
}

func TestBuildDomainVariants(t *testing.T) {
	t.Parallel()
	p := testParams()
	p.Network, p.Bridge = "", "br0"
	p.Type = "kvm"
	p.Kernel, p.Initrd, p.Cmdline = "/var/lib/k/vmlinuz", "/var/lib/k/initrd", `console=ttyS0 root=/dev/vda quiet "x<y>&z"`
	p.ConsoleLog = "/var/log/libvirt/qemu/x.log"
	s, err := buildDomainXML(p)
	if err != nil {
		t.Fatal(err)
	}
	var d libvirtxml.Domain
	if err := d.Unmarshal(s); err != nil {
		t.Fatal(err)
	}
	if d.Type != "kvm" || d.Devices.Interfaces[0].Source.Bridge == nil || d.Devices.Interfaces[0].Source.Bridge.Bridge != "br0" {
		t.Errorf("bridge/kvm not applied: %s", s)
	}
	if d.OS.Kernel != p.Kernel || d.OS.Initrd != p.Initrd || d.OS.Cmdline != p.Cmdline || len(d.OS.BootDevices) != 0 {
		t.Errorf("direct kernel boot = %+v", d.OS)
	}
	if d.Devices.Serials[0].Log == nil || d.Devices.Serials[0].Log.File != p.ConsoleLog {
		t.Errorf("serial log missing: %s", s)
	}
}

func TestMetadataEscaping(t *testing.T) {
	t.Parallel()
	p := testParams()
	p.Meta.UID = `</egressproxy:uid><evil a="b">&amp;'"` + "ünï©ødé ✓ " + strings.Repeat("x", 60)
	s, err := buildDomainXML(p)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(s, "<evil") {
		t.Fatalf("metacharacters reached the XML unescaped:\n%s", s)
	}
	m, err := parseMetadata(s)
	if err != nil {
		t.Fatal(err)
	}
	if m.UID != p.Meta.UID {
		t.Errorf("UID round trip: got %q want %q", m.UID, p.Meta.UID)
	}
}

func TestBuildDomainRejects(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		mutate func(*domainParams)
		field  string
	}{
		{"uid not xml", func(p *domainParams) { p.Meta.UID = "a\uFFFEb" }, "UID"},
		{"uid control", func(p *domainParams) { p.Meta.UID = "a\x01b" }, "UID"},
		{"cmdline invalid utf8", func(p *domainParams) { p.Kernel = "/k"; p.Cmdline = "a\xffb" }, "Cmdline"},
		{"no nic", func(p *domainParams) { p.Network = "" }, "Network"},
		{"two nics", func(p *domainParams) { p.Bridge = "br0" }, "Network"},
		{"no vcpu", func(p *domainParams) { p.VCPUs = 0 }, "VCPUs"},
		{"no name", func(p *domainParams) { p.Name = "" }, "Name"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := testParams()
			tt.mutate(&p)
			_, err := buildDomainXML(p)
			if errs.Code(err) != errs.Permanent {
				t.Fatalf("err = %v (code %v), want Permanent", err, errs.Code(err))
			}
			var fe *errs.FieldError
			if !errors.As(err, &fe) || fe.Field != tt.field {
				t.Errorf("err %v does not name field %s", err, tt.field)
			}
		})
	}
}

// TestMetadataSpecDigestOptional: the spec digest is written when set and
// read back; metadata without it (domains made before it was recorded)
// parses with an empty digest, and the element is not written when empty.
func TestMetadataSpecDigestOptional(t *testing.T) {
	t.Parallel()
	m := testParams().Meta
	x, err := marshalMetadata(m)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(x, "<egressproxy:spec-digest>"+m.SpecDigest+"</egressproxy:spec-digest>") {
		t.Errorf("spec digest not written:\n%s", x)
	}
	legacy := m
	legacy.SpecDigest = ""
	lx, err := marshalMetadata(legacy)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(lx, "spec-digest") {
		t.Errorf("an empty spec digest was written:\n%s", lx)
	}
	for doc, want := range map[string]string{x: m.SpecDigest, lx: "", testMeta: ""} {
		got, err := parseMetadata(doc)
		if err != nil || got.SpecDigest != want {
			t.Errorf("parseMetadata = %+v, %v; want SpecDigest %q\n%s", got, err, want, doc)
		}
	}
}

func TestParseMetadata(t *testing.T) {
	t.Parallel()
	good, err := marshalMetadata(testParams().Meta)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		doc     string
		wantErr error // errNoMetadata, or nil for "some other error" when bad is set
		bad     bool
	}{
		{"ours", "<domain><metadata>" + good + "</metadata></domain>", nil, false},
		{"default namespace form", `<instance xmlns="https://egressproxy.dev/xmlns/instance/v1"><uid>u</uid><created>2026-11-30T11:00:00Z</created><entry>lab-1</entry><owner>o</owner><port>3128</port></instance>`, nil, false},
		{"no metadata", "<domain><name>x</name></domain>", errNoMetadata, false},
		{"empty", "", errNoMetadata, false},
		{"older namespace", strings.ReplaceAll(good, "/instance/v1", "/instance/v0"), errNoMetadata, false},
		{"other tool", `<domain><metadata><app:info xmlns:app="https://example.com/app"><uid>u</uid></app:info></metadata></domain>`, errNoMetadata, false},
		{"prefix without declaration", `<domain><metadata><egressproxy:instance><egressproxy:uid>u</egressproxy:uid></egressproxy:instance></metadata></domain>`, errNoMetadata, false},
		{"bad created", strings.Replace(good, "2026-11-30T11:00:00.123456789Z", "yesterday", 1), nil, true},
		{"bad port", strings.Replace(good, ">3128<", ">0<", 1), nil, true},
		{"missing uid", strings.Replace(good, "6f1c2a4e-uid", "", 1), nil, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseMetadata(tt.doc)
			switch {
			case tt.wantErr != nil:
				if !errors.Is(err, tt.wantErr) {
					t.Errorf("err = %v, want %v", err, tt.wantErr)
				}
			case tt.bad:
				if err == nil || errors.Is(err, errNoMetadata) {
					t.Errorf("err = %v, want a parse error", err)
				}
			default:
				if err != nil {
					t.Errorf("err = %v", err)
				}
			}
		})
	}
}

// The element kvm2 writes is the one internal/domainmeta decodes.
func TestMetadataIsDomainmetas(t *testing.T) {
	t.Parallel()
	s, err := marshalMetadata(testParams().Meta)
	if err != nil {
		t.Fatal(err)
	}
	m, err := domainmeta.Parse(s)
	if err != nil || m != testParams().Meta {
		t.Fatalf("domainmeta.Parse(marshalMetadata(m)) = %+v, %v; want %+v", m, err, testParams().Meta)
	}
}
