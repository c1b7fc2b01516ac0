//go:build integration

package kvm2

import (
	"bytes"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/go-logr/logr/testr"
	"libvirt.org/go/libvirtxml"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// On the real stack, through the Client: a domain of another tool using
// the base is listed as "domain/<name>" and blocks the eviction; bytes
// changed on the host are caught by VerifyImage (Permanent, the remedy
// naming EvictImage) and the base is kept; once nothing uses it, EvictImage
// removes it.
func TestIntegrationImagesForeignUserAndChangedBytes(t *testing.T) {
	teststack.Require(t)
	e := newLifecycleEnv(t)
	p := openT(t, e.cfg, testr.NewWithOptions(t, testr.Options{Verbosity: 1}))
	c := driver.NewClient(p, nil)
	ctx := ctxT(t)
	spec := egressproxy.Spec{Name: "img-it", UID: "uid-img-it"}
	if _, err := c.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	listed, err := c.ListImages(ctx)
	if err != nil || len(listed) != 1 || !listed[0].Present || listed[0].Name != e.baseVol {
		t.Fatalf("ListImages = %+v, %v", listed, err)
	}
	img := listed[0]
	if want := int64(len(teststack.TinyQCOW2(t))); img.SizeBytes != want {
		t.Errorf("SizeBytes = %d, want the image's %d bytes", img.SizeBytes, want)
	}

	// Another tool's domain backed by the base directly.
	var basePath string
	foreign := "fx-" + e.cfg.Entry
	err = rawLibvirt(t, func(l *libvirt.Libvirt) error {
		sp, err := l.StoragePoolLookupByName(e.cfg.Pool)
		if err != nil {
			return err
		}
		v, err := l.StorageVolLookupByName(sp, e.baseVol)
		if err != nil {
			return err
		}
		if basePath, err = l.StorageVolGetPath(v); err != nil {
			return err
		}
		x, err := (&libvirtxml.Domain{Type: "qemu", Name: foreign, Memory: &libvirtxml.DomainMemory{Value: 64, Unit: "MiB"},
			OS: &libvirtxml.DomainOS{Type: &libvirtxml.DomainOSType{Type: "hvm"}},
			Devices: &libvirtxml.DomainDeviceList{Disks: []libvirtxml.DomainDisk{{Device: "disk",
				Driver: &libvirtxml.DomainDiskDriver{Name: "qemu", Type: "qcow2"},
				Source: &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: basePath}},
				Target: &libvirtxml.DomainDiskTarget{Dev: "vda", Bus: "virtio"}}}}}).Marshal()
		if err != nil {
			return err
		}
		_, err = l.DomainDefineXML(x)
		return err
	})
	if err != nil {
		t.Fatalf("define %s: %v", foreign, err)
	}
	undefineForeign := func() {
		if err := rawLibvirt(t, func(l *libvirt.Libvirt) error {
			d, err := l.DomainLookupByName(foreign)
			if err != nil {
				return err
			}
			return l.DomainUndefine(d)
		}); err != nil {
			t.Errorf("undefine %s: %v", foreign, err)
		}
	}
	defined := true
	defer func() {
		if defined {
			undefineForeign()
		}
	}()
	if err := c.Delete(ctx, spec.Ref()); err != nil {
		t.Fatal(err)
	}
	listed, err = c.ListImages(ctx)
	if err != nil || len(listed) != 1 || !slices.Equal(listed[0].InUseBy, []string{"domain/" + foreign}) {
		t.Fatalf("ListImages with only the foreign domain = %+v, %v; want InUseBy [domain/%s]", listed, err, foreign)
	}
	err = c.EvictImage(ctx, "tiny")
	if errs.Code(err) != errs.Permanent || !strings.Contains(err.Error(), "egressproxy evict-image tiny: kvm2 "+e.cfg.Entry+": base "+e.baseVol+" is the backing store of domains "+foreign) {
		t.Fatalf("EvictImage while a foreign domain uses the base = %v", err)
	}
	t.Logf("refused: %v", err)

	// Change one byte of the stored base on the host.
	bad := teststack.TinyQCOW2(t)
	bad[len(bad)-1] ^= 0xff
	if err := rawLibvirt(t, func(l *libvirt.Libvirt) error {
		sp, err := l.StoragePoolLookupByName(e.cfg.Pool)
		if err != nil {
			return err
		}
		v, err := l.StorageVolLookupByName(sp, e.baseVol)
		if err != nil {
			return err
		}
		return l.StorageVolUpload(v, bytes.NewReader(bad), 0, uint64(len(bad)), 0)
	}); err != nil {
		t.Fatalf("overwrite the base: %v", err)
	}
	_, err = c.VerifyImage(ctx, "tiny")
	if errs.Code(err) != errs.Permanent || !strings.Contains(err.Error(), "its marker says "+img.Digest) ||
		!strings.HasSuffix(err.Error(), "delete the proxies using it, then evict the base with EvictImage (egressproxyctl images evict)") {
		t.Fatalf("VerifyImage of changed bytes = %v, want Permanent naming the marker's digest and the remedy", err)
	}
	t.Logf("changed bytes: %v", err)
	if l, err := c.ListImages(ctx); err != nil || len(l) != 1 || !l[0].Present || l[0].Digest != img.Digest {
		t.Fatalf("ListImages after a failed verify = %+v, %v; want the base kept", l, err)
	}

	undefineForeign()
	defined = false
	if err := c.EvictImage(ctx, "tiny"); err != nil {
		t.Fatalf("EvictImage of an unused base: %v", err)
	}
	if l, err := c.ListImages(ctx); err != nil || len(l) != 1 || l[0].Present || len(l[0].InUseBy) != 0 {
		t.Fatalf("ListImages after EvictImage = %+v, %v", l, err)
	}
	_, err = c.VerifyImage(ctx, "tiny")
	if errs.Code(err) != errs.NotFound {
		t.Fatalf("VerifyImage after EvictImage = %v, want NotFound", err)
	}
}

