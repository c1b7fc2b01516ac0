package kvm2

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.opentelemetry.io/otel/codes"
	"libvirt.org/go/libvirtxml"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/basecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/testing/libvirtfake"
)

// fakeDigest is the digest the fake cache records for every base.
const fakeDigest = "e1fdb1fb2b8b0fd7a8e9f41f54858c1c55bbf28060e778f0b74acdf3b8d8c723"

// usersOf names the fake's domains whose XML names the path of base or
// the path or name of a volume backed by it.
func (c *fakeImages) usersOf(base libvirtfake.Volume) []string {
	paths := []string{base.Path}
	for _, n := range c.host.VolumeNames(c.pool) {
		if v, ok := c.host.Volume(c.pool, n); ok && v.BackingPath == base.Path {
			paths = append(paths, v.Path, `volume="`+n+`"`)
		}
	}
	var out []string
	for _, d := range c.host.DomainNames() {
		fd, _ := c.host.Domain(d)
		for _, p := range paths {
			if strings.Contains(fd.XML, p) {
				out = append(out, d)
				break
			}
		}
	}
	return out
}

// unresolvedDisks names the fake's disks whose chain the real cache could
// not follow: a qcow2 file that is no volume of the pool (the fake host's
// only one).
func (c *fakeImages) unresolvedDisks() []string {
	var out []string
	for _, d := range c.host.DomainNames() {
		fd, _ := c.host.Domain(d)
		var dx libvirtxml.Domain
		if dx.Unmarshal(fd.XML) != nil || dx.Devices == nil {
			continue
		}
		for _, disk := range dx.Devices.Disks {
			if disk.Source == nil || disk.Source.File == nil || disk.Driver == nil || disk.Driver.Type != "qcow2" {
				continue
			}
			if !c.isVolume(disk.Source.File.File) {
				out = append(out, "domain "+d+" disk "+disk.Target.Dev+": "+disk.Source.File.File+" is in no active storage pool, so its backing store is unknown")
			}
		}
	}
	return out
}

// isVolume reports whether path is the file of a volume of the pool.
func (c *fakeImages) isVolume(path string) bool {
	for _, n := range c.host.VolumeNames(c.pool) {
		if v, ok := c.host.Volume(c.pool, n); ok && v.Path == path {
			return true
		}
	}
	return false
}

// List lists the entry's base volumes in the fake's pool (each with a
// marker, unless its name is in noMarker), with their users.
func (c *fakeImages) List(ctx context.Context) ([]basecache.Entry, error) {
	c.mu.Lock()
	err := c.err
	c.mu.Unlock()
	if err != nil {
		return nil, err
	}
	var out []basecache.Entry
	for _, n := range c.host.VolumeNames(c.pool) {
		e, _, f, ok := basecache.ParseBaseName(n)
		if !ok || e != c.entry {
			continue
		}
		v, _ := c.host.Volume(c.pool, n)
		out = append(out, basecache.Entry{
			Base:   basecache.Base{Volume: n, Path: v.Path, Digest: fakeDigest, Format: f},
			Marker: basecache.MarkerName(n, fakeDigest), Size: int64(len(v.Data)), UsedBy: c.usersOf(v), Unresolved: c.unresolvedDisks(),
		})
	}
	return out, nil
}

func (c *fakeImages) Verify(ctx context.Context, img imagecache.Image) (basecache.Base, error) {
	c.mu.Lock()
	err := c.err
	c.mu.Unlock()
	if err != nil {
		return basecache.Base{}, err
	}
	name := basecache.BaseName(c.entry, img.Key, "qcow2")
	v, ok := c.host.Volume(c.pool, name)
	if !ok {
		return basecache.Base{}, errs.Errorf(errs.NotFound, "base %s: no published base in pool %s", name, c.pool)
	}
	return basecache.Base{Volume: name, Path: v.Path, Digest: fakeDigest, Format: "qcow2"}, nil
}

