package kvm2

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"path"
	"sort"
	"strings"
	"sync"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
	"go.opentelemetry.io/otel/attribute"
	"libvirt.org/go/libvirtxml"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/provider"
)

var _ provider.Provider = (*Provider)(nil)

// cleanupTimeout bounds removing what a failed Create made, after the
// caller's context may have ended.
const cleanupTimeout = 30 * time.Second

// nameLocks serialises operations on one domain name inside this process,
// so two concurrent Creates of one spec never race on its volumes.
type nameLocks struct {
	mu    sync.Mutex
	locks map[string]*nameLock
}

type nameLock struct {
	ch   chan struct{}
	refs int
}

// lock takes the lock of name, or returns the context's error.
func (n *nameLocks) lock(ctx context.Context, name string) (func(), error) {
	n.mu.Lock()
	if n.locks == nil {
		n.locks = map[string]*nameLock{}
	}
	l := n.locks[name]
	if l == nil {
		l = &nameLock{ch: make(chan struct{}, 1)}
		n.locks[name] = l
	}
	l.refs++
	n.mu.Unlock()
	release := func() {
		n.mu.Lock()
		l.refs--
		if l.refs == 0 {
			delete(n.locks, name)
		}
		n.mu.Unlock()
	}
	select {
	case l.ch <- struct{}{}:
		return func() { <-l.ch; release() }, nil
	case <-ctx.Done():
		release()
		return nil, provider.FromContext(ctx.Err())
	}
}

// domainInfo is what one read of a domain gives.
type domainInfo struct {
	dom   libvirt.Domain
	meta  instanceMeta
	ours  bool   // carries our metadata for this entry and owner
	mac   string // MAC of the first NIC
	state libvirt.DomainState
}

// readDomain reads a domain's XML (metadata, MAC) and state: 2 RPCs. The
// XML is decoded once, after the state is known. The MAC is only used to
// look for the address of an active domain, so it is read only when the
// caller will look (withMAC) and the domain is active; otherwise decoding
// stops at our metadata element.
func (p *Provider) readDomain(l *libvirt.Libvirt, dom libvirt.Domain, withMAC bool) (domainInfo, error) {
	info := domainInfo{dom: dom}
	x, err := l.DomainGetXMLDesc(dom, 0)
	if err != nil {
		return info, fmt.Errorf("get XML of domain %q: %w", dom.Name, err)
	}
	st, _, stErr := l.DomainGetState(dom, 0)
	info.state = libvirt.DomainState(st)
	px := parseDomainXML(x, withMAC && stErr == nil && domainActive(info.state))
	switch err := px.metaErr; {
	case err == nil:
		info.meta = px.meta
		info.ours = px.meta.Entry == p.cfg.Entry && px.meta.Owner == p.cfg.Owner
	case errors.Is(err, errNoMetadata):
	default:
		p.log.Info("domain has malformed egressproxy metadata; treating it as not ours", "domain", dom.Name, "error", err.Error())
	}
	info.mac = px.mac
	if stErr != nil {
		return info, fmt.Errorf("get state of domain %q: %w", dom.Name, stErr)
	}
	return info, nil
}

// lookup finds the domain of ref and reads it: 3 RPCs. A missing domain is
// NotFound.
func (p *Provider) lookup(ctx context.Context, op, name string) (domainInfo, error) {
	var info domainInfo
	err := p.do(ctx, op, func(l *libvirt.Libvirt) error {
		dom, err := l.DomainLookupByName(name)
		if err != nil {
			return fmt.Errorf("look up domain %q: %w", name, err)
		}
		info, err = p.readDomain(l, dom, true)
		return err
	}, attribute.String("domain", name))
	return info, err
}

// instance builds the Instance of a domain we own, with the address when it
// is active (discover: agent → lease → ARP).
func (p *Provider) instance(ctx context.Context, name string, info domainInfo, discover bool) (provider.Instance, error) {
	inst := provider.Instance{
		Ref:       provider.Ref{Name: name, UID: info.meta.UID},
		CreatedAt: info.meta.Created,
		Port:      info.meta.Port,
	}
	if discover && domainActive(info.state) {
		ip, src, err := discoverAddress(ctx, &domainAddrs{p: p, dom: info.dom}, info.mac)
		if err != nil {
			return provider.Instance{}, err
		}
		inst.IP, inst.AddressSource = ip, src
	}
	inst.State = mapState(info.state, inst.IP != "")
	return inst, nil
}

