//go:build integration

package soak

// What the soak sets up on the lab's hosts behind the library's back: the
// tmpfs pool of the pool-full fault, and the foreign objects (volumes and
// domains no entry of the soak owns) that must come out byte-identical.

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
	"libvirt.org/go/libvirtxml"

	"github.com/egressproxy/egressproxy/internal/basecache"
	"github.com/egressproxy/egressproxy/internal/testing/lab"
)

// tmpfsPool is the soak's own pool on its pool host: a dir pool on a tmpfs
// mounted in the host's mount namespace (libvirtd's), small enough that a
// planted file fills it.
const (
	tmpfsPoolName = "egressproxy-soak"
	tmpfsSize     = "96m"
	fillFile      = "soak-fill" // beside the pool's directory, on the same tmpfs
)

// tmpfsDir is where host h's soak tmpfs is mounted (inside the host).
func tmpfsDir(h lab.Host) string { return filepath.Join(h.StackDir, "soak-tmpfs") }

// setupTmpfsPool mounts the tmpfs on host h and defines and starts the
// soak's pool on it; the returned function undoes both.
func (s *supervisor) setupTmpfsPool(h lab.Host) (undo func() error, err error) {
	dir := tmpfsDir(h)
	n := fmt.Sprint(h.N)
	if err := s.script("exec", n, "bash", "-c", `set -e; mkdir -p "$1"; mountpoint -q "$1" || mount -t tmpfs -o size=`+tmpfsSize+`,mode=0755 egp-soak "$1"; rm -f "$1/`+fillFile+`".*; mkdir -p "$1/pool"`, "_", dir); err != nil {
		return nil, err
	}
	x, err := (&libvirtxml.StoragePool{Type: "dir", Name: tmpfsPoolName, Target: &libvirtxml.StoragePoolTarget{Path: filepath.Join(dir, "pool")}}).Marshal()
	if err != nil {
		return nil, err
	}
	err = h.Libvirt(func(l *libvirt.Libvirt) error {
		if old, err := l.StoragePoolLookupByName(tmpfsPoolName); err == nil { // a previous run's
			_ = l.StoragePoolDestroy(old)
			_ = l.StoragePoolUndefine(old)
		}
		p, err := l.StoragePoolDefineXML(x, 0)
		if err != nil {
			return err
		}
		return l.StoragePoolCreate(p, 0)
	})
	undo = func() error {
		e1 := h.Libvirt(func(l *libvirt.Libvirt) error {
			p, err := l.StoragePoolLookupByName(tmpfsPoolName)
			if err != nil {
				return nil
			}
			_ = l.StoragePoolDestroy(p)
			return l.StoragePoolUndefine(p)
		})
		e2 := s.script("exec", n, "bash", "-c", `umount "$1" && rmdir "$1"`, "_", dir)
		return errors.Join(e1, e2)
	}
	if err != nil {
		return undo, fmt.Errorf("host %d: define pool %s: %w", h.N, tmpfsPoolName, err)
	}
	return undo, nil
}

// fillPool fills host h's tmpfs but for leave bytes; emptyPool removes the
// fill. An upload into the pool may take space between df and fallocate:
// the fill is measured again and retried (a few times) when it does not
// fit.
func (s *supervisor) fillPool(h lab.Host, leave int64) error {
	return s.script("exec", fmt.Sprint(h.N), "bash", "-c",
		`f="$1/`+fillFile+`"; for i in 1 2 3 4 5 6 7 8; do
			avail=$(df --output=avail -B1 "$1" | tail -n1); n=$((avail - $2))
			((n > 0)) || exit 0
			if fallocate -l "$n" "$f.tmp.$i" 2>/dev/null; then mv "$f.tmp.$i" "$f.$i"; exit 0; fi
			rm -f "$f.tmp.$i"; sleep 0.1
		done; echo "could not fill $1 but for $2 bytes" >&2; exit 1`,
		"_", tmpfsDir(h), fmt.Sprint(leave))
}

func (s *supervisor) emptyPool(h lab.Host) error {
	return s.script("exec", fmt.Sprint(h.N), "bash", "-c", `rm -f "$1/`+fillFile+`".*`, "_", tmpfsDir(h))
}

// foreign is what the soak plants on one host and proves untouched at the
// end: volumes with their sha256, a domain of another tool with its
// inactive XML, all in the pool of the host's entry.
type foreign struct {
	pool    string
	volumes map[string]string // name -> sha256 of its bytes
	domain  string
	domXML  string
}

func randBytes(n int) []byte {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return b
}

func sum256(b []byte) string { s := sha256.Sum256(b); return hex.EncodeToString(s[:]) }

// uploadVolume creates volume name in pool with content b.
func uploadVolume(l *libvirt.Libvirt, pool libvirt.StoragePool, name, format string, b []byte) error {
	x, err := (&libvirtxml.StorageVolume{Name: name,
		Capacity: &libvirtxml.StorageVolumeSize{Value: uint64(len(b))},
		Target:   &libvirtxml.StorageVolumeTarget{Format: &libvirtxml.StorageVolumeTargetFormat{Type: format}}}).Marshal()
	if err != nil {
		return err
	}
	v, err := l.StorageVolCreateXML(pool, x, 0)
	if err != nil {
		return fmt.Errorf("create volume %s: %w", name, err)
	}
	if err := l.StorageVolUpload(v, bytes.NewReader(b), 0, uint64(len(b)), 0); err != nil {
		return fmt.Errorf("upload volume %s: %w", name, err)
	}
	return nil
}

