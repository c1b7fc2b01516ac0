package kvm2

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
	"go.opentelemetry.io/otel/attribute"
)

var _ driver.Provider = (*provider)(nil)

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
		return nil, errs.FromContext(ctx.Err())
	}
}

// domainInfo is what one read of a domain gives.
type domainInfo struct {
	dom    libvirt.Domain
	meta   instanceMeta
	ours   bool   // carries our metadata for this entry and owner
	mac    string // MAC of the first NIC
	state  libvirt.DomainState
	reason int32 // of the state (e.g. libvirt.DomainShutoffReason)
}

// readDomain reads a domain's XML (metadata, MAC) and state: 2 RPCs, made
// at once (one round trip). The XML is decoded once, after the state is
// known. The MAC is only used to look for the address of an active domain,
// so it is read only when the caller will look (withMAC) and the domain is
// active; otherwise decoding stops at our metadata element.
func (p *provider) readDomain(l lvAPI, dom libvirt.Domain, withMAC bool) (domainInfo, error) {
	var (
		wg         sync.WaitGroup
		st, reason int32
		stErr      error
		x          string
		err        error
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		st, reason, stErr = l.DomainGetState(dom, 0)
	}()
	x, err = l.DomainGetXMLDesc(dom, 0)
	wg.Wait()
	if err != nil {
		return domainInfo{dom: dom}, fmt.Errorf("get XML of domain %q: %w", dom.Name, err)
	}
	info := p.parseDomain(dom, x, libvirt.DomainState(st), reason, withMAC && stErr == nil)
	if stErr != nil {
		return info, fmt.Errorf("get state of domain %q: %w", dom.Name, stErr)
	}
	return info, nil
}

// parseDomain decodes the XML x of dom, in state st (with reason); the MAC
// only when withMAC and the domain is active.
func (p *provider) parseDomain(dom libvirt.Domain, x string, st libvirt.DomainState, reason int32, withMAC bool) domainInfo {
	info := domainInfo{dom: dom, state: st, reason: reason}
	px := parseDomainXML(x, withMAC && domainActive(st))
	switch err := px.metaErr; {
	case err == nil:
		info.meta = px.meta
		info.ours = px.meta.Entry == p.cfg.Entry && px.meta.Owner == p.cfg.Owner
	case errors.Is(err, errNoMetadata):
	default:
		p.log.Info("domain has malformed egressproxy metadata; treating it as not ours", "domain", dom.Name, "err", err)
	}
	info.mac = px.mac
	return info
}

// lookup finds the domain of ref and reads it: 3 RPCs. A missing domain is
// NotFound.
func (p *provider) lookup(ctx context.Context, op, name string) (domainInfo, error) {
	var info domainInfo
	err := p.do(ctx, op, func(l lvAPI) error {
		dom, err := l.DomainLookupByName(name)
		if err != nil {
			return fmt.Errorf("look up domain %q: %w", name, err)
		}
		info, err = p.readDomain(l, dom, true)
		return err
	}, attribute.String("domain", name))
	if err != nil {
		return domainInfo{}, err // fn may still be running: never read what it writes
	}
	return info, nil
}

// instance builds the Instance of a domain we own, with the address when it
// is active (discover: agent → lease → ARP).
func (p *provider) instance(ctx context.Context, name string, info domainInfo, discover bool) (egressproxy.Instance, error) {
	return p.instanceOf(ctx, name, info, discover, nil)
}

// instanceOf is instance with the address calls bounded by lim (nil: none).
func (p *provider) instanceOf(ctx context.Context, name string, info domainInfo, discover bool, lim limiter) (egressproxy.Instance, error) {
	inst := egressproxy.Instance{
		Ref:        egressproxy.Ref{Name: name, UID: info.meta.UID},
		CreatedAt:  info.meta.Created,
		Port:       info.meta.Port,
		SpecDigest: info.meta.SpecDigest,
	}
	if discover && domainActive(info.state) {
		ip, src, err := discoverAddress(ctx, &domainAddrs{p: p, dom: info.dom, lim: lim}, info.mac)
		if err != nil {
			return egressproxy.Instance{}, err
		}
		inst.IP, inst.AddressSource = ip, src
	}
	inst.State = mapState(info.state, inst.IP != "")
	return inst, nil
}

