package kvm2

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"path"
	"strings"
	"sync"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
	"go.opentelemetry.io/otel/attribute"
	"libvirt.org/go/libvirtxml"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/basecache"
	"github.com/egressproxy/egressproxy/internal/budget"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/sshconn"
)

// cleanupTimeout bounds removing what a failed Create made, after the
// caller's context may have ended.
const cleanupTimeout = 30 * time.Second

// Create makes the instance: ensures the base image (imagecache), creates
// the qcow2 overlay "<domain>.qcow2" backed by it and the NoCloud seed
// "<domain>-seed.iso", defines the domain with our metadata (including the
// spec's digest) and starts it. Its domain type is Config.DomainType's;
// for the zero value the first Create of a new instance reads the host's
// domain capabilities (unless a Check did) and uses "kvm" when the host
// offers it, else "qemu"; an explicit "kvm" the host does not offer is
// Permanent, naming DomainType, before the base image is fetched.
//
// Create converges rather than undoing on uncertainty, so that calling it
// again after any interruption (context ended, Close, link lost, process
// killed) completes the same instance:
//
//   - an instance of this name and UID that exists and runs (or was
//     stopped) is returned as it is; one that is shut off and never ran
//     (libvirt's shut-off reason "unknown" or "failed to start": an earlier
//     Create stopped after defining it) is completed: missing volumes are
//     recreated and it is started;
//   - an overlay left by an earlier attempt (or being made by another
//     replica) is reused when its backing store is this spec's base, and
//     replaced when it is another base's and no domain of this name
//     exists (left by an interrupted Create with another image); the
//     seed is always uploaded again (recreated when its size differs);
//   - "exists already" on a volume or the domain, and "already running" on
//     start, mean another call got there first: Create reads the object
//     back and carries on with it;
//   - a race with another Create or a Delete of this name (in this or
//     another process) that Create cannot resolve is Transient: a retry
//     converges.
//
// It is idempotent on UID. An existing instance whose recorded spec digest
// differs from spec's is errs.ErrSpecConflict (Permanent), and nothing
// changes; instances without a recorded digest (made by earlier versions)
// are not checked. A name held by anything else is Permanent.
//
// When a step fails for certain (libvirt answered with an error), what this
// call made is removed, bounded by cleanupTimeout even when ctx ended — the
// domain it defined, then the volumes it created, and never a volume while
// a domain of that name exists. When the outcome is uncertain (ctx ended,
// Close, link lost) nothing is removed: the retried Create completes it,
// Delete removes it.
func (p *provider) Create(ctx context.Context, spec egressproxy.Spec) (_ egressproxy.Instance, opErr error) {
	ctx, end := p.start(ctx, "kvm2.Create", spec.Name, true)
	defer func() { end(opErr) }()
	if err := p.checkOpen(); err != nil {
		return egressproxy.Instance{}, err
	}
	plan, err := p.plan(spec)
	if err != nil {
		return egressproxy.Instance{}, err
	}
	name := plan.params.Name
	unlock, err := p.locks.lock(ctx, name)
	if err != nil {
		return egressproxy.Instance{}, err
	}
	defer unlock()

	c := &creation{p: p, spec: spec, name: name, domXML: plan.domXML, meta: plan.params.Meta}
	info, err := c.lookup(ctx)
	switch {
	case err == nil:
		if inst, done, err := c.existing(ctx, info); done {
			return inst, err
		}
	case errs.Code(classify(err)) != errs.NotFound:
		return egressproxy.Instance{}, p.wrap(err)
	}
	// The seed is built only now that the instance is known to be made or
	// completed (its input was validated with the spec); an adopted domain's
	// creation time gives the same image as the first attempt's.
	if c.seed, err = buildSeed(seedData{InstanceID: spec.UID, Hostname: spec.Name, UserData: spec.UserData, Created: c.meta.Created}); err != nil {
		return egressproxy.Instance{}, err
	}
	p.seedsBuilt.Add(1)
	if !c.adopted {
		// Decided before the base image is fetched, so that an explicit
		// "kvm" the host does not offer costs no download.
		if c.domXML, err = p.typedDomainXML(ctx, plan.params, c.domXML); err != nil {
			return egressproxy.Instance{}, err
		}
	}
	c.base, err = p.cache.Ensure(ctx, plan.img)
	if err != nil {
		return egressproxy.Instance{}, p.wrap(fmt.Errorf("base image: %w", err)) // imagecache names the image (key or base volume)
	}
	return c.run(ctx)
}

