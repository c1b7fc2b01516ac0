package drivertest

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/internal/naming"
)

// The image subtests run for every provider that implements
// driver.ImageManager, through the portable Client (and directly where
// the provider's own error text is in question); they skip, saying so, for
// a provider that does not.

// imageManager returns the provider's ImageManager or skips the subtest.
func (e *env) imageManager() driver.ImageManager {
	e.t.Helper()
	m, ok := e.p.(driver.ImageManager)
	if !ok {
		e.t.Skipf("the provider (%T) does not implement driver.ImageManager: image management is not checked", e.p)
	}
	return m
}

// listImages lists through the client and checks the shape of the result.
func (e *env) listImages() []egressproxy.ImageInfo {
	e.t.Helper()
	l, err := e.c.ListImages(e.ctx)
	if err != nil {
		e.fatalf("ListImages: %v", err)
	}
	for _, p := range imageListProblems(l) {
		e.t.Errorf("ListImages: %s (list %+v)", p, l)
	}
	return l
}

// imageListProblems lists contract violations of one ListImages result.
func imageListProblems(l []egressproxy.ImageInfo) []string {
	var out []string
	for i, info := range l {
		if err := naming.ValidateKey("Key", info.Key); err != nil {
			out = append(out, fmt.Sprintf("entry %d: %v", i, err))
		}
		if i > 0 && l[i-1].Key >= info.Key {
			out = append(out, fmt.Sprintf("keys not sorted and unique: %q before %q", l[i-1].Key, info.Key))
		}
		out = append(out, imageInfoProblems(info)...)
		if info.Verified {
			out = append(out, fmt.Sprintf("image %s: Verified in a list (only VerifyImage verifies)", info.Key))
		}
	}
	return out
}

// imageInfoProblems lists contract violations of one ImageInfo.
func imageInfoProblems(info egressproxy.ImageInfo) []string {
	var out []string
	if info.Present {
		if !isSHA256Hex(info.Digest) {
			out = append(out, fmt.Sprintf("image %s: present with Digest %q, want 64 lowercase hex digits", info.Key, info.Digest))
		}
		if info.Name == "" {
			out = append(out, fmt.Sprintf("image %s: present without a Name", info.Key))
		}
		if info.SizeBytes <= 0 {
			out = append(out, fmt.Sprintf("image %s: present with SizeBytes %d", info.Key, info.SizeBytes))
		}
	} else if info.Name != "" || info.Digest != "" || info.SizeBytes != 0 || info.Verified {
		out = append(out, fmt.Sprintf("image %s: not present but Name %q, Digest %q, SizeBytes %d, Verified %v", info.Key, info.Name, info.Digest, info.SizeBytes, info.Verified))
	}
	if !slices.IsSorted(info.InUseBy) || len(slices.Compact(slices.Clone(info.InUseBy))) != len(info.InUseBy) {
		out = append(out, fmt.Sprintf("image %s: InUseBy %v not sorted and unique", info.Key, info.InUseBy))
	}
	return out
}

func isSHA256Hex(s string) bool {
	if len(s) != 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !(s[i] >= '0' && s[i] <= '9' || s[i] >= 'a' && s[i] <= 'f') {
			return false
		}
	}
	return true
}

func findImage(l []egressproxy.ImageInfo, key string) (egressproxy.ImageInfo, bool) {
	for _, info := range l {
		if info.Key == key {
			return info, true
		}
	}
	return egressproxy.ImageInfo{}, false
}

// createForImage creates an instance of the template and returns it with
// the key of the image it uses: Spec.ImageKey, or (the provider's default)
// the one listed image in use by it.
func (e *env) createForImage(suffix string) (egressproxy.Spec, egressproxy.ImageInfo) {
	e.t.Helper()
	s := e.spec(suffix)
	e.create(s)
	l := e.listImages()
	var users []egressproxy.ImageInfo
	for _, info := range l {
		if slices.Contains(info.InUseBy, s.Name) {
			users = append(users, info)
		}
	}
	if len(users) != 1 {
		e.fatalf("after Create(%s), %d listed images are in use by it, want 1 (list %+v)", s.Name, len(users), l)
	}
	img := users[0]
	if s.ImageKey != "" && img.Key != s.ImageKey {
		e.fatalf("after Create(%s) with ImageKey %s, image %s is in use by it, want %s", s.Name, s.ImageKey, img.Key, s.ImageKey)
	}
	if !img.Present {
		e.fatalf("after Create(%s), its image %s is not present: %+v", s.Name, img.Key, img)
	}
	return s, img
}

