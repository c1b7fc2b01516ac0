package basecache

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/libvirterr"
	"github.com/egressproxy/egressproxy/sshconn"
	"libvirt.org/go/libvirtxml"
)

// do runs fn on the shared connection.
func (c *Cache) do(ctx context.Context, fn func(Libvirt) error) error {
	return c.conn.Do(ctx, fn)
}

// doPool runs fn on the shared connection with the cache's pool.
func (c *Cache) doPool(ctx context.Context, fn func(Libvirt, libvirt.StoragePool) error) error {
	return c.do(ctx, func(l Libvirt) error { return c.withPool(l, fn) })
}

// doVol runs fn on the shared connection with volume name of the pool.
func (c *Cache) doVol(ctx context.Context, name string, fn func(Libvirt, libvirt.StorageVol) error) error {
	return c.do(ctx, func(l Libvirt) error {
		v, err := c.lookupVol(l, name)
		if err != nil {
			return err
		}
		return fn(l, v)
	})
}

// withPool runs fn on l with the pool's handle: the one remembered from an
// earlier lookup, else a fresh lookup (then remembered). libvirt finds a
// pool by its handle's UUID, so a pool that was undefined and defined
// again under the same name answers a remembered handle "no storage pool
// with matching uuid": then, and only then, the handle is forgotten and fn
// runs once more with a fresh lookup (fn did nothing: libvirt refused the
// handle before acting). A pool that is really gone fails that lookup.
func (c *Cache) withPool(l Libvirt, fn func(Libvirt, libvirt.StoragePool) error) error {
	c.poolMu.Lock()
	p, remembered := c.pool, c.poolSet
	c.poolMu.Unlock()
	if remembered {
		err := fn(l, p)
		if !isLibvirtErr(err, libvirt.ErrNoStoragePool) {
			return err
		}
		c.poolMu.Lock()
		if c.pool == p {
			c.poolSet = false
		}
		c.poolMu.Unlock()
	}
	p, err := l.StoragePoolLookupByName(c.cfg.Pool)
	if err != nil {
		return err
	}
	c.poolMu.Lock()
	c.pool, c.poolSet = p, true
	c.poolMu.Unlock()
	return fn(l, p)
}

// UsePool gives the cache a handle of its pool that the caller looked up
// on the same libvirtd (kvm2 looks the entry's pool up together with the
// domain, in one round trip), so that the cache's first call does not
// look it up again. A handle of another pool is ignored, and a handle the
// cache remembers already is kept. A handle that has gone stale meanwhile
// costs what a remembered one does: libvirt refuses it and the pool is
// looked up (withPool).
func (c *Cache) UsePool(p libvirt.StoragePool) {
	if p.Name != c.cfg.Pool {
		return
	}
	c.poolMu.Lock()
	defer c.poolMu.Unlock()
	if !c.poolSet {
		c.pool, c.poolSet = p, true
	}
}

// lookupVol looks up volume name of the pool on l (withPool's handle).
func (c *Cache) lookupVol(l Libvirt, name string) (libvirt.StorageVol, error) {
	var v libvirt.StorageVol
	err := c.withPool(l, func(l Libvirt, p libvirt.StoragePool) error {
		var err error
		v, err = l.StorageVolLookupByName(p, name)
		return err
	})
	return v, err
}

// classify gives an infrastructure error its class from the table kvm2
// shares (internal/libvirterr): the context's code when ctx ended; an
// explicit class kept; Permanent for a missing pool or a pool that is not
// active (a human must define or start it; the message says so), for
// credentials and host keys the link refuses and for requests libvirt
// refuses as made; Transient for a lost session and libvirt's own
// failures. A libvirt object missing underneath the cache (a volume deleted
// meanwhile) is Transient, not NotFound: the cache's calls are about an
// image, which a retry fetches again.
func (c *Cache) classify(ctx context.Context, err error) error {
	if err == nil {
		return nil
	}
	if libvirterr.Classed(err) {
		return err
	}
	if ctx.Err() != nil {
		return errs.FromContext(fmt.Errorf("%w (%w)", err, ctx.Err()))
	}
	v := libvirterr.Of(err)
	switch {
	case v.Missing:
		return errs.WithCode(errs.Transient, err)
	case v.Reason == egressproxy.ReasonPoolNotFound:
		return errs.WithCode(errs.Permanent, fmt.Errorf("storage pool %s: %w", c.cfg.Pool, err))
	case v.Reason == egressproxy.ReasonPoolNotActive:
		return errs.WithCode(errs.Permanent, fmt.Errorf("storage pool %s is not active; start it (and mark it autostart) and retry: %w", c.cfg.Pool, err))
	}
	return libvirterr.Classify(err)
}

func isLibvirtErr(err error, code libvirt.ErrorNumber) bool { return libvirterr.Is(err, code) }

// listNames returns the names of every volume in the pool.
func (c *Cache) listNames(ctx context.Context) ([]string, error) {
	vols, err := c.listVols(ctx)
	if err != nil {
		return nil, err
	}
	return volNames(vols), nil
}

// listVols returns every volume of the pool (one listing call after the
// pool's lookup). With metrics, what it found is the entry's inventory of
// published bases.
func (c *Cache) listVols(ctx context.Context) ([]libvirt.StorageVol, error) {
	var vols []libvirt.StorageVol
	found := c.meters.listing()
	err := c.doPool(ctx, func(l Libvirt, p libvirt.StoragePool) error {
		var err error
		vols, _, err = l.StoragePoolListAllVolumes(p, 1, 0)
		return err
	})
	if err != nil {
		return nil, c.classify(ctx, fmt.Errorf("list volumes of pool %s: %w", c.cfg.Pool, err))
	}
	found(vols)
	return vols, nil
}