// createPlan is what Create builds from the spec and the entry's
// configuration before it touches the host.
type createPlan struct {
	img    imagecache.Image
	params domainParams
	domXML string // the domain XML of params
}

// plan validates spec, resolves its image and machine type (the entry's
// defaults for empty keys) and builds the domain XML: everything that can
// be refused for bad input, Permanent, before the host is touched.
func (p *provider) plan(spec egressproxy.Spec) (createPlan, error) {
	if err := spec.Validate(); err != nil {
		return createPlan{}, err
	}
	imgKey := spec.ImageKey
	if imgKey == "" {
		imgKey = p.cfg.DefaultImage
	}
	img, ok := p.cfg.Images[imgKey]
	if !ok {
		if imgKey == "" {
			return createPlan{}, errs.WithCode(errs.Permanent, fieldErr("ImageKey", "", "no image configured for this provider entry (Config.Images is empty)"))
		}
		return createPlan{}, errs.WithCode(errs.Permanent, fieldErr("ImageKey", imgKey, "is not a configured image of this provider entry"))
	}
	mtName := spec.MachineType
	if mtName == "" {
		mtName = p.cfg.DefaultMachineType
	}
	mt, ok := p.cfg.MachineTypes[mtName]
	if !ok {
		return createPlan{}, errs.WithCode(errs.Permanent, fieldErr("MachineType", mtName, "is not a configured machine type of this provider entry"))
	}
	name := domainName(p.cfg.Entry, spec.Name)
	params := domainParams{
		Name: name, Type: p.cfg.DomainType, VCPUs: mt.VCPUs, MemoryMiB: mt.MemoryMiB,
		Pool: p.cfg.Pool, Overlay: overlayVolume(name), Seed: seedVolume(name),
		Network: p.cfg.Network, Bridge: p.cfg.Bridge,
		Kernel: p.cfg.Kernel, Initrd: p.cfg.Initrd, Cmdline: p.cfg.Cmdline,
		Meta: instanceMeta{
			UID: spec.UID, Created: time.Now().UTC().Truncate(time.Millisecond), Entry: p.cfg.Entry, Owner: p.cfg.Owner,
			Port: spec.EffectivePort(), SpecDigest: spec.Digest(),
		},
	}
	if p.cfg.ConsoleLogDir != "" {
		params.ConsoleLog = path.Join(p.cfg.ConsoleLogDir, name+".log")
	}
	domXML, err := buildDomainXML(params)
	if err != nil {
		return createPlan{}, err
	}
	return createPlan{img: img, params: params, domXML: domXML}, nil
}

// typedDomainXML returns the domain XML of params with the domain type a
// new instance gets (createDomainType: the host's capabilities may be read
// for it); domXML, params' XML, when that is params.Type already.
func (p *provider) typedDomainXML(ctx context.Context, params domainParams, domXML string) (string, error) {
	typ, err := p.createDomainType(ctx)
	if err != nil {
		return "", p.wrap(err)
	}
	if typ == params.Type {
		return domXML, nil
	}
	params.Type = typ
	return buildDomainXML(params)
}

// existing deals with the domain of the instance's name that lookup found:
// done with the instance (or the error) to return when it is this spec's
// instance and ran, or when it is not this spec's; not done when it is
// this spec's but never ran (an earlier Create stopped after defining it),
// which c then adopts to complete.
func (c *creation) existing(ctx context.Context, info domainInfo) (_ egressproxy.Instance, done bool, _ error) {
	p := c.p
	if err := c.checkOwned(info); err != nil {
		return egressproxy.Instance{}, true, err
	}
	if !neverRan(info.state, info.reason) {
		p.log.V(1).Info("create: instance exists", "instance", c.spec.Name, "uid", c.spec.UID)
		inst, err := p.instance(ctx, c.spec.Name, info, true)
		if err != nil && !stopsCreate(err) {
			// The address is best-effort here (the domain may even
			// have been deleted since: it existed when read).
			inst, err = p.instance(ctx, c.spec.Name, info, false)
		}
		return inst, true, p.wrap(err)
	}
	c.adopt(info)
	p.log.V(1).Info("create: completing an instance that was defined but never started", "instance", c.spec.Name, "uid", c.spec.UID)
	return egressproxy.Instance{}, false, nil
}

