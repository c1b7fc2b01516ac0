package basecache

import (
	"context"
	"fmt"
	"path"
	"slices"
	"strings"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/internal/errs"
	"libvirt.org/go/libvirtxml"
)

// usage is who uses which base, and what could not be resolved.
type usage struct {
	users map[string][]string // base volume -> domains whose disk chains reach it
	// unresolved names the disks whose backing chain could not be followed
	// to its end (a disk in an inactive pool, a qcow2 file outside every
	// pool, a volume that vanished): any of them might use any base.
	unresolved []string
}

// volInfo is one volume of any pool, by path.
type volInfo struct {
	backing       string // backing path, "" when none
	backingFormat string
}

// hostVolumes is every volume of every active pool on the host, by path,
// and the target paths of the inactive pools (their volumes are unknown).
type hostVolumes struct {
	byPath   map[string]volInfo
	byName   map[string]map[string]string // pool -> volume name -> path
	inactive map[string]string            // inactive pool name -> target path
}

func (c *Cache) hostVolumes(l Libvirt) (hostVolumes, error) {
	hv := hostVolumes{byPath: map[string]volInfo{}, byName: map[string]map[string]string{}, inactive: map[string]string{}}
	pools, _, err := l.ConnectListAllStoragePools(1, 0)
	if err != nil {
		return hv, fmt.Errorf("list storage pools: %w", err)
	}
	for _, p := range pools {
		active, err := l.StoragePoolIsActive(p)
		if err != nil {
			continue // undefined meanwhile
		}
		if active == 0 {
			target := ""
			if x, err := l.StoragePoolGetXMLDesc(p, 0); err == nil {
				var sp libvirtxml.StoragePool
				if sp.Unmarshal(x) == nil && sp.Target != nil {
					target = path.Clean(sp.Target.Path)
				}
			}
			hv.inactive[p.Name] = target
			continue
		}
		vols, _, err := l.StoragePoolListAllVolumes(p, 1, 0)
		if err != nil {
			return hv, fmt.Errorf("list volumes of pool %s: %w", p.Name, err)
		}
		names := map[string]string{}
		hv.byName[p.Name] = names
		for _, v := range vols {
			x, err := l.StorageVolGetXMLDesc(v, 0)
			if err != nil {
				continue // deleted meanwhile
			}
			var sv libvirtxml.StorageVolume
			if err := sv.Unmarshal(x); err != nil || sv.Target == nil {
				continue
			}
			p := path.Clean(sv.Target.Path)
			names[v.Name] = p
			var vi volInfo
			if bs := sv.BackingStore; bs != nil && bs.Path != "" {
				vi.backing = path.Clean(bs.Path)
				if bs.Format != nil {
					vi.backingFormat = bs.Format.Type
				}
			}
			hv.byPath[p] = vi
		}
	}
	return hv, nil
}

// inactivePool names the inactive pool whose directory holds p, if any.
func (hv hostVolumes) inactivePool(p string) string {
	for name, target := range hv.inactive {
		if target != "" && target != "/" && strings.HasPrefix(p, target+"/") {
			return name
		}
	}
	return ""
}

// usersOf maps each of the given base volumes (of the cache's pool) to the
// defined domains, running or not, ours or anyone's, whose disks reach it:
// as a source, or anywhere in a backing chain. Chains are followed by path
// through the volumes of every active pool (inactive domains do not list
// their chains, their qcow2 volumes do) and through what the domain XML
// lists (live domains list their chains). A disk whose chain cannot be
// followed to its end is named in unresolved.
func (c *Cache) usersOf(ctx context.Context, bases []string) (usage, error) {
	u := usage{users: map[string][]string{}}
	err := c.do(ctx, func(l Libvirt) error {
		hv, err := c.hostVolumes(l)
		if err != nil {
			return err
		}
		basePath := map[string]string{}
		for _, b := range bases {
			if p, ok := hv.byName[c.cfg.Pool][b]; ok {
				basePath[p] = b
			}
		}
		doms, _, err := l.ConnectListAllDomains(1, libvirt.ConnectListDomainsActive|libvirt.ConnectListDomainsInactive)
		if err != nil {
			return fmt.Errorf("list domains: %w", err)
		}
		for _, dom := range doms {
			x, err := l.DomainGetXMLDesc(dom, 0)
			if err != nil {
				continue // undefined meanwhile
			}
			var dd libvirtxml.Domain
			if err := dd.Unmarshal(x); err != nil {
				u.unresolved = append(u.unresolved, fmt.Sprintf("domain %s: its XML cannot be read (%v)", dom.Name, err))
				continue
			}
			if dd.Devices == nil {
				continue
			}
			used := map[string]bool{}
			for _, disk := range dd.Devices.Disks {
				chain, why := resolveDisk(disk, hv)
				if why != "" {
					u.unresolved = append(u.unresolved, fmt.Sprintf("domain %s disk %s: %s", dd.Name, diskName(disk), why))
				}
				for _, p := range chain {
					if b, ok := basePath[p]; ok {
						used[b] = true
					}
				}
			}
			for b := range used {
				u.users[b] = append(u.users[b], dd.Name)
			}
		}
		return nil
	})
	if err != nil {
		return usage{}, c.classify(ctx, fmt.Errorf("find domains using bases of pool %s: %w", c.cfg.Pool, err))
	}
	for b := range u.users {
		slices.Sort(u.users[b])
	}
	slices.Sort(u.unresolved)
	return u, nil
}

