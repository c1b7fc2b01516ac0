package kvm2

import (
	"context"
	"slices"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/basecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
	"github.com/egressproxy/egressproxy/internal/obs"
)

// The driver.ImageManager of kvm2: the entry's configured images
// (Config.Images) and their bases in the pool, through the entry's
// basecache.Cache (List, Verify, Evict).

var _ driver.ImageManager = (*provider)(nil)

// foreignDomainPrefix starts the InUseBy entry of a domain that is not an
// instance of this entry ("domain/<libvirt name>"; '/' is in no instance
// name, so the two never collide).
const foreignDomainPrefix = "domain/"

// keyImage is the span attribute of the image key (as the Client's).
const keyImage = attribute.Key("egressproxy.image")

// image returns the configured image of key, or a Permanent
// *errs.FieldError naming the key: invalid, or not configured.
func (p *provider) image(key string) (imagecache.Image, error) {
	if err := naming.ValidateKey("ImageKey", key); err != nil {
		return imagecache.Image{}, errs.WithCode(errs.Permanent, err)
	}
	img, ok := p.cfg.Images[key]
	if !ok {
		return imagecache.Image{}, errs.WithCode(errs.Permanent, fieldErr("ImageKey", key, "is not a configured image of this provider entry"))
	}
	return img, nil
}

// baseName is the volume name of img's base in this entry.
func (p *provider) baseName(img imagecache.Image) string {
	format := img.Format
	if format == "" {
		format = imagecache.FormatQCOW2
	}
	return basecache.BaseName(p.cfg.Entry, img.Key, format)
}

// startImage starts the span of an image operation: the entry and, for one
// key, the key and its base volume.
func (p *provider) startImage(ctx context.Context, name, key, volume string) (context.Context, func(error)) {
	var extra []attribute.KeyValue
	if key != "" {
		extra = append(extra, keyImage.String(key))
	}
	ctx, span := obs.Start(ctx, p.tracer, name, obs.Attrs{Entry: p.cfg.Entry, Volume: volume}, extra...)
	return ctx, func(err error) { obs.End(span, err) }
}

// instanceNames maps the domains using a base to instance names: a domain
// of this entry ("ep-<entry>--<name>") is its instance name, any other
// domain "domain/<its name>". Sorted.
func (p *provider) instanceNames(domains []string) []string {
	if len(domains) == 0 {
		return nil
	}
	prefix := domainPrefix + p.cfg.Entry + "--"
	out := make([]string, 0, len(domains))
	for _, d := range domains {
		if name, ok := strings.CutPrefix(d, prefix); ok && naming.ValidateName("Name", name) == nil {
			out = append(out, name)
		} else {
			out = append(out, foreignDomainPrefix+d)
		}
	}
	slices.Sort(out)
	return out
}

// info describes key's base as found in the pool (e: the cache's entry of
// its volume; found false when the pool has none). A base without a valid
// digest marker is not Present (it is debris or still being fetched), but
// its users are listed. A disk on the host whose chain cannot be followed
// might use it: its users are then unknown, as EvictImage's refusal says.
func (p *provider) info(key string, e basecache.Entry, found bool) egressproxy.ImageInfo {
	info := egressproxy.ImageInfo{Key: key}
	if !found {
		return info
	}
	info.InUseBy = p.instanceNames(e.UsedBy)
	info.InUseUnknown = len(e.Unresolved) > 0
	if e.Marker != "" {
		info.Name, info.Present, info.Digest, info.SizeBytes = e.Volume, true, e.Digest, e.Size
	}
	return info
}

// listed lists the pool's bases of this entry by volume name.
func (p *provider) listed(ctx context.Context) (map[string]basecache.Entry, error) {
	entries, err := p.cache.List(ctx)
	if err != nil {
		return nil, p.wrap(err)
	}
	m := make(map[string]basecache.Entry, len(entries))
	for _, e := range entries {
		m[e.Volume] = e
	}
	return m, nil
}

