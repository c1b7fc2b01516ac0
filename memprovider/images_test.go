package memprovider_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/memprovider"
)

func wantImageErr(t *testing.T, what string, err error, code errs.ErrorCode, text string) {
	t.Helper()
	if errs.Code(err) != code || !strings.Contains(errString(err), text) {
		t.Errorf("%s = %v (%v), want %v containing %q", what, err, errs.Code(err), code, text)
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// With Options.Images the catalogue is those keys: the first is the
// default, others are refused by Create, and each is listed present once
// a Create used it, in use by its instances.
func TestImagesConfigured(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := newMem(&memprovider.Options{Images: []string{"deb-12", "alpine", "Bad_Key", "deb-12"}})
	defer p.Close()

	l, err := p.ListImages(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]egressproxy.ImageInfo{{Key: "alpine"}, {Key: "deb-12"}}, l); diff != "" {
		t.Fatalf("ListImages of a fresh provider (-want +got):\n%s", diff)
	}
	_, err = p.Create(ctx, egressproxy.Spec{Name: "x", UID: "ux", ImageKey: "ubuntu"})
	wantImageErr(t, "Create of an unconfigured key", err, errs.Permanent, `ImageKey "ubuntu": is not a configured image`)

	for _, s := range []egressproxy.Spec{{Name: "b", UID: "ub"}, {Name: "a", UID: "ua", ImageKey: "deb-12"}} {
		if _, err := p.Create(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	l, err = p.ListImages(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(l) != 2 || l[0].Present || !l[1].Present || l[1].Name != "base-deb-12" || len(l[1].Digest) != 64 || l[1].SizeBytes <= 0 ||
		!cmp.Equal(l[1].InUseBy, []string{"a", "b"}) {
		t.Fatalf("ListImages = %+v, want alpine absent, deb-12 (the default) present and used by a and b", l)
	}
	v, err := p.VerifyImage(ctx, "deb-12")
	want := l[1]
	want.Verified = true
	if err != nil || !cmp.Equal(v, want) {
		t.Fatalf("VerifyImage = %+v, %v; want %+v", v, err, want)
	}
	_, err = p.VerifyImage(ctx, "alpine")
	wantImageErr(t, "VerifyImage without a base", err, errs.NotFound, `image "alpine" has no base yet`)
	wantImageErr(t, "EvictImage in use", p.EvictImage(ctx, "deb-12"), errs.Permanent, "in use by instances a, b; delete them before you evict it")
	_, err = p.VerifyImage(ctx, "ubuntu")
	wantImageErr(t, "VerifyImage of an unconfigured key", err, errs.Permanent, `"ubuntu"`)
	wantImageErr(t, "EvictImage of an unconfigured key", p.EvictImage(ctx, "ubuntu"), errs.Permanent, `"ubuntu"`)
	_, err = p.VerifyImage(ctx, "")
	var fe *errs.FieldError
	if errs.Code(err) != errs.Permanent || !errors.As(err, &fe) || fe.Field != "ImageKey" {
		t.Errorf("VerifyImage(\"\") = %v, want a Permanent FieldError on ImageKey", err)
	}

	for _, r := range []egressproxy.Ref{{Name: "a", UID: "ua"}, {Name: "b", UID: "ub"}} {
		if err := p.Delete(ctx, r); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.EvictImage(ctx, "deb-12"); err != nil {
		t.Fatalf("EvictImage unused: %v", err)
	}
	if l, err := p.ListImages(ctx); err != nil || !cmp.Equal(l, []egressproxy.ImageInfo{{Key: "alpine"}, {Key: "deb-12"}}) {
		t.Fatalf("ListImages after EvictImage = %+v, %v", l, err)
	}
}

// Without Options.Images every valid key is offered, the default is
// DefaultImageKey, and the list holds the keys Creates used.
func TestImagesOpenCatalogue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := newMem(nil)
	defer p.Close()
	if l, err := p.ListImages(ctx); err != nil || len(l) != 0 {
		t.Fatalf("ListImages of a fresh provider = %+v, %v; want none", l, err)
	}
	for _, s := range []egressproxy.Spec{{Name: "a", UID: "ua"}, {Name: "b", UID: "ub", ImageKey: "any.key"}} {
		if _, err := p.Create(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	l, err := p.ListImages(ctx)
	if err != nil || len(l) != 2 || l[0].Key != "any.key" || l[1].Key != memprovider.DefaultImageKey ||
		!cmp.Equal(l[1].InUseBy, []string{"a"}) || !l[0].Present || l[0].Digest == l[1].Digest {
		t.Fatalf("ListImages = %+v, %v", l, err)
	}
	_, err = p.VerifyImage(ctx, "never-used")
	wantImageErr(t, "VerifyImage of an unused key", err, errs.NotFound, "no base yet")
	if err := p.EvictImage(ctx, "never-used"); err != nil {
		t.Errorf("EvictImage of an unused key = %v, want nil", err)
	}
}

// CorruptImage changes the stored bytes: VerifyImage says so (Permanent,
// both digests, the remedy naming EvictImage) and keeps the base.
func TestImagesCorruptImage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := newMem(nil)
	defer p.Close()
	wantImageErr(t, "CorruptImage without a base", p.CorruptImage("default"), errs.NotFound, "no base")
	if _, err := p.Create(ctx, egressproxy.Spec{Name: "a", UID: "ua"}); err != nil {
		t.Fatal(err)
	}
	before, err := p.VerifyImage(ctx, "default")
	if err != nil {
		t.Fatal(err)
	}
	if err := p.CorruptImage("default"); err != nil {
		t.Fatal(err)
	}
	_, err = p.VerifyImage(ctx, "default")
	wantImageErr(t, "VerifyImage of a corrupted base", err, errs.Permanent, "but was published with sha256 "+before.Digest)
	wantImageErr(t, "VerifyImage of a corrupted base", err, errs.Permanent, "evict the base with EvictImage (egressproxyctl images evict)")
	l, err := p.ListImages(ctx)
	if err != nil || len(l) != 1 || !l[0].Present || l[0].Digest != before.Digest {
		t.Fatalf("ListImages after a failed verify = %+v, %v; want the base kept", l, err)
	}
}

// The image operations honour faults, contexts and Close like the others.
func TestImagesFaultsContextAndClose(t *testing.T) {
	t.Parallel()
	p := newMem(nil)
	ctx := context.Background()
	p.InjectFault(memprovider.OpListImages, memprovider.Fault{Code: errs.Transient, Times: 1})
	p.InjectFault(memprovider.OpVerifyImage, memprovider.Fault{Code: errs.Transient, Times: 1})
	p.InjectFault(memprovider.OpEvictImage, memprovider.Fault{Code: errs.Transient, Times: 1})
	_, err := p.ListImages(ctx)
	wantImageErr(t, "ListImages with a fault", err, errs.Transient, "injected")
	_, err = p.VerifyImage(ctx, "k")
	wantImageErr(t, "VerifyImage with a fault", err, errs.Transient, "injected")
	wantImageErr(t, "EvictImage with a fault", p.EvictImage(ctx, "k"), errs.Transient, "injected")

	canceled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := p.ListImages(canceled); errs.Code(err) != errs.Canceled {
		t.Errorf("ListImages canceled = %v", err)
	}
	p.Close()
	_, err = p.ListImages(ctx)
	_, verr := p.VerifyImage(ctx, "k")
	for what, err := range map[string]error{"ListImages": err, "VerifyImage": verr, "EvictImage": p.EvictImage(ctx, "k"), "CorruptImage": p.CorruptImage("k")} {
		if !errors.Is(err, errs.ErrClosed) || errs.Code(err) != errs.Permanent {
			t.Errorf("%s after Close = %v, want ErrClosed (Permanent)", what, err)
		}
	}
}