// run makes the instance on the host (fresh), or completes the adopted
// domain (complete), in one call on the shared connection. When that fails
// for certain, what this call made is removed (undo); when the outcome is
// uncertain (interrupted), nothing is.
func (c *creation) run(ctx context.Context) (egressproxy.Instance, error) {
	p := c.p
	// fn may outlive Do (a call abandoned by its context completes on
	// libvirtd): it checks this context before every call it makes, so
	// that it stops at the next boundary. Do adds its own budget when ctx
	// has none; so does this.
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = budget.WithTimeout(ctx, "CallTimeout", p.cfg.CallTimeout)
		defer cancel()
	}
	c.ctx = ctx
	op, fn := "kvm2.Create", c.fresh
	if c.adopted {
		op, fn = "kvm2.Create.complete", c.complete
	}
	err := p.do(ctx, op, fn, attribute.String("domain", c.name), attribute.String("volume", overlayVolume(c.name)))
	if err != nil {
		if interrupted(ctx, p, err) {
			p.log.V(1).Info("create interrupted; what it made stays for a retried Create to complete or Delete to remove",
				"instance", c.spec.Name, "uid", c.spec.UID, "err", err)
		} else {
			p.undo(ctx, c)
		}
		return egressproxy.Instance{}, p.wrap(err)
	}
	inst := c.instance()
	if c.adopted {
		p.log.V(1).Info("create: converged on the existing domain", "instance", c.spec.Name, "uid", c.spec.UID, "domain", c.name)
	} else {
		p.log.Info("created", "instance", c.spec.Name, "uid", c.spec.UID, "domain", c.name, "base", c.base.Volume, "source", c.base.Source)
	}
	return inst, nil
}

// stopsCreate reports whether err ends Create instead of being worked
// around: the caller's context ended or the provider is closed.
func stopsCreate(err error) bool {
	c := errs.Code(err)
	return c == errs.Canceled || c == errs.DeadlineExceeded || errors.Is(err, errs.ErrClosed)
}

// interrupted reports whether a failed Create may have had effects it does
// not know of: its context ended, the provider was closed, or the link was
// lost (an RPC whose answer never came may have been carried out).
func interrupted(ctx context.Context, p *provider, err error) bool {
	if ctx.Err() != nil || p.closed.Load() {
		return true
	}
	switch sshKind(err) {
	case sshconn.KindUnreachable, sshconn.KindClosed:
		return true
	}
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, errs.ErrClosed) || linkDead(err)
}

// neverRan reports whether a domain in state st (with reason) is shut off
// and never ran since it was defined (or since libvirtd started): reason
// "unknown" (defined, never started) or "failed" (its start failed).
func neverRan(st libvirt.DomainState, reason int32) bool {
	return st == libvirt.DomainShutoff &&
		(reason == int32(libvirt.DomainShutoffUnknown) || reason == int32(libvirt.DomainShutoffFailed))
}

// raced classes err, from a step another Create or a Delete of the same
// instance (in this or another process) can make fail, Transient when its
// libvirt code says the object went away (no domain, no storage volume),
// appeared (exists already) or is busy (operation invalid: a volume still
// being allocated or in use by an upload, a domain being started): a retry
// converges. Other errors are returned unchanged.
func raced(err error) error {
	if err == nil || linkDead(err) {
		return err
	}
	if isLibvirtCode(err, libvirt.ErrNoDomain, libvirt.ErrNoStorageVol, libvirt.ErrStorageVolExist,
		libvirt.ErrDomExist, libvirt.ErrOperationInvalid) {
		return errs.WithCode(errs.Transient, fmt.Errorf("%w (raced with another Create or a Delete of this instance; a retry converges)", err))
	}
	return err
}