// domainAddrs is the addrBackend of one domain over the shared connection.
type domainAddrs struct {
	p   *provider
	dom libvirt.Domain
	lim limiter // bounds the calls in flight of the operation (nil: none)
}

func (d *domainAddrs) InterfaceAddresses(ctx context.Context, src libvirt.DomainInterfaceAddressesSource) ([]libvirt.DomainInterface, error) {
	if err := d.lim.acquire(ctx); err != nil {
		return nil, err
	}
	defer d.lim.release()
	var out []libvirt.DomainInterface
	err := d.p.do(ctx, "kvm2.InterfaceAddresses", func(l lvAPI) error {
		var err error
		out, err = l.DomainInterfaceAddresses(d.dom, uint32(src), 0)
		return err
	}, attribute.String("domain", d.dom.Name), attribute.Int("source", int(src)))
	if err != nil {
		return nil, err // fn may still be running: never read what it writes
	}
	return out, nil
}

// wrap prefixes err with the entry and classifies it. It says only what the
// caller does not: egressproxy.Client already says the operation and the
// instance ("egressproxy get proxy-1: kvm2 hv1: look up domain …"), so
// neither is repeated here.
//
// A call that Close interrupted fails with ErrClosed (Permanent), whatever
// the torn-down connection made of it (a link error would say Transient, and
// a retry on this provider cannot succeed), unless the caller's context
// ended too: that class stays.
func (p *provider) wrap(err error) error {
	if err == nil {
		return nil
	}
	werr := classify(fmt.Errorf("kvm2 %s: %w", p.cfg.Entry, err))
	if p.closed.Load() && !errors.Is(werr, errs.ErrClosed) {
		if c := errs.Code(werr); c != errs.Canceled && c != errs.DeadlineExceeded {
			return errs.WithCode(errs.Permanent, fmt.Errorf("kvm2 %s: %w", p.cfg.Entry, closedError{Err: err}))
		}
	}
	return werr
}

// Get reads the instance back from the host: UID, creation time and port
// from our metadata, state from libvirt, address from the guest agent, the
// DHCP lease or ARP. A missing domain, or one that is not ours (no metadata,
// another entry or owner, another UID), is NotFound. An address that cannot
// be read is Transient (never Failed).
func (p *provider) Get(ctx context.Context, ref egressproxy.Ref) (_ egressproxy.Instance, opErr error) {
	ctx, end := p.start(ctx, "kvm2.Get", ref.Name, false)
	defer func() { end(opErr) }()
	if err := p.checkOpen(); err != nil {
		return egressproxy.Instance{}, err
	}
	if err := naming.ValidateRef(ref.Name, ref.UID); err != nil {
		return egressproxy.Instance{}, err
	}
	info, err := p.lookup(ctx, "kvm2.Get", domainName(p.cfg.Entry, ref.Name))
	if err != nil {
		return egressproxy.Instance{}, classifyRead(fmt.Errorf("kvm2 %s: %w", p.cfg.Entry, err))
	}
	if !info.ours || info.meta.UID != ref.UID {
		return egressproxy.Instance{}, errs.Errorf(errs.NotFound, "kvm2 %s: no instance with UID %s", p.cfg.Entry, errs.Quote(ref.UID))
	}
	inst, err := p.instance(ctx, ref.Name, info, true)
	if err != nil {
		return egressproxy.Instance{}, classifyRead(fmt.Errorf("kvm2 %s: %w", p.cfg.Entry, err))
	}
	return inst, nil
}