// testImagesList: ListImages lists the configured keys (Options.ImageKeys
// exactly when given; else at least the template's ImageKey and
// OtherImageKey), sorted, each in the shape the contract gives.
func testImagesList(e *env) {
	e.imageManager()
	l := e.listImages()
	var keys []string
	for _, info := range l {
		keys = append(keys, info.Key)
	}
	if want := e.o.ImageKeys; len(want) > 0 {
		want = slices.Clone(want)
		slices.Sort(want)
		if !slices.Equal(keys, want) {
			e.t.Errorf("ListImages keys = %v, want the configured %v", keys, want)
		}
		return
	}
	e.t.Logf("Options.ImageKeys not set: only the shape of the list (keys %v) is checked", keys)
}

// testImagesCreateUsesImage: after a Create, the instance's image is present
// and in use by it, and VerifyImage reads it back Verified with the listed
// digest and size.
func testImagesCreateUsesImage(e *env) {
	e.imageManager()
	s, img := e.createForImage("img-use")
	v, err := e.c.VerifyImage(e.ctx, img.Key)
	if err != nil {
		e.fatalf("VerifyImage(%s) of the base an instance uses: %v", img.Key, err)
	}
	for _, p := range imageInfoProblems(v) {
		e.t.Errorf("VerifyImage(%s): %s", img.Key, p)
	}
	if !v.Verified || !v.Present || v.Key != img.Key || v.Digest != img.Digest || v.SizeBytes != img.SizeBytes || v.Name != img.Name {
		e.t.Errorf("VerifyImage(%s) = %+v, want Verified and Present with the listed Name %q, Digest %s and SizeBytes %d", img.Key, v, img.Name, img.Digest, img.SizeBytes)
	}
	if !slices.Contains(v.InUseBy, s.Name) {
		e.t.Errorf("VerifyImage(%s).InUseBy = %v, want %s among them", img.Key, v.InUseBy, s.Name)
	}
}

// testImagesEvictRefusedWhileInUse: EvictImage refuses (Permanent, naming
// the instance) while an instance uses the base and leaves it as it was;
// after Delete it succeeds, the image is listed absent (no user, none
// unknown), VerifyImage is NotFound, evicting again succeeds, and a new
// Create stores the base again.
func testImagesEvictRefusedWhileInUse(e *env) {
	m := e.imageManager()
	s, img := e.createForImage("img-evict")
	err := e.c.EvictImage(e.ctx, img.Key)
	e.wantCode("EvictImage of a base in use", err, egressproxy.Permanent)
	if derr := m.EvictImage(e.ctx, img.Key); egressproxy.Code(derr) != egressproxy.Permanent || !strings.Contains(fmt.Sprint(derr), s.Name) {
		e.t.Errorf("EvictImage of a base in use (direct) = %v, want Permanent naming the instance %s using it", derr, s.Name)
	}
	after, ok := findImage(e.listImages(), img.Key)
	if !ok || !after.Present || after.Digest != img.Digest || !slices.Contains(after.InUseBy, s.Name) {
		e.t.Errorf("after a refused EvictImage, image %s = %+v, want it as before (%+v)", img.Key, after, img)
	}
	e.get(s.Ref())

	if err := e.c.Delete(e.ctx, s.Ref()); err != nil {
		e.fatalf("Delete: %v", err)
	}
	if err := e.c.EvictImage(e.ctx, img.Key); err != nil {
		e.fatalf("EvictImage after the only instance using it was deleted: %v", err)
	}
	gone, ok := findImage(e.listImages(), img.Key)
	if ok && (gone.Present || len(gone.InUseBy) > 0 || gone.InUseUnknown) {
		e.t.Errorf("after EvictImage, image %s = %+v, want absent and unused", img.Key, gone)
	}
	if len(e.o.ImageKeys) > 0 && !ok {
		e.t.Errorf("after EvictImage, configured image %s is no longer listed", img.Key)
	}
	_, err = e.c.VerifyImage(e.ctx, img.Key)
	e.wantCode("VerifyImage after EvictImage", err, egressproxy.NotFound)
	if err := e.c.EvictImage(e.ctx, img.Key); err != nil {
		e.t.Errorf("EvictImage of an image without a base = %v, want nil", err)
	}

	s2, img2 := e.createForImage("img-again")
	if img2.Key != img.Key {
		e.t.Errorf("Create(%s) of the same template uses image %s, want %s", s2.Name, img2.Key, img.Key)
	}
}