func (c *fakeImages) Evict(ctx context.Context, img imagecache.Image) error {
	c.mu.Lock()
	err := c.err
	c.mu.Unlock()
	if err != nil {
		return err
	}
	name := basecache.BaseName(c.entry, img.Key, "qcow2")
	v, ok := c.host.Volume(c.pool, name)
	if !ok {
		return nil
	}
	if users := c.usersOf(v); len(users) > 0 {
		return errs.Errorf(errs.Permanent, "base %s is the backing store of domains %s; delete them before you evict it", name, strings.Join(users, ", "))
	}
	if u := c.unresolvedDisks(); len(u) > 0 {
		return errs.Errorf(errs.Permanent, "refusing to evict base %s: the backing chains of some disks cannot be resolved, so they may use it: %s", name, strings.Join(u, "; "))
	}
	c.host.RemoveVolume(c.pool, name)
	return nil
}

func fakeCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// ListImages lists every configured key, present or not, with the base's
// name, digest and size and the instances using it (by instance name; a
// domain of no instance of this entry as "domain/<name>").
func TestImagesListMapsUsersToInstances(t *testing.T) {
	t.Parallel()
	e := newFakeEnv(t, func(c *Config) {
		c.Images["alpine"] = imagecache.Image{URL: "http://127.0.0.1:1/alpine.qcow2"}
		c.DefaultImage = "tiny"
	})
	ctx := fakeCtx(t)
	l, err := e.p.ListImages(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]egressproxy.ImageInfo{{Key: "alpine"}, {Key: "tiny"}}, l); diff != "" {
		t.Fatalf("ListImages before any Create (-want +got):\n%s", diff)
	}
	for _, n := range []string{"b", "a"} {
		if _, err := e.p.Create(ctx, egressproxy.Spec{Name: n, UID: "u-" + n}); err != nil {
			t.Fatal(err)
		}
	}
	base := basecache.BaseName(e.cfg.Entry, "tiny", "qcow2")
	bv, _ := e.host.Volume(e.cfg.Pool, base)
	// A domain of another tool using the base directly.
	e.defineXML(t, `<domain type="qemu"><name>other-vm</name><devices><disk type="file" device="disk"><source file="`+bv.Path+`"/><target dev="vda"/></disk></devices></domain>`)

	l, err = e.p.ListImages(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := []egressproxy.ImageInfo{
		{Key: "alpine"},
		{Key: "tiny", Name: base, Present: true, Digest: fakeDigest, SizeBytes: int64(len("base")), InUseBy: []string{"a", "b", "domain/other-vm"}},
	}
	if diff := cmp.Diff(want, l); diff != "" {
		t.Fatalf("ListImages (-want +got):\n%s", diff)
	}

	v, err := e.p.VerifyImage(ctx, "tiny")
	want[1].Verified = true
	if err != nil || !cmp.Equal(v, want[1]) {
		t.Fatalf("VerifyImage = %+v, %v; want %+v", v, err, want[1])
	}
	_, err = e.p.VerifyImage(ctx, "alpine")
	if errs.Code(err) != errs.NotFound || !strings.HasPrefix(err.Error(), "kvm2 lab-1: base base-lab-1--alpine.qcow2: ") {
		t.Fatalf("VerifyImage without a base = %v, want NotFound under kvm2 lab-1", err)
	}

	err = e.p.EvictImage(ctx, "tiny")
	if errs.Code(err) != errs.Permanent || !strings.Contains(err.Error(), "ep-lab-1--a, ep-lab-1--b, other-vm") {
		t.Fatalf("EvictImage in use = %v, want Permanent naming the domains", err)
	}
	if _, ok := e.host.Volume(e.cfg.Pool, base); !ok {
		t.Fatal("a refused EvictImage removed the base")
	}
}