// domainAddrs is the addrBackend of one domain over the shared connection.
type domainAddrs struct {
	p   *Provider
	dom libvirt.Domain
}

func (d *domainAddrs) InterfaceAddresses(ctx context.Context, src libvirt.DomainInterfaceAddressesSource) ([]libvirt.DomainInterface, error) {
	var out []libvirt.DomainInterface
	err := d.p.do(ctx, "kvm2.InterfaceAddresses", func(l *libvirt.Libvirt) error {
		var err error
		out, err = l.DomainInterfaceAddresses(d.dom, uint32(src), 0)
		return err
	}, attribute.String("domain", d.dom.Name), attribute.Int("source", int(src)))
	return out, err
}

func (p *Provider) wrap(op string, ref provider.Ref, err error) error {
	if err == nil {
		return nil
	}
	return classify(fmt.Errorf("kvm2 %s: %s %s: %w", p.cfg.Entry, op, ref.Name, err))
}

// Get reads the instance back from the host: UID, creation time and port
// from our metadata, state from libvirt, address from the guest agent, the
// DHCP lease or ARP. A missing domain, or one that is not ours (no metadata,
// another entry or owner, another UID), is NotFound. An address that cannot
// be read is Transient (never Failed).
func (p *Provider) Get(ctx context.Context, ref provider.Ref) (provider.Instance, error) {
	if err := p.checkOpen(); err != nil {
		return provider.Instance{}, err
	}
	if err := provider.ValidateRef(ref); err != nil {
		return provider.Instance{}, err
	}
	info, err := p.lookup(ctx, "kvm2.Get", domainName(p.cfg.Entry, ref.Name))
	if err != nil {
		return provider.Instance{}, classifyRead(fmt.Errorf("kvm2 %s: get %s: %w", p.cfg.Entry, ref.Name, err))
	}
	if !info.ours || info.meta.UID != ref.UID {
		return provider.Instance{}, provider.Errorf(provider.NotFound, "kvm2 %s: get %s: no instance with UID %q", p.cfg.Entry, ref.Name, ref.UID)
	}
	inst, err := p.instance(ctx, ref.Name, info, true)
	if err != nil {
		return provider.Instance{}, classifyRead(fmt.Errorf("kvm2 %s: get %s: %w", p.cfg.Entry, ref.Name, err))
	}
	return inst, nil
}