// creation is one Create on the host, from the base image on.
type creation struct {
	p      *provider
	ctx    context.Context // checked before every RPC (see Create)
	spec   egressproxy.Spec
	name   string // domain name
	base   basecache.Base
	seed   []byte
	domXML string

	mu      sync.Mutex           // fn may still run when Create decides (see Create)
	poolH   *libvirt.StoragePool // the entry's pool, once looked up (lookup)
	made    made
	adopted bool           // the domain exists (found, not defined by this call)
	dom     libvirt.Domain // the domain, once defined or found
	meta    instanceMeta   // its metadata (ours until another's is adopted)
	state   libvirt.DomainState
	reason  int32
}

// lookup is Provider.lookup of the instance's domain with the entry's pool
// looked up at the same time (one round trip for both): a new instance
// needs the pool later, and c.pool uses the handle found here.
func (c *creation) lookup(ctx context.Context) (domainInfo, error) {
	var info domainInfo
	err := c.p.do(ctx, "kvm2.Create.lookup", func(l lvAPI) error {
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			if pool, err := l.StoragePoolLookupByName(c.p.cfg.Pool); err == nil {
				c.mu.Lock()
				c.poolH = &pool
				c.mu.Unlock()
				c.p.cache.UsePool(pool) // the cache's first listing needs no lookup of its own
			} // else c.pool asks again, and reports the failure where it always did
		}()
		dom, err := l.DomainLookupByName(c.name)
		wg.Wait()
		if err != nil {
			return fmt.Errorf("look up domain %q: %w", c.name, err)
		}
		info, err = c.p.readDomain(l, dom, true)
		return err
	}, attribute.String("domain", c.name))
	if err != nil {
		return domainInfo{}, err // fn may still be running: never read what it writes
	}
	return info, nil
}

// made records what this call created itself, for undo.
type made struct{ overlay, seed, domain bool }

func (c *creation) set(f func(*made)) { c.mu.Lock(); f(&c.made); c.mu.Unlock() }

// step returns an error when Create must stop before its next RPC.
func (c *creation) step() error {
	if err := budget.Err(c.ctx); err != nil {
		return err // the caller's context error, or our CallTimeout (Transient)
	}
	return c.p.checkOpen()
}

// checkOwned returns nil when info is this spec's instance: ours, with the
// spec's UID, and with the spec's digest (or none recorded).
func (c *creation) checkOwned(info domainInfo) error {
	p := c.p
	if !info.ours || info.meta.UID != c.spec.UID {
		return errs.Errorf(errs.Permanent, "kvm2 %s: the name is taken: domain %q exists and is not the instance with UID %s",
			p.cfg.Entry, c.name, errs.Quote(c.spec.UID))
	}
	if d := info.meta.SpecDigest; d != "" && d != c.meta.SpecDigest {
		port := ""
		if info.meta.Port != c.meta.Port {
			port = fmt.Sprintf(", port %d, now %d", info.meta.Port, c.meta.Port)
		}
		return errs.Errorf(errs.Permanent, "kvm2 %s: %w (digest %s, now %s%s); Delete it to apply this spec",
			p.cfg.Entry, errs.ErrSpecConflict, shortDigest(d), shortDigest(c.meta.SpecDigest), port)
	}
	return nil
}

// shortDigest is the first 12 hex digits of a "sha256:" digest, enough for
// a human to tell two apart.
func shortDigest(d string) string {
	d = strings.TrimPrefix(d, "sha256:")
	if len(d) > 12 {
		d = d[:12]
	}
	return d
}

// adopt makes the existing domain info the one this Create completes.
func (c *creation) adopt(info domainInfo) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.adopted = true
	c.dom, c.meta, c.state, c.reason = info.dom, info.meta, info.state, info.reason
}