// A disk whose chain cannot be followed (an inactive domain's overlay
// outside every pool) might use any stored base: ListImages and
// VerifyImage say its users are unknown, never that it is unused, exactly
// while EvictImage refuses; a key without a base is not InUseUnknown.
func TestImagesUnresolvedDiskIsInUseUnknown(t *testing.T) {
	t.Parallel()
	e := newFakeEnv(t, func(c *Config) {
		c.Images["alpine"] = imagecache.Image{URL: "http://127.0.0.1:1/alpine.qcow2"}
		c.DefaultImage = "tiny"
	})
	ctx := fakeCtx(t)
	if _, err := e.p.Create(ctx, egressproxy.Spec{Name: "a", UID: "u-a", ImageKey: "tiny"}); err != nil {
		t.Fatal(err)
	}
	if err := e.p.Delete(ctx, egressproxy.Ref{Name: "a", UID: "u-a"}); err != nil {
		t.Fatal(err)
	}
	base := basecache.BaseName(e.cfg.Entry, "tiny", "qcow2")
	e.defineXML(t, `<domain type="qemu"><name>elsewhere</name><devices><disk type="file" device="disk"><driver name="qemu" type="qcow2"/><source file="/srv/vms/elsewhere.qcow2"/><target dev="vda"/></disk></devices></domain>`)

	want := []egressproxy.ImageInfo{
		{Key: "alpine"},
		{Key: "tiny", Name: base, Present: true, Digest: fakeDigest, SizeBytes: int64(len("base")), InUseUnknown: true},
	}
	l, err := e.p.ListImages(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(want, l); diff != "" {
		t.Fatalf("ListImages with an unresolved disk (-want +got):\n%s", diff)
	}
	v, err := e.p.VerifyImage(ctx, "tiny")
	want[1].Verified = true
	if err != nil || !cmp.Equal(v, want[1]) {
		t.Fatalf("VerifyImage = %+v, %v; want %+v", v, err, want[1])
	}
	if err := e.p.EvictImage(ctx, "tiny"); errs.Code(err) != errs.Permanent || !strings.Contains(err.Error(), "elsewhere") {
		t.Fatalf("EvictImage while users are unknown = %v, want Permanent naming the disk", err)
	}

	if d, ok := e.host.Domain("elsewhere"); !ok || e.host.Shared().DomainUndefine(d.Handle()) != nil {
		t.Fatal("the domain elsewhere could not be undefined")
	}
	l, err = e.p.ListImages(ctx)
	if err != nil || len(l) != 2 || l[1].InUseUnknown || len(l[1].InUseBy) != 0 {
		t.Fatalf("ListImages once the disk is gone = %+v, %v; want tiny unused", l, err)
	}
	if err := e.p.EvictImage(ctx, "tiny"); err != nil {
		t.Fatalf("EvictImage of an unused base: %v", err)
	}
}

// Unknown and invalid keys are Permanent FieldErrors naming the key, and
// reach nothing; the cache's errors keep their class under "kvm2 <entry>:";
// after Close every call is ErrClosed.
func TestImagesKeysErrorsAndClose(t *testing.T) {
	t.Parallel()
	e := newFakeEnv(t)
	ctx := fakeCtx(t)
	for _, key := range []string{"ubuntu", "Bad_Key", ""} {
		_, verr := e.p.VerifyImage(ctx, key)
		eerr := e.p.EvictImage(ctx, key)
		for _, err := range []error{verr, eerr} {
			var fe *errs.FieldError
			if errs.Code(err) != errs.Permanent || !errors.As(err, &fe) || fe.Field != "ImageKey" || fe.Value != key {
				t.Errorf("key %q: %v, want a Permanent FieldError on ImageKey naming it", key, err)
			}
		}
	}
	if n := e.host.Calls(""); n != 0 {
		t.Errorf("bad keys made %d libvirt calls", n)
	}
	if err := e.p.EvictImage(ctx, "tiny"); err != nil {
		t.Errorf("EvictImage without a base = %v, want nil", err)
	}

	e.images.setErr(errs.Errorf(errs.Transient, "list storage pools: link down"))
	_, lerr := e.p.ListImages(ctx)
	_, verr := e.p.VerifyImage(ctx, "tiny")
	eerr := e.p.EvictImage(ctx, "tiny")
	for _, err := range []error{lerr, verr, eerr} {
		if errs.Code(err) != errs.Transient || err.Error() != "kvm2 lab-1: list storage pools: link down" {
			t.Errorf("cache failure = %q (%v), want Transient under kvm2 lab-1", err, errs.Code(err))
		}
	}
	e.images.setErr(nil)

	e.p.Close()
	_, lerr = e.p.ListImages(ctx)
	_, verr = e.p.VerifyImage(ctx, "tiny")
	eerr = e.p.EvictImage(ctx, "tiny")
	for _, err := range []error{lerr, verr, eerr} {
		if !errors.Is(err, errs.ErrClosed) || errs.Code(err) != errs.Permanent {
			t.Errorf("after Close: %v, want ErrClosed", err)
		}
	}
}

// instanceNames keeps this entry's instances and marks every other domain,
// including another entry's whose name starts like ours.
func TestImagesInstanceNames(t *testing.T) {
	t.Parallel()
	p := &provider{cfg: Config{Entry: "lab"}}
	got := p.instanceNames([]string{"ep-lab--web-1", "ep-lab-2--web-1", "vm", "ep-lab--Bad_Name", "ep-lab--a"})
	want := []string{"a", "domain/ep-lab--Bad_Name", "domain/ep-lab-2--web-1", "domain/vm", "web-1"}
	if !slices.Equal(got, want) {
		t.Errorf("instanceNames = %v, want %v", got, want)
	}
	if p.instanceNames(nil) != nil {
		t.Error("instanceNames(nil) not nil")
	}
}

// Each image operation is one span (entry; for one key the key and its
// base volume) with the imagecache span that talks to libvirt as its child;
// a bad key fails before any child.
func TestImagesSpans(t *testing.T) {
	t.Parallel()
	p, rec := openTraced(t)
	ctx := fakeCtx(t)
	_, lerr := p.ListImages(ctx)
	_, verr := p.VerifyImage(ctx, "tiny")
	eerr := p.EvictImage(ctx, "tiny")
	_, berr := p.VerifyImage(ctx, "nope")
	for _, err := range []error{lerr, verr, eerr, berr} {
		if err == nil {
			t.Fatal("an image call on an unusable host succeeded")
		}
	}
	base := "base-lab-1--tiny.qcow2"
	type want struct{ name, parent, image, volume string }
	var got []want
	classes := map[string]string{}
	for _, s := range recorded(rec) {
		got = append(got, want{s.name, s.parent, s.attrs["egressproxy.image"], s.attrs["egressproxy.volume"]})
		if s.attrs["egressproxy.entry"] != "lab-1" || s.status != codes.Error {
			t.Errorf("span %s: entry %q, status %v; want lab-1, Error", s.name, s.attrs["egressproxy.entry"], s.status)
		}
		classes[s.name+"<"+s.parent] = s.attrs["error.type"]
	}
	wantSpans := []want{
		{"imagecache.List", "kvm2.ListImages", "", ""},
		{"kvm2.ListImages", "", "", ""},
		{"imagecache.Verify", "kvm2.VerifyImage", "", base},
		{"kvm2.VerifyImage", "", "tiny", base},
		{"imagecache.Evict", "kvm2.EvictImage", "", base},
		{"kvm2.EvictImage", "", "tiny", base},
		{"kvm2.VerifyImage", "", "nope", ""},
	}
	if diff := cmp.Diff(wantSpans, got, cmp.AllowUnexported(want{})); diff != "" {
		t.Errorf("spans (-want +got):\n%s", diff)
	}
	if c := classes["kvm2.ListImages<"]; c == "" || c != classes["imagecache.List<kvm2.ListImages"] {
		t.Errorf("kvm2.ListImages has class %s, its imagecache.List child %s", classes["kvm2.ListImages<"], classes["imagecache.List<kvm2.ListImages"])
	}
}