func volNames(vols []libvirt.StorageVol) []string {
	names := make([]string, 0, len(vols))
	for _, v := range vols {
		names = append(names, v.Name)
	}
	return names
}

// volXML is the XML of a new raw file volume of capacity bytes (0: grows
// as written), never preallocated, mode 0644 (a base is read by the qemu
// processes of every domain backed by it; images are not secrets).
func volXML(name string, capacity int64) (string, error) {
	v := libvirtxml.StorageVolume{
		Name:       name,
		Capacity:   &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: uint64(max(capacity, 0))},
		Allocation: &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: 0},
		Target: &libvirtxml.StorageVolumeTarget{
			Format:      &libvirtxml.StorageVolumeTargetFormat{Type: "raw"},
			Permissions: &libvirtxml.StorageVolumeTargetPermissions{Mode: "0644"},
		},
	}
	return v.Marshal()
}

// createEmpty creates a 0-byte volume; it fails if the name exists
// (libvirt's create is atomic on the name).
func (c *Cache) createEmpty(ctx context.Context, name string) error {
	_, err := c.createEmptyVol(ctx, name)
	return err
}

// createEmptyVol is createEmpty returning the new volume's handle (see
// doHandle).
func (c *Cache) createEmptyVol(ctx context.Context, name string) (libvirt.StorageVol, error) {
	x, err := volXML(name, 0)
	if err != nil {
		return libvirt.StorageVol{}, err
	}
	return c.createVol(ctx, x)
}

// createVol creates a volume of the pool from its XML and returns the
// handle libvirt answered with.
func (c *Cache) createVol(ctx context.Context, x string) (libvirt.StorageVol, error) {
	var v libvirt.StorageVol
	err := c.doPool(ctx, func(l Libvirt, p libvirt.StoragePool) error {
		var err error
		v, err = l.StorageVolCreateXML(p, x, 0)
		return err
	})
	if err != nil {
		return libvirt.StorageVol{}, err // fn may still be running: never read what it writes
	}
	return v, nil
}

// doHandle runs fn on the shared connection with volume name: vol when it
// is a handle libvirt gave (a create's answer, a listing's entry), else
// looked up first. A handle is good on any connection, without a lookup:
// libvirtd resolves a volume handle by its pool's name and its own name
// (not by connection, nor by key), so it names the volume that has that
// name in that pool when the call runs, as a lookup followed by the call
// would. Each known handle spares a lookup's round trip.
func (c *Cache) doHandle(ctx context.Context, name string, vol *libvirt.StorageVol, fn func(Libvirt, libvirt.StorageVol) error) error {
	if vol == nil || vol.Name != name {
		return c.doVol(ctx, name, fn)
	}
	v := *vol
	return c.do(ctx, func(l Libvirt) error { return fn(l, v) })
}

// deleteVolume deletes a volume; a volume already gone is fine.
func (c *Cache) deleteVolume(ctx context.Context, name string) error {
	return c.deleteHandle(ctx, name, nil)
}

// deleteHandle is deleteVolume with the volume's handle when known (nil:
// looked up; see doHandle).
func (c *Cache) deleteHandle(ctx context.Context, name string, vol *libvirt.StorageVol) error {
	err := c.doHandle(ctx, name, vol, func(l Libvirt, v libvirt.StorageVol) error {
		return l.StorageVolDelete(v, libvirt.StorageVolDeleteNormal)
	})
	if err == nil || isLibvirtErr(err, libvirt.ErrNoStorageVol) {
		return nil
	}
	return c.classify(ctx, fmt.Errorf("delete volume %s: %w", name, err))
}

// cleanupRetryFor bounds how long deleteQuiet retries (a libvirtd restart
// takes well under a second); a claim still left after that is found by
// this cache as its own orphan, or by others as stale after ClaimTimeout.
const cleanupRetryFor = 5 * time.Second

// deleteQuiet deletes a volume with a fresh bounded context (ctx may have
// ended), retrying a failure to reach libvirtd with backoff for
// cleanupRetryFor (each retry runs on a fresh session when the last one
// died, e.g. libvirtd restarted or briefly gone), and only logs a failure.
func (c *Cache) deleteQuiet(ctx context.Context, name string) {
	c.deleteQuietHandle(ctx, name, nil)
}

// deleteQuietHandle is deleteQuiet with the volume's handle when known
// (nil: looked up; see doHandle).
func (c *Cache) deleteQuietHandle(ctx context.Context, name string, vol *libvirt.StorageVol) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	wait := 250 * time.Millisecond
	until := time.Now().Add(cleanupRetryFor)
	for {
		err := c.deleteHandle(cctx, name, vol)
		if err == nil {
			return
		}
		// Only a failure of the way to libvirtd (session lost, libvirtd
		// briefly gone) is worth a retry; an answer from libvirtd (no such
		// pool, pool stopped) will not change in seconds.
		var transport *sshconn.Error
		if !errors.As(err, &transport) || time.Now().Add(wait).After(until) || sleep(cctx, wait) != nil {
			c.log.Error(err, "could not delete volume; it will be found again as debris", "volume", name)
			return
		}
		c.log.V(1).Info("deleting a volume failed; retrying", "volume", name, "err", err.Error())
		wait = min(2*wait, 4*time.Second)
	}
}