// volumeSum reads volume name of pool back through libvirt and hashes it.
func volumeSum(l *libvirt.Libvirt, pool libvirt.StoragePool, name string) (string, error) {
	v, err := l.StorageVolLookupByName(pool, name)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	if err := l.StorageVolDownload(v, h, 0, 0, 0); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// plantForeign plants on host h, in pool: a plain volume of random bytes,
// a volume under the older single-entry base naming "base-<key>.qcow2"
// (which the cache must never touch) unless one exists, and a running
// domain of "another tool" (no egressproxy metadata) on a disk volume of
// its own made from img.
func plantForeign(h lab.Host, pool, sfx string, img []byte, network string) (*foreign, error) {
	f := &foreign{pool: pool, volumes: map[string]string{}, domain: "foreign-" + sfx}
	plain := randBytes(64 << 10)
	disk := "foreign-" + sfx + "-disk.qcow2"
	err := h.Libvirt(func(l *libvirt.Libvirt) error {
		p, err := l.StoragePoolLookupByName(pool)
		if err != nil {
			return err
		}
		if err := l.StoragePoolRefresh(p, 0); err != nil {
			return err
		}
		name := "foreign-" + sfx + ".img"
		if err := uploadVolume(l, p, name, "raw", plain); err != nil {
			return err
		}
		f.volumes[name] = sum256(plain)
		if _, err := l.StorageVolLookupByName(p, "base-tiny.qcow2"); err != nil {
			old := randBytes(32 << 10)
			if err := uploadVolume(l, p, "base-tiny.qcow2", "raw", old); err != nil {
				return err
			}
			f.volumes["base-tiny.qcow2"] = sum256(old)
		}
		if err := uploadVolume(l, p, disk, "qcow2", img); err != nil {
			return err
		}
		f.volumes[disk] = sum256(img)
		dv, err := l.StorageVolLookupByName(p, disk)
		if err != nil {
			return err
		}
		path, err := l.StorageVolGetPath(dv)
		if err != nil {
			return err
		}
		dom := libvirtxml.Domain{Type: "qemu", Name: f.domain,
			Memory: &libvirtxml.DomainMemory{Value: 32, Unit: "MiB"}, VCPU: &libvirtxml.DomainVCPU{Value: 1},
			OS: &libvirtxml.DomainOS{Type: &libvirtxml.DomainOSType{Type: "hvm"}},
			Devices: &libvirtxml.DomainDeviceList{
				Disks: []libvirtxml.DomainDisk{{Device: "disk",
					Driver: &libvirtxml.DomainDiskDriver{Name: "qemu", Type: "qcow2"},
					Source: &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: path}},
					Target: &libvirtxml.DomainDiskTarget{Dev: "vda", Bus: "virtio"}, ReadOnly: &libvirtxml.DomainDiskReadOnly{}}},
				Interfaces: []libvirtxml.DomainInterface{{Source: &libvirtxml.DomainInterfaceSource{Network: &libvirtxml.DomainInterfaceSourceNetwork{Network: network}}}},
			}}
		x, err := dom.Marshal()
		if err != nil {
			return err
		}
		d, err := l.DomainDefineXML(x)
		if err != nil {
			return fmt.Errorf("define foreign domain: %w", err)
		}
		if err := l.DomainCreate(d); err != nil {
			return fmt.Errorf("start foreign domain: %w", err)
		}
		f.domXML, err = l.DomainGetXMLDesc(d, libvirt.DomainXMLInactive)
		return err
	})
	return f, err
}

// verify reports every difference between what f planted and what host h
// holds now: a volume gone or with other bytes, the domain gone, not
// running, or with another definition.
func (f *foreign) verify(h lab.Host) []string {
	var out []string
	err := h.Libvirt(func(l *libvirt.Libvirt) error {
		p, err := l.StoragePoolLookupByName(f.pool)
		if err != nil {
			return err
		}
		if err := l.StoragePoolRefresh(p, 0); err != nil {
			return err
		}
		for _, name := range slices.Sorted(mapsKeys(f.volumes)) {
			got, err := volumeSum(l, p, name)
			switch {
			case err != nil:
				out = append(out, fmt.Sprintf("volume %s: %v", name, err))
			case got != f.volumes[name]:
				out = append(out, fmt.Sprintf("volume %s: sha256 %s, planted %s", name, got, f.volumes[name]))
			}
		}
		d, err := l.DomainLookupByName(f.domain)
		if err != nil {
			out = append(out, fmt.Sprintf("domain %s: %v", f.domain, err))
			return nil
		}
		if st, _, err := l.DomainGetState(d, 0); err != nil || libvirt.DomainState(st) != libvirt.DomainRunning {
			out = append(out, fmt.Sprintf("domain %s: state %d (%v), planted running", f.domain, st, err))
		}
		x, err := l.DomainGetXMLDesc(d, libvirt.DomainXMLInactive)
		if err != nil || x != f.domXML {
			out = append(out, fmt.Sprintf("domain %s: definition changed (%v)", f.domain, err))
		}
		return nil
	})
	if err != nil {
		out = append(out, err.Error())
	}
	return out
}