// instance is what Create returns once the domain runs (or, adopted, was
// left as it was).
func (c *creation) instance() egressproxy.Instance {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := libvirt.DomainRunning
	if c.adopted && !domainActive(c.state) && !neverRan(c.state, c.reason) {
		st = c.state
	}
	return egressproxy.Instance{
		Ref:        c.spec.Ref(),
		CreatedAt:  c.meta.Created,
		State:      mapState(st, false),
		Port:       c.meta.Port,
		SpecDigest: c.meta.SpecDigest,
	}
}

// fresh makes the instance when no domain of its name was found: overlay
// and seed (at once: they are independent), define, start (5 RPCs, 4 round
// trips with the seed's upload stream, when nothing is in the way).
func (c *creation) fresh(l lvAPI) error {
	pool, err := c.pool(l)
	if err != nil {
		return err
	}
	// Both have ended, and recorded what they made, before fresh goes on
	// or fails; the overlay's failure is reported first, as when the seed
	// was made after it.
	var (
		wg      sync.WaitGroup
		seedErr error
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		seedErr = c.seedVolume(l, pool, true)
	}()
	ovErr := c.overlay(l, pool)
	wg.Wait()
	if ovErr != nil {
		return ovErr
	}
	if seedErr != nil {
		return seedErr
	}
	if err := c.step(); err != nil {
		return err
	}
	dom, err := l.DomainDefineXMLFlags(c.domXML, libvirt.DomainDefineValidate)
	if err != nil {
		if linkDead(err) {
			return fmt.Errorf("define domain %q: %w", c.name, err)
		}
		// Another call may have defined it meanwhile (a replica, or an
		// interrupted call of ours whose define landed late).
		found, ferr := c.findDefined(l)
		if ferr != nil {
			return ferr
		}
		if !found {
			return fmt.Errorf("define domain %q: %w", c.name, err)
		}
		return c.start(l)
	}
	c.mu.Lock()
	c.dom, c.made.domain = dom, true
	c.state, c.reason = libvirt.DomainShutoff, int32(libvirt.DomainShutoffUnknown)
	c.mu.Unlock()
	return c.start(l)
}

// complete finishes an adopted domain that never ran: recreates missing
// volumes (a missing seed is uploaded), then starts it.
func (c *creation) complete(l lvAPI) error {
	pool, err := c.pool(l)
	if err != nil {
		return err
	}
	for _, v := range []string{overlayVolume(c.name), seedVolume(c.name)} {
		if err := c.step(); err != nil {
			return err
		}
		_, err := l.StorageVolLookupByName(pool, v)
		switch {
		case err == nil:
			continue
		case !isLibvirtCode(err, libvirt.ErrNoStorageVol):
			return fmt.Errorf("look up volume %q: %w", v, err)
		}
		c.p.log.V(1).Info("create: recreating a missing volume of a defined domain", "domain", c.name, "volume", v)
		if v == overlayVolume(c.name) {
			err = c.overlay(l, pool)
		} else {
			err = c.seedVolume(l, pool, true)
		}
		if err != nil {
			return err
		}
	}
	return c.start(l)
}

func (c *creation) pool(l lvAPI) (libvirt.StoragePool, error) {
	if err := c.step(); err != nil {
		return libvirt.StoragePool{}, err
	}
	c.mu.Lock()
	found := c.poolH
	c.mu.Unlock()
	if found != nil {
		return *found, nil // looked up with the domain (lookup)
	}
	pool, err := l.StoragePoolLookupByName(c.p.cfg.Pool)
	if err != nil {
		return pool, fmt.Errorf("look up pool %q: %w", c.p.cfg.Pool, err)
	}
	return pool, nil
}

