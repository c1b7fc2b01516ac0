//go:build integration

package basecache

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/digitalocean/go-libvirt"
	"libvirt.org/go/libvirtxml"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/libvirtconn"
)

// defineWithDisk defines (does not start) a domain whose only disk is the
// file path with the given driver format. It returns a func that undefines
// it, which also runs at cleanup (an already undefined domain is fine).
func defineWithDisk(t *testing.T, lv *libvirtconn.Session, name, file, format string) (undefine func() error) {
	t.Helper()
	dx, err := (&libvirtxml.Domain{
		Type: "qemu", Name: name,
		Memory: &libvirtxml.DomainMemory{Value: 64, Unit: "MiB"},
		OS:     &libvirtxml.DomainOS{Type: &libvirtxml.DomainOSType{Type: "hvm"}},
		Devices: &libvirtxml.DomainDeviceList{Disks: []libvirtxml.DomainDisk{{
			Device: "disk",
			Driver: &libvirtxml.DomainDiskDriver{Name: "qemu", Type: format},
			Source: &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: file}},
			Target: &libvirtxml.DomainDiskTarget{Dev: "vda", Bus: "virtio"},
		}}},
	}).Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if err := lv.Do(ctxT(t, 30*time.Second), func(l *libvirt.Libvirt) error {
		_, err := l.DomainDefineXML(dx)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	undefine = func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		return lv.Do(ctx, func(l *libvirt.Libvirt) error {
			d, err := l.DomainLookupByName(name)
			if err != nil {
				return err
			}
			return l.DomainUndefine(d)
		})
	}
	t.Cleanup(func() { _ = undefine() })
	return undefine
}

// A base is never evicted while any defined domain may use it, wherever the
// disk that uses it lives: an inactive domain whose overlay is a volume of
// another pool is named as a user; one whose overlay is a qcow2 file outside
// every pool (libvirt cannot tell its backing store) is refused and its
// disk named; a raw file outside every pool (no backing store possible)
// does not block. Before, only the cache pool's volumes were mapped, and
// both of the first two bases were deleted.
func TestStackEvictAcrossPoolsAndFiles(t *testing.T) {
	env, lv, entry := stackEntry(t)
	img := makeQcow2(t, t.TempDir(), 1)
	srv := newImageServer(t, serveFile(img))
	c := newTestCache(t, SSH(lv), entry, env.Pool, nil)
	// A second pool in a directory of its own (transient: gone at cleanup).
	otherDir := t.TempDir()
	otherPool := "ic-other-" + entry
	px, _ := (&libvirtxml.StoragePool{Type: "dir", Name: otherPool, Target: &libvirtxml.StoragePoolTarget{Path: otherDir}}).Marshal()
	if err := lv.Do(ctxT(t, 30*time.Second), func(l *libvirt.Libvirt) error {
		_, err := l.StoragePoolCreateXML(px, 0)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = lv.Do(ctx, func(l *libvirt.Libvirt) error {
			p, err := l.StoragePoolLookupByName(otherPool)
			if err != nil {
				return err
			}
			vols, _, _ := l.StoragePoolListAllVolumes(p, 1, 0)
			for _, v := range vols {
				_ = l.StorageVolDelete(v, 0)
			}
			return l.StoragePoolDestroy(p)
		})
	})
	plainDir := t.TempDir()

	for _, tc := range []struct {
		name    string
		setup   func(t *testing.T, base Base, dom string)
		refused bool
		names   func(dom string) string // what the refusal must name
	}{
		{"overlay volume in another pool", func(t *testing.T, base Base, dom string) {
			ox, _ := (&libvirtxml.StorageVolume{
				Name:         dom + ".qcow2",
				Capacity:     &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: 64 << 20},
				Target:       &libvirtxml.StorageVolumeTarget{Format: &libvirtxml.StorageVolumeTargetFormat{Type: "qcow2"}},
				BackingStore: &libvirtxml.StorageVolumeBackingStore{Path: base.Path, Format: &libvirtxml.StorageVolumeTargetFormat{Type: "qcow2"}},
			}).Marshal()
			var path string
			if err := lv.Do(ctxT(t, 30*time.Second), onPool(otherPool, func(l *libvirt.Libvirt, p libvirt.StoragePool) error {
				v, err := l.StorageVolCreateXML(p, ox, 0)
				if err != nil {
					return err
				}
				path, err = l.StorageVolGetPath(v)
				return err
			})); err != nil {
				t.Fatal(err)
			}
			defineWithDisk(t, lv, dom, path, "qcow2")
		}, true, func(dom string) string { return dom }},
		{"qcow2 overlay file outside every pool", func(t *testing.T, base Base, dom string) {
			f := filepath.Join(plainDir, dom+".qcow2")
			if b, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-b", base.Path, "-F", "qcow2", f).CombinedOutput(); err != nil {
				t.Fatalf("qemu-img create: %v: %s", err, b)
			}
			defineWithDisk(t, lv, dom, f, "qcow2")
		}, true, func(dom string) string { return filepath.Join(plainDir, dom+".qcow2") }},
		{"raw file outside every pool", func(t *testing.T, base Base, dom string) {
			f := filepath.Join(plainDir, dom+".raw")
			if err := os.WriteFile(f, make([]byte, 1<<20), 0o644); err != nil {
				t.Fatal(err)
			}
			defineWithDisk(t, lv, dom, f, "raw")
		}, false, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			im := imagecache.Image{Key: "x" + randHex(3), URL: srv.URL + "/x"}
			base, err := c.Ensure(ctxT(t, time.Minute), im)
			if err != nil {
				t.Fatal(err)
			}
			dom := "ic-" + entry + "-" + randHex(3)
			tc.setup(t, base, dom)
			err = c.Evict(ctxT(t, time.Minute), im)
			if !tc.refused {
				if err != nil {
					t.Fatalf("Evict with only a raw disk outside the pools: %v", err)
				}
				return
			}
			wantCode(t, err, errs.Permanent)
			if want := tc.names(dom); !strings.Contains(err.Error(), want) {
				t.Fatalf("refusal does not name %q: %v", want, err)
			}
			t.Logf("refused: %v", err)
			if _, err := c.Verify(ctxT(t, time.Minute), im); err != nil {
				t.Fatalf("the base was touched by a refused Evict: %v", err)
			}
		})
	}
}
