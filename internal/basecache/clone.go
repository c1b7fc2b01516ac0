package basecache

import (
	"context"
	"fmt"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
)

// cloneLocal copies pb's base, a base of the image's digest on c's own
// host (another entry's, in c's pool or another pool of its libvirtd),
// into the volume name inside the host: StorageVolCreateXMLFrom on a
// dedicated connection, so that no byte of the image crosses the network.
// The copy is then checked as a transfer is — its physical size, and the
// size and sha256 of what it reads back, against pb's size and the
// configured digest — and published with its marker. The caller holds the
// only claim. On any failure nothing is published and the volume is
// deleted.
//
// Only a raw image is copied this way: libvirt copies a volume it sees as
// qcow2 (it probes a dir pool's files) through qemu-img convert, whose
// bytes differ from the image's, so their digest could never match.
func (c *Cache) cloneLocal(ctx context.Context, img imagecache.Image, name string, pb *peerBase) (_ Base, err error) {
	if arrived, ok := ctx.Value(arrivalKey{}).(func()); ok {
		arrived() // no shared download to wait for this fetch
	}
	log := c.log.WithValues("volume", name, "peer", pb.c.cfg.Entry)
	x, err := volXML(name, 0)
	if err != nil {
		return Base{}, errs.WithCode(errs.Permanent, err)
	}
	start := time.Now()
	log.Info("copying the base inside the host", "from", pb.volume, "bytes", pb.size)
	vol, err := c.createFrom(ctx, x, libvirt.StorageVol{Pool: pb.pool.Name, Name: pb.volume})
	if err != nil {
		c.deleteQuiet(ctx, name) // libvirt may have finished it after the link was killed
		return Base{}, c.classify(ctx, fmt.Errorf("copy %s from %s inside the host: %w", name, pb.volume, err))
	}
	c.meters.transferred(srcPeer, pb.size)
	st := &stage{c: c, name: name, vol: vol, log: log, start: start}
	defer func() { st.close(ctx, err) }()
	st.physical = c.physicalAhead(ctx, vol)
	st.uploaded = time.Since(start)
	n, digest, err := c.readBack(ctx, name)
	if err != nil {
		return Base{}, err
	}
	if n != pb.size || digest != img.SHA256 {
		c.meters.verifyFailed(checkStored, "")
		return Base{}, errs.Errorf(errs.Transient, "verify %s: the copy of %s inside the host reads back as %d bytes with sha256 %s, not the %d bytes with sha256 %s of image %q", name, pb.volume, n, digest, pb.size, img.SHA256, img.Key)
	}
	st.back = readResult{n: n, digest: digest}
	pathOf, err := st.commit(ctx, n, digest)
	if err != nil {
		return Base{}, err
	}
	el := time.Since(start)
	// from: the copy was made inside the host, from that volume; verify:
	// the read-back after it.
	log.Info("published base", "source", imagecache.SourcePeer, "from", pb.volume, "bytes", n, "sha256", digest, "elapsed", el, "bytesPerSecond", int64(float64(n)/el.Seconds()),
		"verify", el-st.uploaded)
	path, err := pathOf()
	if err != nil {
		return Base{}, c.classify(ctx, fmt.Errorf("look up base %s: %w", name, err))
	}
	return Base{Volume: name, Path: path, Digest: digest, Format: formatOf(img), Source: imagecache.SourcePeer}, nil
}

// createFrom creates the volume of XML x in c's pool as a copy of src (a
// volume of c's libvirtd) on a dedicated connection: a copy takes as long
// as the host's disk needs, and ctx ending kills the connection.
func (c *Cache) createFrom(ctx context.Context, x string, src libvirt.StorageVol) (libvirt.StorageVol, error) {
	dc, err := c.conn.Dedicated(ctx)
	if err != nil {
		return libvirt.StorageVol{}, fmt.Errorf("dedicated connection: %w", err)
	}
	defer dc.Close()
	var vol libvirt.StorageVol
	err = c.runStream(ctx, dc, "copy inside the host", nil, func() error {
		return c.withPool(dc.Libvirt(), func(l Libvirt, p libvirt.StoragePool) error {
			v, err := l.StorageVolCreateXMLFrom(p, x, src, 0)
			vol = v
			return err
		})
	})
	return vol, err
}