// overlay creates the overlay, or reuses an existing one whose backing store
// is our base.
func (c *creation) overlay(l lvAPI, pool libvirt.StoragePool) error {
	name := overlayVolume(c.name)
	ov := libvirtxml.StorageVolume{
		Name:     name,
		Capacity: &libvirtxml.StorageVolumeSize{Value: 0}, // 0 with a backing store: the base's size
		Target:   &libvirtxml.StorageVolumeTarget{Format: &libvirtxml.StorageVolumeTargetFormat{Type: "qcow2"}, Compat: "1.1"},
		BackingStore: &libvirtxml.StorageVolumeBackingStore{
			Path:   c.base.Path,
			Format: &libvirtxml.StorageVolumeTargetFormat{Type: c.base.Format},
		},
	}
	ox, err := ov.Marshal()
	if err != nil {
		return errs.WithCode(errs.Permanent, fmt.Errorf("marshal overlay volume: %w", err))
	}
	if err := c.step(); err != nil {
		return err
	}
	_, err = l.StorageVolCreateXML(pool, ox, 0)
	switch {
	case err == nil:
		c.set(func(m *made) { m.overlay = true })
		return nil
	case !isLibvirtCode(err, libvirt.ErrStorageVolExist):
		return fmt.Errorf("create overlay %q backed by %q: %w", name, c.base.Volume, err)
	}
	// Left by an earlier Create of this name, or being made by another
	// replica right now: reuse it if it is backed by our base.
	if err := c.step(); err != nil {
		return err
	}
	vol, err := l.StorageVolLookupByName(pool, name)
	if err != nil {
		return raced(fmt.Errorf("look up existing overlay %q: %w", name, err))
	}
	var x string
	err = c.whileBusy(func() error {
		var err error
		x, err = l.StorageVolGetXMLDesc(vol, 0)
		return err
	})
	if err != nil {
		if linkDead(err) || c.ctx.Err() != nil {
			// the link died, or the caller's context ended (while waiting
			// out a busy volume): classify gives the class
			return fmt.Errorf("read existing overlay %q: %w", name, err)
		}
		// e.g. still being written by the call that creates it
		return errs.WithCode(errs.Transient, fmt.Errorf("read existing overlay %q (another call may be creating it; a retry converges): %w", name, err))
	}
	var sv libvirtxml.StorageVolume
	if err := sv.Unmarshal(x); err != nil {
		return errs.WithCode(errs.Transient, fmt.Errorf("parse existing overlay %q: %w", name, err))
	}
	backing := ""
	if sv.BackingStore != nil {
		backing = sv.BackingStore.Path
	}
	if backing != c.base.Path {
		if c.adopted {
			// A defined domain uses it: never delete it.
			return errs.Errorf(errs.Permanent, "overlay %q exists backed by %q, not by base %q (left by a Create with another image?): Delete the instance to remove it",
				name, backing, c.base.Path)
		}
		return c.replaceOverlay(l, pool, vol, ox, backing)
	}
	c.p.log.V(1).Info("create: reusing the existing overlay", "domain", c.name, "volume", name)
	return nil
}

// replaceOverlay replaces an overlay backed by another base than ours that
// no domain uses: left by a Create of this name with another image that
// was interrupted before it defined its domain (its process killed, say),
// it is debris, which Delete would remove too; refusing it would leave the
// name blocked, Permanent, by a transient fault (a process killed between
// the overlay and the define, whose proxy then changed image). A domain of
// this name defined meanwhile keeps it
// (Transient: a retry converges on that domain or after its Delete).
func (c *creation) replaceOverlay(l lvAPI, pool libvirt.StoragePool, vol libvirt.StorageVol, ox, backing string) error {
	name := overlayVolume(c.name)
	if err := c.step(); err != nil {
		return err
	}
	if _, err := l.DomainLookupByName(c.name); err == nil {
		return errs.Errorf(errs.Transient, "overlay %q is backed by %q, not by base %q, and domain %q was defined by another call meanwhile (a retry converges on it)",
			name, backing, c.base.Path, c.name)
	} else if !isLibvirtCode(err, libvirt.ErrNoDomain) {
		return fmt.Errorf("look up domain %q: %w", c.name, err)
	}
	c.p.log.V(1).Info("create: replacing a leftover overlay backed by another base", "domain", c.name, "volume", name, "backing", backing)
	if err := c.step(); err != nil {
		return err
	}
	if err := l.StorageVolDelete(vol, 0); err != nil && !isLibvirtCode(err, libvirt.ErrNoStorageVol) {
		return raced(fmt.Errorf("delete leftover overlay %q: %w", name, err))
	}
	if err := c.step(); err != nil {
		return err
	}
	if _, err := l.StorageVolCreateXML(pool, ox, 0); err != nil {
		return raced(fmt.Errorf("create overlay %q backed by %q: %w", name, c.base.Volume, err))
	}
	c.set(func(m *made) { m.overlay = true })
	return nil
}