// testImagesVerifyAbsentIsNotFound: on a fresh entry, VerifyImage of every
// image without a base is NotFound: those listed absent, and the
// template's ImageKey and OtherImageKey when they are not listed present.
func testImagesVerifyAbsentIsNotFound(e *env) {
	e.imageManager()
	l := e.listImages()
	var absent []string
	for _, info := range l {
		if !info.Present {
			absent = append(absent, info.Key)
		}
	}
	for _, k := range []string{e.o.Spec.ImageKey, e.o.OtherImageKey} {
		if info, ok := findImage(l, k); k != "" && !info.Present && !slices.Contains(absent, k) {
			if !ok && len(e.o.ImageKeys) > 0 {
				e.t.Errorf("ListImages does not list %s, an image key the provider accepts", k)
			}
			absent = append(absent, k)
		}
	}
	if len(absent) == 0 {
		e.t.Errorf("a fresh entry has no image without a base (list %+v): VerifyImage's NotFound cannot be checked; set Options.OtherImageKey", l)
	}
	for _, k := range absent {
		_, err := e.c.VerifyImage(e.ctx, k)
		e.wantCode("VerifyImage("+k+") of an image without a base", err, egressproxy.NotFound)
	}
}

// testImagesUnknownKeyIsPermanent: an invalid key is Permanent with a
// *egressproxy.FieldError (the client refuses it); a valid key that is not
// configured (checked when Options.ImageKeys is set) is Permanent and named,
// for VerifyImage and EvictImage alike, and changes nothing.
func testImagesUnknownKeyIsPermanent(e *env) {
	m := e.imageManager()
	_, err := e.c.VerifyImage(e.ctx, "Not_A_Key")
	e.wantCode("VerifyImage of an invalid key", err, egressproxy.Permanent)
	var fe *egressproxy.FieldError
	if err != nil && !errors.As(err, &fe) {
		e.t.Errorf("VerifyImage of an invalid key: no *egressproxy.FieldError in %v", err)
	}
	e.wantCode("EvictImage of an invalid key", e.c.EvictImage(e.ctx, ""), egressproxy.Permanent)
	_, err = m.VerifyImage(e.ctx, "Not_A_Key")
	e.wantCode("VerifyImage of an invalid key (direct)", err, egressproxy.Permanent)

	if len(e.o.ImageKeys) == 0 {
		e.t.Log("Options.ImageKeys not set: a valid but unconfigured key is not checked")
		return
	}
	before := e.listImages()
	unknown := e.prefix + "-no-such-image"
	for len(unknown) > naming.MaxImageKeyLen || slices.Contains(e.o.ImageKeys, unknown) {
		unknown = "x" + randomSuffix(10)
	}
	_, err = e.c.VerifyImage(e.ctx, unknown)
	e.wantCode("VerifyImage of an unconfigured key", err, egressproxy.Permanent)
	e.wantCode("EvictImage of an unconfigured key", e.c.EvictImage(e.ctx, unknown), egressproxy.Permanent)
	for what, err := range map[string]error{
		"VerifyImage": func() error { _, err := m.VerifyImage(e.ctx, unknown); return err }(),
		"EvictImage":  m.EvictImage(e.ctx, unknown),
	} {
		if egressproxy.Code(err) != egressproxy.Permanent || !strings.Contains(fmt.Sprint(err), unknown) {
			e.t.Errorf("%s of the unconfigured key %s (direct) = %v, want Permanent naming the key", what, unknown, err)
		}
	}
	if after := e.listImages(); !equalImages(before, after) {
		e.t.Errorf("ListImages changed after calls with an unconfigured key: %+v, before %+v", after, before)
	}
}

func equalImages(a, b []egressproxy.ImageInfo) bool {
	return slices.EqualFunc(a, b, func(x, y egressproxy.ImageInfo) bool {
		return x.Key == y.Key && x.Name == y.Name && x.Present == y.Present && x.Digest == y.Digest &&
			x.SizeBytes == y.SizeBytes && slices.Equal(x.InUseBy, y.InUseBy) && x.InUseUnknown == y.InUseUnknown && x.Verified == y.Verified
	})
}
