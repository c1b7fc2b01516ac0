package basecache

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
)

// maxChain bounds backing-chain walks (a loop in broken metadata must not
// hang us).
const maxChain = 32

// Evict removes img's base and its markers, unless a defined domain
// (running or not) uses the base as a backing store: then it returns a
// Permanent error naming the domains and touches nothing. Evicting a base
// that does not exist is not an error.
func (c *Cache) Evict(ctx context.Context, img imagecache.Image) (opErr error) {
	ctx, span := c.start(ctx, "imagecache.Evict", "")
	defer func() { endOp(span, opErr, img.URL) }()
	if err := c.checkOpen(); err != nil {
		return err
	}
	if err := validKey(img.Key); err != nil {
		return errs.WithCode(errs.Permanent, err)
	}
	if !validFormat(formatOf(img)) {
		return errs.Errorf(errs.Permanent, "invalid Format %q", img.Format)
	}
	name := c.BaseName(img)
	setVolume(span, name)
	for {
		_, retry, err := c.underClaim(ctx, name, func(ctx context.Context, _ decision) (Base, error) {
			names, err := c.listNames(ctx)
			if err != nil {
				return Base{}, err
			}
			u, err := c.usersOf(ctx, []string{name})
			if err != nil {
				return Base{}, err
			}
			if err := u.refuseIfUsed(name, "evict"); err != nil {
				return Base{}, err
			}
			// Markers first: a base without a marker is never used.
			for _, n := range names {
				if isMarkerOf(name, n) {
					if err := c.deleteVolume(ctx, n); err != nil {
						return Base{}, err
					}
				}
			}
			if !slices.Contains(names, name) {
				c.meters.evicted(name, false)
				return Base{}, nil
			}
			c.log.Info("evicting base", "volume", name)
			err = c.deleteVolume(ctx, name)
			c.meters.evicted(name, err == nil)
			return Base{}, err
		})
		if !retry {
			return err
		}
	}
}

// Verify re-hashes img's published base as stored on the host. It returns
// the Base when the stored bytes match the marker; NotFound when there is
// no usable base; Permanent for a marker that differs from the configured
// digest or stored bytes that differ from the marker (nothing is deleted:
// running VMs may use the base).
func (c *Cache) Verify(ctx context.Context, img imagecache.Image) (_ Base, opErr error) {
	ctx, span := c.start(ctx, "imagecache.Verify", "")
	defer func() { endOp(span, opErr, img.URL) }()
	if err := c.checkOpen(); err != nil {
		return Base{}, err
	}
	if err := img.Validate(); err != nil {
		return Base{}, err
	}
	name := c.BaseName(img)
	setVolume(span, name)
	names, err := c.listNames(ctx)
	if err != nil {
		return Base{}, err
	}
	d := decide(snapshot{Names: names, Base: name, Want: img.SHA256, Now: time.Now(), StaleAfter: c.staleAfter()})
	switch d.Action {
	case actHit:
	case actMismatch, actAmbiguous:
		return Base{}, c.conflict(img, name, d)
	default:
		return Base{}, errs.Errorf(errs.NotFound, "base %s: no published base in pool %s (%s)", name, c.cfg.Pool, d.Reason)
	}
	n, digest, err := c.readBack(ctx, name)
	if errors.Is(err, errStalled) && ctx.Err() == nil {
		n, digest, err = c.readBack(ctx, name) // once more on a fresh connection
	}
	if err != nil {
		return Base{}, err
	}
	c.meters.sized(name, n)
	if digest != d.Digest {
		c.meters.verifyFailed(checkMarker, "")
		return Base{}, errs.Errorf(errs.Permanent, "base %s: the host stores %d bytes with sha256 %s but its marker says %s; it is left untouched because running VMs may use it: delete the proxies using it, then "+evictHint, name, n, digest, d.Digest)
	}
	return c.published(ctx, img, name, digest, nil)
}

// List returns this entry's bases in the pool, sorted by volume name, with
// their digests, stored sizes, the domains that use them and the disks
// that might (Entry.Unresolved).
func (c *Cache) List(ctx context.Context) (_ []Entry, opErr error) {
	ctx, span := c.start(ctx, "imagecache.List", "")
	defer func() { endOp(span, opErr, "") }()
	if err := c.checkOpen(); err != nil {
		return nil, err
	}
	names, err := c.listNames(ctx)
	if err != nil {
		return nil, err
	}
	var bases []string
	for _, n := range names {
		if e, _, _, ok := ParseBaseName(n); ok && e == c.cfg.Entry {
			bases = append(bases, n)
		}
	}
	slices.Sort(bases)
	if len(bases) == 0 {
		return nil, nil
	}
	u, err := c.usersOf(ctx, bases)
	if err != nil {
		return nil, err
	}
	paths, sizes, err := c.paths(ctx, bases)
	if err != nil {
		return nil, err
	}
	out := make([]Entry, 0, len(bases))
	for _, b := range bases {
		_, _, f, _ := ParseBaseName(b)
		e := Entry{Base: Base{Volume: b, Path: paths[b], Format: f}, Size: sizes[b], UsedBy: u.users[b], Unresolved: slices.Clone(u.unresolved)}
		var valid []string
		for _, n := range names {
			if isMarkerOf(b, n) {
				if _, _, ok := markerOf(b, n); ok {
					valid = append(valid, n)
				}
			}
		}
		if len(valid) == 1 {
			e.Marker = valid[0]
			e.Digest, _, _ = markerOf(b, valid[0])
			if _, ok := sizes[b]; ok {
				c.meters.sized(b, e.Size)
			}
		}
		out = append(out, e)
	}
	return out, nil
}

// paths returns the host path and the physical size of each volume that
// still exists.
func (c *Cache) paths(ctx context.Context, vols []string) (map[string]string, map[string]int64, error) {
	out, sizes := map[string]string{}, map[string]int64{}
	err := c.doPool(ctx, func(l Libvirt, p libvirt.StoragePool) error {
		for _, n := range vols {
			v, err := l.StorageVolLookupByName(p, n)
			if err != nil {
				continue // deleted meanwhile
			}
			if out[n], err = l.StorageVolGetPath(v); err != nil {
				return err
			}
			_, _, phys, err := l.StorageVolGetInfoFlags(v, uint32(libvirt.StorageVolGetPhysical))
			if err != nil {
				return err
			}
			sizes[n] = int64(min(phys, math.MaxInt64))
		}
		return nil
	})
	if err != nil {
		return nil, nil, c.classify(ctx, fmt.Errorf("volume paths in pool %s: %w", c.cfg.Pool, err))
	}
	return out, sizes, nil
}
