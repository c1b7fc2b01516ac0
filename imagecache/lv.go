package imagecache

import (
	"context"
	"errors"
	"fmt"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/provider"
	"libvirt.org/go/libvirtxml"
)

// do runs fn on the shared connection.
func (c *Cache) do(ctx context.Context, fn func(*libvirt.Libvirt) error) error {
	return c.conn.Do(ctx, fn)
}

// classify gives an infrastructure error its class: the context's code when
// ctx ended, NotFound for a missing pool, Transient otherwise. Errors that
// already carry a class keep it.
func (c *Cache) classify(ctx context.Context, err error) error {
	if err == nil {
		return nil
	}
	var pe *provider.Error
	if errors.As(err, &pe) {
		return err
	}
	if ctx.Err() != nil {
		return provider.FromContext(fmt.Errorf("%w (%w)", err, ctx.Err()))
	}
	if isLibvirtErr(err, libvirt.ErrNoStoragePool) {
		return provider.WithCode(provider.Permanent, fmt.Errorf("storage pool %s: %w", c.cfg.Pool, err))
	}
	return provider.WithCode(provider.Transient, err)
}

func isLibvirtErr(err error, code libvirt.ErrorNumber) bool {
	var le libvirt.Error
	return errors.As(err, &le) && le.Code == uint32(code)
}

// listNames returns the names of every volume in the pool.
func (c *Cache) listNames(ctx context.Context) ([]string, error) {
	var names []string
	err := c.do(ctx, func(l *libvirt.Libvirt) error {
		p, err := l.StoragePoolLookupByName(c.cfg.Pool)
		if err != nil {
			return err
		}
		vols, _, err := l.StoragePoolListAllVolumes(p, 1, 0)
		if err != nil {
			return err
		}
		names = names[:0]
		for _, v := range vols {
			names = append(names, v.Name)
		}
		return nil
	})
	if err != nil {
		return nil, c.classify(ctx, fmt.Errorf("list volumes of pool %s: %w", c.cfg.Pool, err))
	}
	return names, nil
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
	x, err := volXML(name, 0)
	if err != nil {
		return err
	}
	return c.do(ctx, func(l *libvirt.Libvirt) error {
		p, err := l.StoragePoolLookupByName(c.cfg.Pool)
		if err != nil {
			return err
		}
		_, err = l.StorageVolCreateXML(p, x, 0)
		return err
	})
}

// deleteVolume deletes a volume; a volume already gone is fine.
func (c *Cache) deleteVolume(ctx context.Context, name string) error {
	err := c.do(ctx, func(l *libvirt.Libvirt) error {
		p, err := l.StoragePoolLookupByName(c.cfg.Pool)
		if err != nil {
			return err
		}
		v, err := l.StorageVolLookupByName(p, name)
		if err != nil {
			return err
		}
		return l.StorageVolDelete(v, libvirt.StorageVolDeleteNormal)
	})
	if err == nil || isLibvirtErr(err, libvirt.ErrNoStorageVol) {
		return nil
	}
	return c.classify(ctx, fmt.Errorf("delete volume %s: %w", name, err))
}

// deleteQuiet deletes a volume with a fresh bounded context (ctx may have
// ended) and only logs a failure.
func (c *Cache) deleteQuiet(ctx context.Context, name string) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	if err := c.deleteVolume(cctx, name); err != nil {
		c.log.Error(err, "could not delete volume; it will be found again as debris", "volume", name)
	}
}