// List returns every instance of this entry and owner (domains carrying our
// metadata namespace with this Entry and Owner), sorted by name. Addresses
// are looked up best-effort: an instance whose address cannot be read is
// listed without one (Provisioning when active).
func (p *Provider) List(ctx context.Context) ([]provider.Instance, error) {
	if err := p.checkOpen(); err != nil {
		return nil, err
	}
	prefix := domainPrefix + p.cfg.Entry + "--"
	var found []domainInfo
	err := p.do(ctx, "kvm2.List", func(l *libvirt.Libvirt) error {
		doms, _, err := l.ConnectListAllDomains(1, libvirt.ConnectListDomainsActive|libvirt.ConnectListDomainsInactive)
		if err != nil {
			return fmt.Errorf("list domains: %w", err)
		}
		for _, dom := range doms {
			if !strings.HasPrefix(dom.Name, prefix) {
				continue // our names always have this shape; skip the RPCs
			}
			info, err := p.readDomain(l, dom, true)
			if err != nil {
				if isLibvirtCode(err, libvirt.ErrNoDomain) {
					continue // undefined meanwhile
				}
				return err
			}
			if info.ours {
				found = append(found, info)
			}
		}
		return nil
	})
	if err != nil {
		return nil, classifyRead(fmt.Errorf("kvm2 %s: list: %w", p.cfg.Entry, err))
	}
	out := make([]provider.Instance, 0, len(found))
	for _, info := range found {
		name := strings.TrimPrefix(info.dom.Name, prefix)
		inst, err := p.instance(ctx, name, info, true)
		if err != nil {
			if c := provider.Code(err); c == provider.Canceled || c == provider.DeadlineExceeded || errors.Is(err, provider.ErrClosed) {
				return nil, err
			}
			inst, _ = p.instance(ctx, name, info, false)
		}
		out = append(out, inst)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// Delete removes the instance: destroys and undefines its domain (with
// managed-save, snapshot, checkpoint and NVRAM metadata) and deletes its
// overlay and seed volumes. The base image is never touched. A missing
// instance succeeds; so does a name whose domain is not ours (it is left
// alone). Leftover volumes of a failed Create (no domain) are removed.
func (p *Provider) Delete(ctx context.Context, ref provider.Ref) error {
	if err := p.checkOpen(); err != nil {
		return err
	}
	if err := provider.ValidateRef(ref); err != nil {
		return err
	}
	name := domainName(p.cfg.Entry, ref.Name)
	unlock, err := p.locks.lock(ctx, name)
	if err != nil {
		return err
	}
	defer unlock()
	err = p.do(ctx, "kvm2.Delete", func(l *libvirt.Libvirt) error {
		dom, err := l.DomainLookupByName(name)
		switch {
		case isLibvirtCode(err, libvirt.ErrNoDomain):
			// No domain: only leftovers of a failed Create can remain.
			return p.deleteVolumes(l, name)
		case err != nil:
			return fmt.Errorf("look up domain: %w", err)
		}
		info, err := p.readDomain(l, dom, false) // no address lookup: no MAC
		if err != nil {
			if isLibvirtCode(err, libvirt.ErrNoDomain) {
				return p.deleteVolumes(l, name)
			}
			return err
		}
		if !info.ours || info.meta.UID != ref.UID {
			p.log.V(1).Info("delete: domain is not this instance; leaving it alone", "domain", name, "uid", ref.UID)
			return nil
		}
		if err := p.removeDomain(l, dom, info.state); err != nil {
			return err
		}
		return p.deleteVolumes(l, name)
	}, attribute.String("domain", name))
	if err != nil {
		return p.wrap("delete", ref, err)
	}
	p.log.V(1).Info("deleted", "instance", ref.Name, "uid", ref.UID)
	return nil
}

// removeDomain destroys (if active) and undefines dom; a domain that is
// already gone is fine.
func (p *Provider) removeDomain(l *libvirt.Libvirt, dom libvirt.Domain, st libvirt.DomainState) error {
	if st != libvirt.DomainShutoff {
		if err := l.DomainDestroy(dom); err != nil && !isLibvirtCode(err, libvirt.ErrOperationInvalid, libvirt.ErrNoDomain) {
			return fmt.Errorf("destroy domain %q: %w", dom.Name, err)
		}
	}
	flags := libvirt.DomainUndefineManagedSave | libvirt.DomainUndefineSnapshotsMetadata |
		libvirt.DomainUndefineCheckpointsMetadata | libvirt.DomainUndefineNvram
	if err := l.DomainUndefineFlags(dom, flags); err != nil && !isLibvirtCode(err, libvirt.ErrNoDomain) {
		return fmt.Errorf("undefine domain %q: %w", dom.Name, err)
	}
	return nil
}

// deleteVolumes deletes the overlay and the seed of domain name; missing
// volumes are fine.
func (p *Provider) deleteVolumes(l *libvirt.Libvirt, name string) error {
	pool, err := l.StoragePoolLookupByName(p.cfg.Pool)
	if err != nil {
		return fmt.Errorf("look up pool %q: %w", p.cfg.Pool, err)
	}
	return p.deleteVolumesIn(l, pool, name)
}

// deleteVolumesIn is deleteVolumes with the pool already looked up.
func (p *Provider) deleteVolumesIn(l *libvirt.Libvirt, pool libvirt.StoragePool, name string) error {
	for _, v := range []string{overlayVolume(name), seedVolume(name)} {
		vol, err := l.StorageVolLookupByName(pool, v)
		if isLibvirtCode(err, libvirt.ErrNoStorageVol) {
			continue
		}
		if err != nil {
			return fmt.Errorf("look up volume %q: %w", v, err)
		}
		if err := l.StorageVolDelete(vol, 0); err != nil && !isLibvirtCode(err, libvirt.ErrNoStorageVol) {
			return fmt.Errorf("delete volume %q: %w", v, err)
		}
	}
	return nil
}

// Create makes the instance: ensures the base image (imagecache), creates
// the qcow2 overlay "<domain>.qcow2" backed by it and the NoCloud seed
// "<domain>-seed.iso", defines the domain with our metadata and starts it.
// It is idempotent on UID: an existing instance of this name and UID is
// returned as it is. A name held by anything else is Permanent. If a step
// fails, what this call created is removed (bounded by cleanupTimeout even
// when ctx ended); what cannot be removed is left named so that Delete
// removes it.
func (p *Provider) Create(ctx context.Context, spec provider.Spec) (provider.Instance, error) {
	if err := p.checkOpen(); err != nil {
		return provider.Instance{}, err
	}
	if err := spec.Validate(); err != nil {
		return provider.Instance{}, err
	}
	ref := spec.Ref()
	imgKey := spec.ImageKey
	if imgKey == "" {
		imgKey = p.cfg.DefaultImage
	}
	img, ok := p.cfg.Images[imgKey]
	if !ok {
		if imgKey == "" {
			return provider.Instance{}, provider.WithCode(provider.Permanent, fieldErr("ImageKey", "", "no image configured for this provider entry (Config.Images is empty)"))
		}
		return provider.Instance{}, provider.WithCode(provider.Permanent, fieldErr("ImageKey", imgKey, "is not a configured image of this provider entry"))
	}
	mtName := spec.MachineType
	if mtName == "" {
		mtName = p.cfg.DefaultMachineType
	}
	mt, ok := p.cfg.MachineTypes[mtName]
	if !ok {
		return provider.Instance{}, provider.WithCode(provider.Permanent, fieldErr("MachineType", mtName, "is not a configured machine type of this provider entry"))
	}
	name := domainName(p.cfg.Entry, spec.Name)
	meta := instanceMeta{UID: spec.UID, Created: time.Now().UTC().Truncate(time.Millisecond), Entry: p.cfg.Entry, Owner: p.cfg.Owner, Port: spec.EffectivePort()}
	params := domainParams{
		Name: name, Type: p.cfg.DomainType, VCPUs: mt.VCPUs, MemoryMiB: mt.MemoryMiB,
		Pool: p.cfg.Pool, Overlay: overlayVolume(name), Seed: seedVolume(name),
		Network: p.cfg.Network, Bridge: p.cfg.Bridge,
		Kernel: p.cfg.Kernel, Initrd: p.cfg.Initrd, Cmdline: p.cfg.Cmdline,
		Meta: meta,
	}
	if p.cfg.ConsoleLogDir != "" {
		params.ConsoleLog = path.Join(p.cfg.ConsoleLogDir, name+".log")
	}
	// Everything that can be refused for bad input is built before the
	// host is touched.
	domXML, err := buildDomainXML(params)
	if err != nil {
		return provider.Instance{}, err
	}
	seed, err := buildSeed(seedData{InstanceID: spec.UID, Hostname: spec.Name, UserData: spec.UserData})
	if err != nil {
		return provider.Instance{}, err
	}

	unlock, err := p.locks.lock(ctx, name)
	if err != nil {
		return provider.Instance{}, err
	}
	defer unlock()

	// Already there?
	info, err := p.lookup(ctx, "kvm2.Create.lookup", name)
	switch {
	case err == nil:
		if info.ours && info.meta.UID == spec.UID {
			p.log.V(1).Info("create: instance exists", "instance", spec.Name, "uid", spec.UID)
			inst, err := p.instance(ctx, spec.Name, info, true)
			if err != nil && provider.Code(err) == provider.Transient {
				inst, err = p.instance(ctx, spec.Name, info, false) // the address is best-effort here
			}
			return inst, p.wrap("create", ref, err)
		}
		return provider.Instance{}, provider.Errorf(provider.Permanent, "kvm2 %s: create %s: domain %q exists and is not this instance (UID %q): name taken", p.cfg.Entry, spec.Name, name, spec.UID)
	case provider.Code(classify(err)) != provider.NotFound:
		return provider.Instance{}, p.wrap("create", ref, err)
	}

	base, err := p.cache.Ensure(ctx, img)
	if err != nil {
		return provider.Instance{}, p.wrap("create", ref, fmt.Errorf("ensure base image %q: %w", img.Key, err))
	}

	var made created
	err = p.do(ctx, "kvm2.Create", func(l *libvirt.Libvirt) error {
		return p.create(l, name, base, seed, domXML, &made)
	}, attribute.String("domain", name), attribute.String("volume", overlayVolume(name)))
	if err != nil {
		p.undo(ctx, name, &made)
		return provider.Instance{}, p.wrap("create", ref, err)
	}
	p.log.Info("created", "instance", spec.Name, "uid", spec.UID, "domain", name, "base", base.Volume)
	return provider.Instance{
		Ref:       ref,
		CreatedAt: meta.Created,
		State:     mapState(libvirt.DomainRunning, false),
		Port:      meta.Port,
	}, nil
}

// created records what a Create made, for undo.
type created struct {
	mu                    sync.Mutex
	overlay, seed, domain bool
}

func (c *created) set(f *bool) { c.mu.Lock(); *f = true; c.mu.Unlock() }

// create makes the volumes and the domain and starts it: 8 RPCs (pool
// lookup, two leftover lookups, two volume creations, the seed upload
// stream, define, start).
func (p *Provider) create(l *libvirt.Libvirt, name string, base imagecache.Base, seed []byte, domXML string, made *created) error {
	pool, err := l.StoragePoolLookupByName(p.cfg.Pool)
	if err != nil {
		return fmt.Errorf("look up pool %q: %w", p.cfg.Pool, err)
	}
	// Leftovers of an earlier failed Create of this name (no domain exists,
	// we hold the name lock) are removed first.
	if err := p.deleteVolumesIn(l, pool, name); err != nil {
		return err
	}
	overlay := libvirtxml.StorageVolume{
		Name:     overlayVolume(name),
		Capacity: &libvirtxml.StorageVolumeSize{Value: 0}, // 0 with a backing store: the base's size
		Target:   &libvirtxml.StorageVolumeTarget{Format: &libvirtxml.StorageVolumeTargetFormat{Type: "qcow2"}, Compat: "1.1"},
		BackingStore: &libvirtxml.StorageVolumeBackingStore{
			Path:   base.Path,
			Format: &libvirtxml.StorageVolumeTargetFormat{Type: base.Format},
		},
	}
	ox, err := overlay.Marshal()
	if err != nil {
		return provider.WithCode(provider.Permanent, fmt.Errorf("marshal overlay volume: %w", err))
	}
	if _, err := l.StorageVolCreateXML(pool, ox, 0); err != nil {
		return fmt.Errorf("create overlay %q backed by %q: %w", overlay.Name, base.Volume, err)
	}
	made.set(&made.overlay)

	sv := libvirtxml.StorageVolume{
		Name:     seedVolume(name),
		Capacity: &libvirtxml.StorageVolumeSize{Value: uint64(len(seed))},
		Target:   &libvirtxml.StorageVolumeTarget{Format: &libvirtxml.StorageVolumeTargetFormat{Type: "raw"}},
	}
	sx, err := sv.Marshal()
	if err != nil {
		return provider.WithCode(provider.Permanent, fmt.Errorf("marshal seed volume: %w", err))
	}
	vol, err := l.StorageVolCreateXML(pool, sx, 0)
	if err != nil {
		return fmt.Errorf("create seed volume %q: %w", sv.Name, err)
	}
	made.set(&made.seed)
	if err := l.StorageVolUpload(vol, bytes.NewReader(seed), 0, uint64(len(seed)), 0); err != nil {
		return fmt.Errorf("upload seed %q: %w", sv.Name, err)
	}

	dom, err := l.DomainDefineXMLFlags(domXML, libvirt.DomainDefineValidate)
	if err != nil {
		return fmt.Errorf("define domain %q: %w", name, err)
	}
	made.set(&made.domain)
	if err := l.DomainCreate(dom); err != nil {
		return fmt.Errorf("start domain %q: %w", name, err)
	}
	return nil
}

// undo removes what a failed Create made, on a fresh bounded context when
// ctx already ended. What it cannot remove stays under the instance's names,
// where Delete finds it.
func (p *Provider) undo(ctx context.Context, name string, made *created) {
	made.mu.Lock()
	overlay, seed, domain := made.overlay, made.seed, made.domain
	made.mu.Unlock()
	if !overlay && !seed && !domain {
		return
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	err := p.do(cctx, "kvm2.Create.undo", func(l *libvirt.Libvirt) error {
		if domain {
			dom, err := l.DomainLookupByName(name)
			if err == nil {
				if err := p.removeDomain(l, dom, libvirt.DomainNostate); err != nil {
					return err
				}
			} else if !isLibvirtCode(err, libvirt.ErrNoDomain) {
				return err
			}
		}
		return p.deleteVolumes(l, name)
	}, attribute.String("domain", name))
	if err != nil {
		p.log.Error(err, "create failed and its leftovers could not all be removed; Delete removes them", "domain", name)
	}
}