// ListImages returns one ImageInfo per configured image key (Config.Images),
// sorted by key, whether its base is in the pool or not: the base volume's
// name, the digest its marker records, its stored size, and the instances
// whose disks use it (a domain that is not an instance of this entry
// appears as "domain/<libvirt name>"). When a disk on the host cannot be
// followed to its end (an inactive domain's overlay outside every active
// pool, a disk in an inactive pool), every stored base is InUseUnknown:
// that disk might use it. Bases of keys no longer configured are not
// listed. One imagecache.List (span imagecache.List under
// kvm2.ListImages): every pool's volumes and every domain's disks are read
// to find the users.
func (p *provider) ListImages(ctx context.Context) (_ []egressproxy.ImageInfo, opErr error) {
	ctx, end := p.startImage(ctx, "kvm2.ListImages", "", "")
	defer func() { end(opErr) }()
	if err := p.checkOpen(); err != nil {
		return nil, err
	}
	start := time.Now()
	byVol, err := p.listed(ctx)
	if err != nil {
		return nil, err
	}
	keys := sortedKeys(p.cfg.Images)
	out := make([]egressproxy.ImageInfo, 0, len(keys))
	present := 0
	for _, key := range keys {
		e, found := byVol[p.baseName(p.cfg.Images[key])]
		info := p.info(key, e, found)
		if info.Present {
			present++
		}
		out = append(out, info)
	}
	p.log.V(1).Info("listed images", "images", len(out), "present", present, "elapsed", time.Since(start))
	return out, nil
}

// VerifyImage reads key's base back from the host through libvirt, hashes
// it and compares it with the digest its marker records
// (the image cache's Verify), then lists it for its size and users.
// Errors: Permanent for an invalid or unconfigured key (a
// *errs.FieldError naming it) and for stored bytes or a marker that
// differ (nothing is deleted); NotFound when the key has no published base;
// Transient for the link and libvirt; the context's codes.
func (p *provider) VerifyImage(ctx context.Context, key string) (_ egressproxy.ImageInfo, opErr error) {
	img, ierr := p.image(key)
	vol := ""
	if ierr == nil {
		vol = p.baseName(img)
	}
	ctx, end := p.startImage(ctx, "kvm2.VerifyImage", key, vol)
	defer func() { end(opErr) }()
	if err := p.checkOpen(); err != nil {
		return egressproxy.ImageInfo{}, err
	}
	if ierr != nil {
		return egressproxy.ImageInfo{}, ierr
	}
	start := time.Now()
	b, err := p.cache.Verify(ctx, img)
	if err != nil {
		return egressproxy.ImageInfo{}, p.wrap(err)
	}
	byVol, err := p.listed(ctx)
	if err != nil {
		return egressproxy.ImageInfo{}, err
	}
	e, found := byVol[vol]
	info := p.info(key, e, found)
	if !info.Present {
		return egressproxy.ImageInfo{}, errs.Errorf(errs.NotFound, "kvm2 %s: base %s was evicted while it was verified", p.cfg.Entry, vol)
	}
	info.Digest, info.Verified = b.Digest, true
	p.log.V(1).Info("verified image", "image", key, "volume", vol, "sha256", b.Digest, "bytes", info.SizeBytes, "elapsed", time.Since(start))
	return info, nil
}

// EvictImage deletes key's base and its digest marker from the pool
// (the image cache's Evict, under the base's claim), so the next Create of
// the key fetches it again. It refuses, Permanent, naming the domains,
// while any defined domain (running or not, of any entry) uses the base,
// or while a disk on the host cannot be resolved (it might use it). A key
// without a base is not an error. Errors: Permanent (an invalid or
// unconfigured key, a *errs.FieldError naming it; in use), Transient,
// the context's codes.
func (p *provider) EvictImage(ctx context.Context, key string) (opErr error) {
	img, ierr := p.image(key)
	vol := ""
	if ierr == nil {
		vol = p.baseName(img)
	}
	ctx, end := p.startImage(ctx, "kvm2.EvictImage", key, vol)
	defer func() { end(opErr) }()
	if err := p.checkOpen(); err != nil {
		return err
	}
	if ierr != nil {
		return ierr
	}
	start := time.Now()
	if err := p.cache.Evict(ctx, img); err != nil {
		return p.wrap(err) // imagecache names the base, which carries the key
	}
	p.log.V(1).Info("evicted image", "image", key, "volume", vol, "elapsed", time.Since(start))
	return nil
}