// listInFlight bounds the libvirt calls one List has in flight on the
// shared connection (go-libvirt multiplexes them), so that List of n
// instances takes about 1 + n/listInFlight round trips instead of 1 + 2n.
//
// libvirtd works on at most max_client_requests (default 5) calls of one
// connection at once and leaves the rest unread in the socket until one is
// answered, so the bound does not set libvirtd's load (that stays 5 calls)
// but how much of the round trip the queue hides. It is sized for 1,000
// instances at 50 ms RTT: libvirtd answers the XML reads of one
// connection at about one per 0.15-0.25 ms, so 50 ms of round trip hide
// behind about 200 queued reads. With 256, List of 1,000 is bound by
// libvirtd's own work plus a few round trips: 0.38 s at 50 ms in
// docs/scale-libvirt.md's run, where 32 took 2.1 s (33 round trips).
//
// The cost: a call another caller makes during a List's burst waits
// behind the queued reads, up to about 256 × 0.25 ms = 64 ms, and libvirtd
// logs once per connection "Client hit max requests limit 5. This may
// result in keep-alive timeouts" (libvirt's keepalive is not used on these
// connections: go-libvirt never enables it, and liveness comes from SSH
// keepalives). The answers in flight (a few KB of XML each) stay well
// inside the SSH channel's 2 MB window.
const listInFlight = 256