// On the real stack: an inactive domain whose overlay is a qcow2 file
// outside every pool, backed by the base, cannot be resolved (libvirt does
// not know the file's backing store): ListImages says the base's users are
// unknown, never that it is unused, while EvictImage refuses naming the
// disk; once the domain is gone the base is unused and evicted.
func TestIntegrationImagesUnresolvedUserIsUnknown(t *testing.T) {
	teststack.Require(t)
	e := newLifecycleEnv(t)
	p := openT(t, e.cfg, testr.NewWithOptions(t, testr.Options{Verbosity: 1}))
	c := driver.NewClient(p, nil)
	ctx := ctxT(t)
	spec := egressproxy.Spec{Name: "img-unres", UID: "uid-img-unres"}
	if _, err := c.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	if err := c.Delete(ctx, spec.Ref()); err != nil {
		t.Fatal(err)
	}
	var basePath string
	if err := rawLibvirt(t, func(l *libvirt.Libvirt) error {
		sp, err := l.StoragePoolLookupByName(e.cfg.Pool)
		if err != nil {
			return err
		}
		v, err := l.StorageVolLookupByName(sp, e.baseVol)
		if err != nil {
			return err
		}
		basePath, err = l.StorageVolGetPath(v)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	overlay := filepath.Join(t.TempDir(), "elsewhere.qcow2")
	if b, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-b", basePath, "-F", "qcow2", overlay).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img create: %v: %s", err, b)
	}
	dom := "ux-" + e.cfg.Entry
	x, err := (&libvirtxml.Domain{Type: "qemu", Name: dom, Memory: &libvirtxml.DomainMemory{Value: 64, Unit: "MiB"},
		OS: &libvirtxml.DomainOS{Type: &libvirtxml.DomainOSType{Type: "hvm"}},
		Devices: &libvirtxml.DomainDeviceList{Disks: []libvirtxml.DomainDisk{{Device: "disk",
			Driver: &libvirtxml.DomainDiskDriver{Name: "qemu", Type: "qcow2"},
			Source: &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: overlay}},
			Target: &libvirtxml.DomainDiskTarget{Dev: "vda", Bus: "virtio"}}}}}).Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if err := rawLibvirt(t, func(l *libvirt.Libvirt) error { _, err := l.DomainDefineXML(x); return err }); err != nil {
		t.Fatalf("define %s: %v", dom, err)
	}
	undefine := func() error {
		return rawLibvirt(t, func(l *libvirt.Libvirt) error {
			d, err := l.DomainLookupByName(dom)
			if err != nil {
				return err
			}
			return l.DomainUndefine(d)
		})
	}
	defined := true
	defer func() {
		if defined {
			if err := undefine(); err != nil {
				t.Errorf("undefine %s: %v", dom, err)
			}
		}
	}()

	listed, err := c.ListImages(ctx)
	if err != nil || len(listed) != 1 || !listed[0].Present || !listed[0].InUseUnknown || len(listed[0].InUseBy) != 0 {
		t.Fatalf("ListImages with an unresolved disk = %+v, %v; want the base present, its users unknown", listed, err)
	}
	if v, err := c.VerifyImage(ctx, "tiny"); err != nil || !v.Verified || !v.InUseUnknown {
		t.Fatalf("VerifyImage with an unresolved disk = %+v, %v; want Verified, its users unknown", v, err)
	}
	err = c.EvictImage(ctx, "tiny")
	if errs.Code(err) != errs.Permanent || !strings.Contains(err.Error(), overlay) {
		t.Fatalf("EvictImage while a disk cannot be resolved = %v, want Permanent naming %s", err, overlay)
	}
	t.Logf("refused: %v", err)

	if err := undefine(); err != nil {
		t.Fatalf("undefine %s: %v", dom, err)
	}
	defined = false
	listed, err = c.ListImages(ctx)
	if err != nil || len(listed) != 1 || !listed[0].Present || listed[0].InUseUnknown || len(listed[0].InUseBy) != 0 {
		t.Fatalf("ListImages once the domain is gone = %+v, %v; want the base present and unused", listed, err)
	}
	if err := c.EvictImage(ctx, "tiny"); err != nil {
		t.Fatalf("EvictImage of an unused base: %v", err)
	}
}