// seedVolume creates the seed volume (or reuses an existing one of the same
// size, recreating one of another size when no domain uses it) and, with
// upload, uploads the seed into it.
func (c *creation) seedVolume(l lvAPI, pool libvirt.StoragePool, upload bool) error {
	name := seedVolume(c.name)
	sv := libvirtxml.StorageVolume{
		Name:     name,
		Capacity: &libvirtxml.StorageVolumeSize{Value: uint64(len(c.seed))},
		Target:   &libvirtxml.StorageVolumeTarget{Format: &libvirtxml.StorageVolumeTargetFormat{Type: "raw"}},
	}
	sx, err := sv.Marshal()
	if err != nil {
		return errs.WithCode(errs.Permanent, fmt.Errorf("marshal seed volume: %w", err))
	}
	if err := c.step(); err != nil {
		return err
	}
	vol, err := l.StorageVolCreateXML(pool, sx, 0)
	switch {
	case err == nil:
		c.set(func(m *made) { m.seed = true })
	case !isLibvirtCode(err, libvirt.ErrStorageVolExist):
		return fmt.Errorf("create seed volume %q: %w", name, err)
	default:
		if vol, err = c.reuseSeed(l, pool, sx); err != nil {
			return err
		}
	}
	if !upload {
		return nil
	}
	err = c.whileBusy(func() error {
		return l.StorageVolUpload(vol, bytes.NewReader(c.seed), 0, uint64(len(c.seed)), 0)
	})
	if err != nil {
		return raced(fmt.Errorf("upload seed %q: %w", name, err))
	}
	return nil
}

// busyWait bounds how long Create waits for a volume another call is still
// writing (libvirt: "still being allocated", "in use", or a volume whose
// file is not there yet) before it gives up with a Transient error.
const (
	busyWait  = 3 * time.Second
	busyPause = 100 * time.Millisecond
)

// whileBusy runs call (one RPC on a volume another Create may be writing)
// until it does not fail with a busy volume's codes, at most busyWait,
// checking step before each try.
func (c *creation) whileBusy(call func() error) error {
	deadline := time.Now().Add(busyWait)
	for {
		if err := c.step(); err != nil {
			return err
		}
		err := call()
		if err == nil || linkDead(err) || !isLibvirtCode(err, libvirt.ErrOperationInvalid, libvirt.ErrNoStorageVol) ||
			time.Now().After(deadline) {
			return err
		}
		t := time.NewTimer(busyPause)
		select {
		case <-c.ctx.Done():
			t.Stop()
			return budget.Err(c.ctx)
		case <-t.C:
		}
	}
}

// reuseSeed returns the existing seed volume if its capacity is the seed's;
// otherwise (left by a Create with other user-data) it deletes and
// recreates it, unless a domain of this name exists by now.
func (c *creation) reuseSeed(l lvAPI, pool libvirt.StoragePool, sx string) (libvirt.StorageVol, error) {
	name := seedVolume(c.name)
	if err := c.step(); err != nil {
		return libvirt.StorageVol{}, err
	}
	vol, err := l.StorageVolLookupByName(pool, name)
	if err != nil {
		return vol, raced(fmt.Errorf("look up existing seed %q: %w", name, err))
	}
	if err := c.step(); err != nil {
		return vol, err
	}
	_, capacity, _, err := l.StorageVolGetInfo(vol)
	if err != nil {
		return vol, raced(fmt.Errorf("read existing seed %q: %w", name, err))
	}
	if capacity == uint64(len(c.seed)) {
		c.p.log.V(1).Info("create: reusing the existing seed volume", "domain", c.name, "volume", name)
		return vol, nil
	}
	if c.adopted {
		// A defined domain uses it: never delete it.
		return vol, errs.Errorf(errs.Transient, "seed %q of the defined domain has %d bytes, the seed %d: not replaced while the domain exists", name, capacity, len(c.seed))
	}
	if err := c.step(); err != nil {
		return vol, err
	}
	if _, err := l.DomainLookupByName(c.name); err == nil {
		return vol, errs.Errorf(errs.Transient, "domain %q was defined by another call meanwhile (a retry converges on it)", c.name)
	} else if !isLibvirtCode(err, libvirt.ErrNoDomain) {
		return vol, fmt.Errorf("look up domain %q: %w", c.name, err)
	}
	c.p.log.V(1).Info("create: replacing a leftover seed of another size", "domain", c.name, "volume", name)
	if err := c.step(); err != nil {
		return vol, err
	}
	if err := l.StorageVolDelete(vol, 0); err != nil && !isLibvirtCode(err, libvirt.ErrNoStorageVol) {
		return vol, raced(fmt.Errorf("delete leftover seed %q: %w", name, err))
	}
	if err := c.step(); err != nil {
		return vol, err
	}
	vol, err = l.StorageVolCreateXML(pool, sx, 0)
	if err != nil {
		return vol, raced(fmt.Errorf("create seed volume %q: %w", name, err))
	}
	c.set(func(m *made) { m.seed = true })
	return vol, nil
}

