package benchutil

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"sync"

	"github.com/digitalocean/go-libvirt"
	"libvirt.org/go/libvirtxml"

	"github.com/egressproxy/egressproxy"
)

// Template is what kvm2 made for one stopped instance of a KVM entry: the
// domain's definition as libvirt keeps it and its two volumes' shapes.
// Clones of it are instances that List, Get and Delete cannot tell from
// ones Create made, without starting a guest for each.
type Template struct {
	domain, uid     string // the instance's domain name and UID
	domXML          string // inactive definition, without uuid and MAC (libvirt makes new ones)
	overlay, seed   libvirtxml.StorageVolume
	overlayN, seedN string // the template's volume names
}

var (
	reUUID     = regexp.MustCompile(`\s*<uuid>[^<]*</uuid>`)
	reMAC      = regexp.MustCompile(`\s*<mac address='[^']*'/>`)
	reMetadata = regexp.MustCompile(`(?s)\s*<metadata>.*</metadata>`)
	reOwner    = regexp.MustCompile(`(:owner>)[^<]*(<)`)
)

// Template reads the stopped instance spec of k's entry (made by kvm2's
// Create and then stopped) as a template for Clone.
func (k *KVM) Template(ctx context.Context, spec egressproxy.Spec) (*Template, error) {
	t := &Template{domain: k.DomainName(spec.Name), uid: spec.UID}
	t.overlayN, t.seedN = t.domain+".qcow2", t.domain+"-seed.iso"
	err := k.Raw(ctx, func(l *libvirt.Libvirt) error {
		d, err := l.DomainLookupByName(t.domain)
		if err != nil {
			return err
		}
		x, err := l.DomainGetXMLDesc(d, libvirt.DomainXMLInactive)
		if err != nil {
			return err
		}
		t.domXML = reMAC.ReplaceAllString(reUUID.ReplaceAllString(x, ""), "")
		pool, err := l.StoragePoolLookupByName(k.env.Pool)
		if err != nil {
			return err
		}
		for _, v := range []struct {
			name string
			out  *libvirtxml.StorageVolume
		}{{t.overlayN, &t.overlay}, {t.seedN, &t.seed}} {
			vol, err := l.StorageVolLookupByName(pool, v.name)
			if err != nil {
				return fmt.Errorf("look up volume %s: %w", v.name, err)
			}
			vx, err := l.StorageVolGetXMLDesc(vol, 0)
			if err != nil {
				return err
			}
			var sv libvirtxml.StorageVolume
			if err := sv.Unmarshal(vx); err != nil {
				return err
			}
			// Only what a create takes: name, capacity, format (and the
			// overlay's backing store); libvirt derives the rest.
			*v.out = libvirtxml.StorageVolume{Name: v.name, Capacity: sv.Capacity,
				Allocation: &libvirtxml.StorageVolumeSize{Value: 0}}
			if sv.Target != nil {
				v.out.Target = &libvirtxml.StorageVolumeTarget{Format: sv.Target.Format, Compat: sv.Target.Compat}
			}
			if sv.BackingStore != nil {
				v.out.BackingStore = &libvirtxml.StorageVolumeBackingStore{Path: sv.BackingStore.Path, Format: sv.BackingStore.Format}
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read template %s: %w", t.domain, err)
	}
	if !strings.Contains(t.domXML, t.uid) || !reOwner.MatchString(t.domXML) {
		return nil, fmt.Errorf("template %s: its definition lacks the UID or owner metadata", t.domain)
	}
	return t, nil
}

// Clone defines each spec as an instance of k's entry, not started: its
// overlay and seed volumes (empty: a clone is never started) and its
// domain, the template's definition with the spec's name and UID. workers
// clones are made at once, on k's own uncounted connection.
func (k *KVM) Clone(ctx context.Context, t *Template, specs []egressproxy.Spec, workers int) error {
	return k.cloneEach(ctx, len(specs), workers, func(l *libvirt.Libvirt, pool libvirt.StoragePool, i int) error {
		dn := k.DomainName(specs[i].Name)
		for _, v := range []libvirtxml.StorageVolume{t.overlay, t.seed} {
			v.Name = strings.Replace(v.Name, t.domain, dn, 1)
			vx, err := v.Marshal()
			if err != nil {
				return err
			}
			if _, err := l.StorageVolCreateXML(pool, vx, 0); err != nil {
				return fmt.Errorf("create volume %s: %w", v.Name, err)
			}
		}
		x := strings.ReplaceAll(t.domXML, t.domain, dn)
		x = strings.ReplaceAll(x, ">"+t.uid+"<", ">"+specs[i].UID+"<")
		if _, err := l.DomainDefineXMLFlags(x, 0); err != nil {
			return fmt.Errorf("define %s: %w", dn, err)
		}
		return nil
	})
}

// ForeignPrefix starts the names of the foreign domains without metadata
// that CloneForeign defines; Close removes them.
func (k *KVM) ForeignPrefix() string { return "fx-" + k.Entry + "-" }

// CloneForeign defines n domains that are not instances of k's owner, not
// started and without volumes: the first half named like instances of the
// entry (so List must read them to tell) but carrying another owner's
// metadata ("f000", … with owner "other"), the rest named ForeignPrefix+
// "000", … without egressproxy metadata.
func (k *KVM) CloneForeign(ctx context.Context, t *Template, n, workers int) error {
	other := reOwner.ReplaceAllString(t.domXML, "${1}other${2}")
	plain := reMetadata.ReplaceAllString(t.domXML, "")
	return k.cloneEach(ctx, n, workers, func(l *libvirt.Libvirt, _ libvirt.StoragePool, i int) error {
		var x string
		if i < n/2 {
			x = strings.ReplaceAll(other, t.domain, k.DomainName(fmt.Sprintf("f%03d", i)))
		} else {
			x = strings.ReplaceAll(plain, t.domain, fmt.Sprintf("%s%03d", k.ForeignPrefix(), i))
		}
		if _, err := l.DomainDefineXMLFlags(x, 0); err != nil {
			return fmt.Errorf("define foreign domain %d: %w", i, err)
		}
		return nil
	})
}

// cloneEach runs fn for i in [0, n), workers at once, on k's raw
// connection, and returns the first error after all have ended.
func (k *KVM) cloneEach(ctx context.Context, n, workers int, fn func(l *libvirt.Libvirt, pool libvirt.StoragePool, i int) error) error {
	return k.Raw(ctx, func(l *libvirt.Libvirt) error {
		pool, err := l.StoragePoolLookupByName(k.env.Pool)
		if err != nil {
			return err
		}
		return Each(ctx, n, workers, func(i int) error { return fn(l, pool, i) })
	})
}

// Each runs fn for i in [0, n) on workers goroutines at once (at least
// one, at most n), each taking the next i when it is done with its last;
// it stops handing out work after the first error or when ctx ends, and
// returns that error (or ctx's) after every goroutine has ended.
func Each(ctx context.Context, n, workers int, fn func(i int) error) error {
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		next  int
		first error
	)
	for range max(1, min(workers, n)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				mu.Lock()
				i := next
				next++
				stop := first != nil || i >= n || ctx.Err() != nil
				mu.Unlock()
				if stop {
					return
				}
				if err := fn(i); err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	if first != nil {
		return first
	}
	return ctx.Err()
}
