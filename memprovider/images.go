package memprovider

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"slices"
	"strings"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
)

// DefaultImageKey is the image key of a Spec without ImageKey when
// Options.Images is empty.
const DefaultImageKey = "default"

// imageSet is the provider's image catalogue: the configured keys (nil:
// every valid key) and the bases stored so far. bases is guarded by the
// Provider's mutex; keys and open never change.
type imageSet struct {
	keys  []string // sorted, unique; nil when open
	def   string
	open  bool
	bases map[string]*memBase
}

// memBase is one stored base: the bytes a backend would keep, and the
// digest recorded when it was published.
type memBase struct {
	data   []byte
	digest string
}

func newImageSet(keys []string) imageSet {
	s := imageSet{bases: map[string]*memBase{}}
	for _, k := range keys {
		if naming.ValidateKey("Images", k) != nil {
			continue
		}
		if s.def == "" {
			s.def = k
		}
		if !slices.Contains(s.keys, k) {
			s.keys = append(s.keys, k)
		}
	}
	slices.Sort(s.keys)
	if s.def == "" {
		s.open, s.def = true, DefaultImageKey
	}
	return s
}

// resolve returns the key a Spec's ImageKey selects.
func (s *imageSet) resolve(key string) string {
	if key == "" {
		return s.def
	}
	return key
}

func (s *imageSet) configured(key string) bool {
	return s.open || slices.Contains(s.keys, key)
}

// publishLocked stores the base of key, as a backend's first Create of it
// would (a later Create reuses it).
func (s *imageSet) publishLocked(key string) {
	if _, ok := s.bases[key]; ok {
		return
	}
	data := []byte("memprovider base image " + key + "\n")
	sum := sha256.Sum256(data)
	s.bases[key] = &memBase{data: data, digest: hex.EncodeToString(sum[:])}
}

func (s *imageSet) baseName(key string) string { return "base-" + key }

var _ driver.ImageManager = (*provider)(nil)

// checkImageKey validates key and checks that it is configured; both
// failures are Permanent and name the key.
func (p *provider) checkImageKey(key string) error {
	if err := naming.ValidateKey("ImageKey", key); err != nil {
		return errs.WithCode(errs.Permanent, err)
	}
	if !p.images.configured(key) {
		return errs.WithCode(errs.Permanent, &errs.FieldError{Field: "ImageKey", Value: key, Rule: "is not a configured image of this provider"})
	}
	return nil
}

// usersLocked returns the sorted names of the instances that use key's
// base.
func (p *provider) usersLocked(key string) []string {
	var out []string
	for name, it := range p.items {
		if it.image == key {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

// infoLocked describes key's base as ListImages reports it.
func (p *provider) infoLocked(key string) egressproxy.ImageInfo {
	info := egressproxy.ImageInfo{Key: key, InUseBy: p.usersLocked(key)}
	if b, ok := p.images.bases[key]; ok {
		info.Name, info.Present, info.Digest, info.SizeBytes = p.images.baseName(key), true, b.digest, int64(len(b.data))
	}
	return info
}

// ListImages lists the configured image keys (Options.Images), or, when
// every key is offered, the keys a Create has used, sorted. A key's base is
// present from the first Create that used it until EvictImage removes it.
// InUseBy names the instances created from it; they are always known, so
// InUseUnknown is never set.
func (p *provider) ListImages(ctx context.Context) ([]egressproxy.ImageInfo, error) {
	if _, err := p.enter(ctx, OpListImages); err != nil {
		return nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, errClosed()
	}
	keys := slices.Clone(p.images.keys)
	if p.images.open {
		for k := range p.images.bases {
			keys = append(keys, k)
		}
		for _, it := range p.items {
			keys = append(keys, it.image)
		}
		slices.Sort(keys)
		keys = slices.Compact(keys)
	}
	out := make([]egressproxy.ImageInfo, 0, len(keys))
	for _, k := range keys {
		out = append(out, p.infoLocked(k))
	}
	return out, nil
}

// VerifyImage hashes key's stored base again: Verified when it matches the
// digest recorded at publication (always, unless CorruptImage changed the
// bytes: then Permanent, and the base is left as it is). NotFound when no
// Create has stored a base for key yet; Permanent for an invalid or
// unconfigured key.
func (p *provider) VerifyImage(ctx context.Context, key string) (egressproxy.ImageInfo, error) {
	if _, err := p.enter(ctx, OpVerifyImage); err != nil {
		return egressproxy.ImageInfo{}, err
	}
	if err := p.checkImageKey(key); err != nil {
		return egressproxy.ImageInfo{}, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return egressproxy.ImageInfo{}, errClosed()
	}
	b, ok := p.images.bases[key]
	if !ok {
		return egressproxy.ImageInfo{}, errs.Errorf(errs.NotFound, "memprovider: image %s has no base yet (the first Create that uses it stores one)", errs.Quote(key))
	}
	sum := sha256.Sum256(b.data)
	if got := hex.EncodeToString(sum[:]); got != b.digest {
		return egressproxy.ImageInfo{}, errs.Errorf(errs.Permanent,
			"memprovider: base %s stores %d bytes with sha256 %s but was published with sha256 %s; it is left untouched because instances may use it: delete the proxies using it, then evict the base with EvictImage (egressproxyctl images evict)",
			p.images.baseName(key), len(b.data), got, b.digest)
	}
	info := p.infoLocked(key)
	info.Verified = true
	return info, nil
}

// EvictImage removes key's base, so the next Create of it stores a new one.
// While any instance uses it, EvictImage refuses (Permanent, naming the
// instances). A key without a base is not an error; an invalid or
// unconfigured key is Permanent.
func (p *provider) EvictImage(ctx context.Context, key string) error {
	if _, err := p.enter(ctx, OpEvictImage); err != nil {
		return err
	}
	if err := p.checkImageKey(key); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return errClosed()
	}
	if users := p.usersLocked(key); len(users) > 0 {
		return errs.Errorf(errs.Permanent, "memprovider: base %s of image %s is in use by instances %s; delete them before you evict it",
			p.images.baseName(key), errs.Quote(key), strings.Join(users, ", "))
	}
	delete(p.images.bases, key)
	return nil
}

// CorruptImage changes the stored bytes of key's base (not its recorded
// digest), so VerifyImage reports the mismatch: a test hook for an
// embedder's handling of a damaged base. It returns NotFound when key has
// no base.
func (c *Control) CorruptImage(key string) error {
	p := c.p
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return errClosed()
	}
	b, ok := p.images.bases[key]
	if !ok {
		return errs.Errorf(errs.NotFound, "memprovider: image %s has no base", errs.Quote(key))
	}
	b.data = append(slices.Clone(b.data), "corrupted"...)
	return nil
}