// refuseIfUsed returns a Permanent error when any domain uses base, or when
// some disk could not be resolved (it might use it): doing verb ("evict",
// "replace") to base could break a domain.
func (u usage) refuseIfUsed(base, verb string) error {
	if d := u.users[base]; len(d) > 0 {
		return errs.Errorf(errs.Permanent, "base %s is the backing store of domains %s; delete them before you %s it", base, strings.Join(d, ", "), verb)
	}
	if len(u.unresolved) > 0 {
		const show = 5
		list := u.unresolved
		more := ""
		if len(list) > show {
			more = fmt.Sprintf(" and %d more", len(list)-show)
			list = list[:show]
		}
		return errs.Errorf(errs.Permanent, "refusing to %s base %s: the backing chains of some disks cannot be resolved, so they may use it: %s%s", verb, base, strings.Join(list, "; "), more)
	}
	return nil
}

// resolveDisk returns the host paths of a disk's source and backing chain,
// and why the chain could not be followed to its end ("" when it could).
func resolveDisk(disk libvirtxml.DomainDisk, hv hostVolumes) ([]string, string) {
	var chain []string
	src, why := sourcePath(disk.Source, hv)
	if why != "" {
		return nil, why
	}
	if src == "" {
		return nil, "" // no local file (empty cdrom, network disk)
	}
	chain = append(chain, src)
	// What the domain XML lists (live domains): a complete chain ends in
	// an empty <backingStore/>.
	complete := false
	for bs, i := disk.BackingStore, 0; bs != nil && i < maxChain; bs, i = bs.BackingStore, i+1 {
		if bs.Source == nil {
			complete = true
			break
		}
		p, why := sourcePath(bs.Source, hv)
		if why != "" {
			return chain, why
		}
		if p != "" {
			chain = append(chain, p)
		}
	}
	// Follow the last path through the pools' volumes.
	last := chain[len(chain)-1]
	format := ""
	if disk.Driver != nil {
		format = disk.Driver.Type
	}
	if len(chain) > 1 {
		format = "" // unknown for an XML-listed backing file: rely on the pools
	}
	for i := 0; i < maxChain; i++ {
		vi, ok := hv.byPath[last]
		if !ok {
			switch {
			case complete:
				return chain, ""
			case format == "raw":
				return chain, "" // a raw file has no backing store
			case hv.inactivePool(last) != "":
				return chain, fmt.Sprintf("%s is in inactive pool %s", last, hv.inactivePool(last))
			default:
				return chain, fmt.Sprintf("%s is in no active storage pool, so its backing store is unknown", last)
			}
		}
		if vi.backing == "" {
			return chain, ""
		}
		chain = append(chain, vi.backing)
		last, format = vi.backing, vi.backingFormat
	}
	return chain, fmt.Sprintf("backing chain longer than %d", maxChain)
}

// sourcePath is the host path of a disk source ("" when it has none), or
// why it cannot be known.
func sourcePath(s *libvirtxml.DomainDiskSource, hv hostVolumes) (string, string) {
	switch {
	case s == nil:
		return "", ""
	case s.File != nil:
		if s.File.File == "" {
			return "", ""
		}
		return path.Clean(s.File.File), ""
	case s.Block != nil:
		if s.Block.Dev == "" {
			return "", ""
		}
		return path.Clean(s.Block.Dev), ""
	case s.Volume != nil:
		vols, ok := hv.byName[s.Volume.Pool]
		if !ok {
			if _, inactive := hv.inactive[s.Volume.Pool]; inactive {
				return "", fmt.Sprintf("volume %s is in inactive pool %s", s.Volume.Volume, s.Volume.Pool)
			}
			return "", fmt.Sprintf("volume %s is in pool %s, which does not exist", s.Volume.Volume, s.Volume.Pool)
		}
		p, ok := vols[s.Volume.Volume]
		if !ok {
			return "", fmt.Sprintf("volume %s of pool %s does not exist", s.Volume.Volume, s.Volume.Pool)
		}
		return p, ""
	}
	return "", "" // network, NVMe, vhost-user…: no file of a pool
}

func diskName(d libvirtxml.DomainDisk) string {
	if d.Target != nil && d.Target.Dev != "" {
		return d.Target.Dev
	}
	return "?"
}