// findDefined looks for a domain of this name that another call defined:
// false when there is none; an error when it is not this spec's instance.
func (c *creation) findDefined(l lvAPI) (bool, error) {
	if err := c.step(); err != nil {
		return false, err
	}
	dom, err := l.DomainLookupByName(c.name)
	switch {
	case isLibvirtCode(err, libvirt.ErrNoDomain):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("look up domain %q: %w", c.name, err)
	}
	if err := c.step(); err != nil {
		return false, err
	}
	info, err := c.p.readDomain(l, dom, false)
	if err != nil {
		return false, raced(err)
	}
	if err := c.checkOwned(info); err != nil {
		return false, err
	}
	c.p.log.V(1).Info("create: another call defined the domain meanwhile; converging on it", "domain", c.name)
	c.adopt(info)
	return true, nil
}

// start starts the domain if it never ran; "already running" (another call
// started it) is success.
func (c *creation) start(l lvAPI) error {
	c.mu.Lock()
	dom, st, reason := c.dom, c.state, c.reason
	c.mu.Unlock()
	if !neverRan(st, reason) {
		return nil // running, or stopped on purpose: left as it is
	}
	if err := c.step(); err != nil {
		return err
	}
	err := l.DomainCreate(dom)
	if err == nil || linkDead(err) {
		if err != nil {
			return fmt.Errorf("start domain %q: %w", c.name, err)
		}
		return nil
	}
	if serr := c.step(); serr != nil {
		return serr
	}
	if now, _, serr := l.DomainGetState(dom, 0); serr == nil && domainActive(libvirt.DomainState(now)) {
		c.p.log.V(1).Info("create: the domain was started by another call", "domain", c.name)
		return nil
	}
	return raced(fmt.Errorf("start domain %q: %w", c.name, err))
}

// undo removes what a Create that failed for certain made itself, on a
// fresh bounded context when ctx already ended: the domain it defined (by
// UUID), then the volumes it created, never a volume while a domain of that
// name exists. What it cannot remove stays under the instance's names, where
// a retried Create reuses it and Delete removes it.
func (p *provider) undo(ctx context.Context, c *creation) {
	c.mu.Lock()
	m, dom, pool := c.made, c.dom, c.poolH
	c.mu.Unlock()
	if !m.overlay && !m.seed && !m.domain {
		return
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	err := p.do(cctx, "kvm2.Create.undo", func(l lvAPI) error {
		if m.domain {
			if err := p.removeDomain(l, dom, libvirt.DomainNostate); err != nil {
				return err
			}
		}
		var vols []string
		if m.overlay {
			vols = append(vols, overlayVolume(c.name))
		}
		if m.seed {
			vols = append(vols, seedVolume(c.name))
		}
		return p.deleteUnusedVolumes(l, c.name, pool, vols...)
	}, attribute.String("domain", c.name))
	if err != nil {
		p.log.Error(err, "create failed and what it made could not all be removed; a retried Create reuses it, Delete removes it", "domain", c.name)
	}
}