// remove deletes what f planted (the lab may be reused).
func (f *foreign) remove(h lab.Host) error {
	return h.Libvirt(func(l *libvirt.Libvirt) error {
		if d, err := l.DomainLookupByName(f.domain); err == nil {
			_ = l.DomainDestroy(d)
			_ = l.DomainUndefine(d)
		}
		p, err := l.StoragePoolLookupByName(f.pool)
		if err != nil {
			return err
		}
		for name := range f.volumes {
			if v, err := l.StorageVolLookupByName(p, name); err == nil {
				_ = l.StorageVolDelete(v, 0)
			}
		}
		return nil
	})
}

func mapsKeys[V any](m map[string]V) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// poolVolumes lists the volumes of pool on host h after a refresh.
func poolVolumes(h lab.Host, pool string) ([]string, error) {
	var names []string
	err := h.Libvirt(func(l *libvirt.Libvirt) error {
		p, err := l.StoragePoolLookupByName(pool)
		if err != nil {
			return err
		}
		if err := l.StoragePoolRefresh(p, 0); err != nil {
			return err
		}
		vols, _, err := l.StoragePoolListAllVolumes(p, 1, 0)
		for _, v := range vols {
			names = append(names, v.Name)
		}
		return err
	})
	slices.Sort(names)
	return names, err
}

// poolDebris checks entry's image volumes in a pool listing after the
// run: no claim left behind, every base with its digest marker (a base
// without one is half-written), no marker without its base. A driver
// SIGKILLed mid-fetch leaves its claim (and maybe a half-written base) for
// the next Ensure of that image to take over once the claim is stale: the
// claims taken before lastKill, and unmarked bases when lastKill is set,
// are returned as killed, not as debris.
func poolDebris(entry string, vols []string, lastKill time.Time) (debris, killed []string) {
	var out []string
	bases, markers := map[string]bool{}, map[string]bool{}
	for _, v := range vols {
		if rest, ok := strings.CutPrefix(v, "claim-"+entry+"--"); ok {
			// claim-<entry>--<key>.<format>.<unixnano>.<hex>
			parts := strings.Split(rest, ".")
			var at int64
			if len(parts) >= 4 {
				at, _ = strconv.ParseInt(parts[len(parts)-2], 10, 64)
			}
			if !lastKill.IsZero() && at > 0 && time.Unix(0, at).Before(lastKill) {
				killed = append(killed, v)
			} else {
				out = append(out, "claim left behind: "+v)
			}
		}
		if e, _, _, ok := basecache.ParseBaseName(v); ok && e == entry {
			bases[v] = true
		}
		if b, _, ok := basecache.ParseMarkerName(v); ok && strings.HasPrefix(b, "base-"+entry+"--") {
			markers[b] = true
		}
	}
	for b := range bases {
		switch {
		case markers[b]:
		case !lastKill.IsZero():
			killed = append(killed, b)
		default:
			out = append(out, "base without its digest marker (half-written): "+b)
		}
	}
	for b := range markers {
		if !bases[b] {
			out = append(out, "digest marker without its base: "+b)
		}
	}
	slices.Sort(out)
	slices.Sort(killed)
	return out, killed
}

// hasMarker reports whether base has a digest marker among vols.
func hasMarker(base string, vols []string) bool {
	for _, v := range vols {
		if b, _, ok := basecache.ParseMarkerName(v); ok && b == base {
			return true
		}
	}
	return false
}

// overlayBackings returns, for every overlay volume of entry in pool, the
// path of its backing store, and the path of every volume of the pool.
func overlayBackings(h lab.Host, pool, entry string) (backing map[string]string, paths map[string]string, err error) {
	backing, paths = map[string]string{}, map[string]string{}
	err = h.Libvirt(func(l *libvirt.Libvirt) error {
		p, err := l.StoragePoolLookupByName(pool)
		if err != nil {
			return err
		}
		vols, _, err := l.StoragePoolListAllVolumes(p, 1, 0)
		if err != nil {
			return err
		}
		for _, v := range vols {
			x, err := l.StorageVolGetXMLDesc(v, 0)
			if err != nil {
				continue // deleted meanwhile
			}
			var sv libvirtxml.StorageVolume
			if sv.Unmarshal(x) != nil {
				continue
			}
			if sv.Target != nil {
				paths[v.Name] = sv.Target.Path
			}
			if strings.HasPrefix(v.Name, "ep-"+entry+"--") && strings.HasSuffix(v.Name, ".qcow2") && sv.BackingStore != nil {
				backing[v.Name] = sv.BackingStore.Path
			}
		}
		return nil
	})
	return backing, paths, err
}