// List returns every instance of this entry and owner (domains carrying our
// metadata namespace with this Entry and Owner), sorted by name. Addresses
// are looked up best-effort: an instance whose address cannot be read is
// listed without one (Provisioning when active).
//
// One call lists every domain with its state (ConnectGetAllDomainStats);
// the XML of each domain with our name prefix is then read, and the
// addresses of the active ones looked up, at most listInFlight calls at
// once. A domain undefined meanwhile is skipped.
func (p *provider) List(ctx context.Context) (_ []egressproxy.Instance, opErr error) {
	ctx, end := p.start(ctx, "kvm2.List", "", false)
	defer func() { end(opErr) }()
	if err := p.checkOpen(); err != nil {
		return nil, err
	}
	prefix := domainPrefix + p.cfg.Entry + "--"
	var found []domainInfo
	err := p.do(ctx, "kvm2.List", func(l lvAPI) error {
		var err error
		found, err = p.listDomains(ctx, l, prefix)
		return err
	})
	if err != nil {
		return nil, classifyRead(fmt.Errorf("kvm2 %s: %w", p.cfg.Entry, err))
	}
	out := make([]egressproxy.Instance, len(found))
	lim := make(limiter, listInFlight)
	err = forEach(ctx, len(found), listInFlight, func(ctx context.Context, i int) error {
		info := found[i]
		name := strings.TrimPrefix(info.dom.Name, prefix)
		inst, err := p.instanceOf(ctx, name, info, true, lim)
		if err != nil {
			if stopsCreate(err) {
				return err
			}
			inst, _ = p.instanceOf(ctx, name, info, false, nil)
		}
		out[i] = inst
		return nil
	})
	if err != nil {
		return nil, classifyRead(fmt.Errorf("kvm2 %s: %w", p.cfg.Entry, err))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// listDomains runs on the shared connection (List's fn): it lists every
// domain with its state in one call, then reads the XML of those named
// with prefix, listInFlight at a time, and returns the ones that are ours.
// It checks ctx before each call, so that an abandoned List stops at the
// next boundary.
func (p *provider) listDomains(ctx context.Context, l lvAPI, prefix string) ([]domainInfo, error) {
	recs, err := l.ConnectGetAllDomainStats(nil, uint32(libvirt.DomainStatsState), 0)
	if err != nil {
		return nil, fmt.Errorf("list domains: %w", err)
	}
	var cands []libvirt.DomainStatsRecord
	for _, r := range recs {
		if strings.HasPrefix(r.Dom.Name, prefix) { // our names always have this shape; skip the others' RPCs
			cands = append(cands, r)
		}
	}
	infos := make([]domainInfo, len(cands))
	err = forEach(ctx, len(cands), listInFlight, func(ctx context.Context, i int) error {
		dom := cands[i].Dom
		st, reason, ok := statsState(cands[i].Params)
		var (
			info domainInfo
			err  error
		)
		if ok {
			var x string
			if x, err = l.DomainGetXMLDesc(dom, 0); err == nil {
				info = p.parseDomain(dom, x, st, reason, true)
			} else {
				err = fmt.Errorf("get XML of domain %q: %w", dom.Name, err)
			}
		} else {
			info, err = p.readDomain(l, dom, true) // no state in the record: ask
		}
		switch {
		case isLibvirtCode(err, libvirt.ErrNoDomain):
			return nil // undefined meanwhile
		case err != nil:
			return err
		}
		infos[i] = info
		return nil
	})
	if err != nil {
		return nil, err
	}
	var found []domainInfo
	for _, info := range infos {
		if info.ours {
			found = append(found, info)
		}
	}
	return found, nil
}

// statsState reads the state and its reason from a domain's stats record
// (the "state" group of ConnectGetAllDomainStats).
func statsState(params []libvirt.TypedParam) (libvirt.DomainState, int32, bool) {
	var st, reason int32
	var haveSt, haveReason bool
	for _, tp := range params {
		v, isInt := tp.Value.I.(int32)
		switch {
		case !isInt:
		case tp.Field == "state.state":
			st, haveSt = v, true
		case tp.Field == "state.reason":
			reason, haveReason = v, true
		}
	}
	return libvirt.DomainState(st), reason, haveSt && haveReason
}

// Delete removes the instance: destroys and undefines its domain (with
// managed-save, snapshot, checkpoint and NVRAM metadata) and deletes its
// overlay and seed volumes. The base image is never touched. A missing
// instance succeeds; so does a name whose domain is not ours (it is left
// alone). Leftover volumes of a failed Create (no domain) are removed. A
// volume is never deleted while a domain of its name exists (one defined
// meanwhile by a Create in another process keeps it). A race with a Create
// of this instance (a volume still being written, a domain being started)
// is Transient. When the entry's pool is gone (destroyed or undefined; its
// files may still be on disk) Delete removes the domain and fails
// Permanent, naming the pool, until the pool is back: never NotFound, and
// never a success that leaves volumes behind unseen.
func (p *provider) Delete(ctx context.Context, ref egressproxy.Ref) (opErr error) {
	ctx, end := p.start(ctx, "kvm2.Delete", ref.Name, true)
	defer func() { end(opErr) }()
	if err := p.checkOpen(); err != nil {
		return err
	}
	if err := naming.ValidateRef(ref.Name, ref.UID); err != nil {
		return err
	}
	name := domainName(p.cfg.Entry, ref.Name)
	unlock, err := p.locks.lock(ctx, name)
	if err != nil {
		return err
	}
	defer unlock()
	vols := []string{overlayVolume(name), seedVolume(name)}
	err = p.do(ctx, "kvm2.Delete", func(l lvAPI) error {
		// The pool is looked up with the domain (one round trip): its
		// failure counts only once the domain is dealt with (see
		// deleteVolumes).
		var (
			wg      sync.WaitGroup
			pool    libvirt.StoragePool
			poolErr error
		)
		wg.Add(1)
		go func() {
			defer wg.Done()
			pool, poolErr = l.StoragePoolLookupByName(p.cfg.Pool)
		}()
		dom, err := l.DomainLookupByName(name)
		wg.Wait()
		deleteVolumes := func() error {
			if poolErr != nil {
				// A missing pool is Permanent (the shared table), never
				// NotFound: its volumes may still be on disk (a dir pool
				// destroyed or undefined keeps its files), so Delete
				// cannot claim success; it completes once the pool is
				// back.
				return fmt.Errorf("look up pool %q: %w", p.cfg.Pool, poolErr)
			}
			return p.deleteUnusedVolumes(l, name, &pool, vols...)
		}
		switch {
		case isLibvirtCode(err, libvirt.ErrNoDomain):
			// No domain: only leftovers of a failed Create can remain.
			return deleteVolumes()
		case err != nil:
			return fmt.Errorf("look up domain: %w", err)
		}
		info, err := p.readDomain(l, dom, false) // no address lookup: no MAC
		if err != nil {
			if isLibvirtCode(err, libvirt.ErrNoDomain) {
				return deleteVolumes()
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
		return deleteVolumes()
	}, attribute.String("domain", name))
	if err != nil {
		return p.wrap(raced(err))
	}
	p.log.V(1).Info("deleted", "instance", ref.Name, "uid", ref.UID)
	return nil
}

// removeDomain undefines dom and then, unless st says it was stopped,
// destroys it; a domain that is already gone, or not running, is fine.
// The undefine comes first: a running domain it leaves transient, which
// the destroy then removes for good. In the other order, a start libvirtd
// received earlier and ran late (a Create's start sent on a link that
// closed meanwhile) could revive the domain between the destroy and the
// undefine, and the undefine would leave it running as a transient domain
// with its volumes; after the undefine, such a start finds no domain, or
// one that is already running.
func (p *provider) removeDomain(l lvAPI, dom libvirt.Domain, st libvirt.DomainState) error {
	flags := libvirt.DomainUndefineManagedSave | libvirt.DomainUndefineSnapshotsMetadata |
		libvirt.DomainUndefineCheckpointsMetadata | libvirt.DomainUndefineNvram
	err := l.DomainUndefineFlags(dom, flags)
	switch {
	case err == nil || isLibvirtCode(err, libvirt.ErrNoDomain):
	case st != libvirt.DomainShutoff && isLibvirtCode(err, libvirt.ErrOperationInvalid):
		// A transient domain (an earlier removal's undefine left it
		// running, and its destroy failed): the destroy removes it.
	default:
		return fmt.Errorf("undefine domain %q: %w", dom.Name, err)
	}
	if st != libvirt.DomainShutoff {
		if err := l.DomainDestroy(dom); err != nil && !isLibvirtCode(err, libvirt.ErrOperationInvalid, libvirt.ErrNoDomain) {
			return fmt.Errorf("destroy domain %q: %w", dom.Name, err)
		}
	}
	return nil
}

// deleteUnusedVolumes deletes the named volumes of domain name, only
// after checking that no domain of that name exists (a Create elsewhere
// may have defined one meanwhile: its volumes are left to it); missing
// volumes are fine. pool is the entry's pool handle (nil: looked up). The
// volumes are looked up and the domain checked at once, then the volumes
// found are deleted at once: two round trips whatever their number (the
// check still comes before any deletion).
func (p *provider) deleteUnusedVolumes(l lvAPI, name string, pool *libvirt.StoragePool, vols ...string) error {
	if len(vols) == 0 {
		return nil
	}
	if pool == nil {
		pl, err := l.StoragePoolLookupByName(p.cfg.Pool)
		if err != nil {
			// A missing pool is Permanent (the shared table), never
			// NotFound: see Delete.
			return fmt.Errorf("look up pool %q: %w", p.cfg.Pool, err)
		}
		pool = &pl
	}
	found := make([]libvirt.StorageVol, len(vols))
	problems := make([]error, len(vols))
	var wg sync.WaitGroup
	for i, v := range vols {
		wg.Add(1)
		go func() {
			defer wg.Done()
			found[i], problems[i] = l.StorageVolLookupByName(*pool, v)
		}()
	}
	_, domErr := l.DomainLookupByName(name)
	wg.Wait()
	var del []int
	for i, err := range problems {
		switch {
		case isLibvirtCode(err, libvirt.ErrNoStorageVol):
		case err != nil:
			return fmt.Errorf("look up volume %q: %w", vols[i], err)
		default:
			del = append(del, i)
		}
	}
	if len(del) == 0 {
		return nil
	}
	if domErr == nil {
		p.log.V(1).Info("volumes kept: a domain of their name exists (defined meanwhile by another call)", "domain", name, "volume", vols[del[0]])
		return nil
	} else if !isLibvirtCode(domErr, libvirt.ErrNoDomain) {
		return fmt.Errorf("look up domain %q: %w", name, domErr)
	}
	for _, i := range del {
		wg.Add(1)
		go func() {
			defer wg.Done()
			problems[i] = l.StorageVolDelete(found[i], 0)
		}()
	}
	wg.Wait()
	for _, i := range del {
		if err := problems[i]; err != nil && !isLibvirtCode(err, libvirt.ErrNoStorageVol) {
			return fmt.Errorf("delete volume %q: %w", vols[i], err)
		}
	}
	return nil
}
