package egressproxy_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/go-logr/logr/funcr"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/memprovider"
)

// imageRecorder is a recorder that also implements driver.ImageManager.
type imageRecorder struct {
	recorder
	info egressproxy.ImageInfo
}

func (r *imageRecorder) ListImages(ctx context.Context) ([]egressproxy.ImageInfo, error) {
	if err := r.note("list-images"); err != nil {
		return nil, err
	}
	return []egressproxy.ImageInfo{r.info}, nil
}

func (r *imageRecorder) VerifyImage(ctx context.Context, key string) (egressproxy.ImageInfo, error) {
	if err := r.note("verify-image " + key); err != nil {
		return egressproxy.ImageInfo{}, err
	}
	return r.info, nil
}

func (r *imageRecorder) EvictImage(ctx context.Context, key string) error {
	return r.note("evict-image " + key)
}

// A provider without driver.ImageManager: every image call fails with an
// error wrapping ErrNotSupported, Permanent, named with the
// operation and the key, and reaches nothing.
func TestImagesNotSupported(t *testing.T) {
	t.Parallel()
	r := &recorder{}
	c := driver.NewClient(r, nil)
	defer c.Close()
	ctx := context.Background()
	_, lerr := c.ListImages(ctx)
	_, verr := c.VerifyImage(ctx, "deb-12")
	eerr := c.EvictImage(ctx, "deb-12")
	for _, tc := range []struct {
		err  error
		text string
	}{
		{lerr, "egressproxy list-images: not supported by this provider: it has no image management"},
		{verr, "egressproxy verify-image deb-12: not supported by this provider: it has no image management"},
		{eerr, "egressproxy evict-image deb-12: not supported by this provider: it has no image management"},
	} {
		if !errors.Is(tc.err, egressproxy.ErrNotSupported) || !errors.Is(tc.err, egressproxy.ErrPermanent) || egressproxy.Code(tc.err) != egressproxy.Permanent {
			t.Errorf("%v: want ErrNotSupported, Permanent (code %v)", tc.err, egressproxy.Code(tc.err))
		}
		if errors.Is(tc.err, egressproxy.ErrTransient) || errors.Is(tc.err, egressproxy.ErrNotFound) {
			t.Errorf("%v: a second class", tc.err)
		}
		if got := errString(tc.err); got != tc.text {
			t.Errorf("text = %q\nwant   %q", got, tc.text)
		}
	}
	if calls := r.callList(); len(calls) != 0 {
		t.Errorf("the provider was called: %v", calls)
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// The image calls pass through to the provider's ImageManager and back,
// and their errors are wrapped once: "egressproxy <op> <key>:" with the
// provider's class kept. An invalid key never reaches the provider.
func TestImagesPassThroughAndWrapOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	info := egressproxy.ImageInfo{Key: "deb-12", Name: "base-x", Present: true, Digest: strings.Repeat("a", 64), SizeBytes: 7, InUseBy: []string{"p1"}}
	r := &imageRecorder{info: info}
	c := driver.NewClient(r, nil)
	defer c.Close()
	if l, err := c.ListImages(ctx); err != nil || len(l) != 1 || l[0].Key != "deb-12" {
		t.Fatalf("ListImages = %+v, %v", l, err)
	}
	if v, err := c.VerifyImage(ctx, "deb-12"); err != nil || v.Digest != info.Digest {
		t.Fatalf("VerifyImage = %+v, %v", v, err)
	}
	if err := c.EvictImage(ctx, "deb-12"); err != nil {
		t.Fatal(err)
	}
	_, verr := c.VerifyImage(ctx, "Bad Key")
	eerr := c.EvictImage(ctx, "")
	for _, tc := range []struct {
		err  error
		text string
	}{
		{verr, `egressproxy verify-image: invalid ImageKey "Bad Key": may contain only lowercase letters, digits, '.' and '-'`},
		{eerr, `egressproxy evict-image: invalid ImageKey: is required`},
	} {
		var fe *egressproxy.FieldError
		if egressproxy.Code(tc.err) != egressproxy.Permanent || !errors.As(tc.err, &fe) || errString(tc.err) != tc.text {
			t.Errorf("invalid key: %v (%v), want Permanent FieldError %q", tc.err, egressproxy.Code(tc.err), tc.text)
		}
	}
	if got, want := strings.Join(r.callList(), ","), "list-images,verify-image deb-12,evict-image deb-12"; got != want {
		t.Errorf("provider calls %s, want %s", got, want)
	}

	r.mu.Lock()
	r.err = errs.Errorf(egressproxy.NotFound, "no base yet")
	r.mu.Unlock()
	_, err := c.VerifyImage(ctx, "deb-12")
	var op *egressproxy.OpError
	if !errors.As(err, &op) || op.Op != "verify-image" || op.ImageKey != "deb-12" || op.Instance != "" ||
		egressproxy.Code(err) != egressproxy.NotFound || errString(err) != "egressproxy verify-image deb-12: no base yet" {
		t.Errorf("VerifyImage = %v (%+v), want NotFound wrapped once", err, op)
	}
	r.mu.Lock()
	r.err = errors.New("unclassed")
	r.mu.Unlock()
	if err := c.EvictImage(ctx, "deb-12"); egressproxy.Code(err) != egressproxy.Transient {
		t.Errorf("unclassed provider error = %v (%v), want Transient", err, egressproxy.Code(err))
	}
	c.Close()
	if _, err := c.ListImages(ctx); !errors.Is(err, egressproxy.ErrClosed) {
		t.Errorf("ListImages after Close = %v, want ErrClosed", err)
	}
}

// On memprovider: the whole cycle through the client, with the refusal of
// an eviction while an instance uses the base.
func TestImagesOnMemprovider(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := memprovider.New(&memprovider.Options{Images: []string{"deb-12"}})
	defer c.Close()
	if _, err := c.Create(ctx, goodSpec()); err != nil {
		t.Fatal(err)
	}
	l, err := c.ListImages(ctx)
	if err != nil || len(l) != 1 || !l[0].Present || len(l[0].InUseBy) != 1 || l[0].InUseBy[0] != goodSpec().Name {
		t.Fatalf("ListImages = %+v, %v", l, err)
	}
	err = c.EvictImage(ctx, "deb-12")
	want := `egressproxy evict-image deb-12: memprovider: base base-deb-12 of image "deb-12" is in use by instances ` + goodSpec().Name + `; delete them before you evict it`
	if egressproxy.Code(err) != egressproxy.Permanent || errString(err) != want {
		t.Fatalf("EvictImage in use = %v\nwant Permanent %s", err, want)
	}
	if err := c.Delete(ctx, goodSpec().Ref()); err != nil {
		t.Fatal(err)
	}
	if err := c.EvictImage(ctx, "deb-12"); err != nil {
		t.Fatal(err)
	}
	_, err = c.VerifyImage(ctx, "deb-12")
	if egressproxy.Code(err) != egressproxy.NotFound {
		t.Fatalf("VerifyImage after EvictImage = %v, want NotFound", err)
	}
}

// Each image operation is one span (egressproxy.ListImages, VerifyImage,
// EvictImage, with the key as egressproxy.image) and one log line keyed
// "image", never "instance"; NotFound at V(1), a missing capability at
// Error.
func TestImagesSpansAndLogs(t *testing.T) {
	t.Parallel()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(context.Background())
	var mu sync.Mutex
	var lines []string
	log := funcr.New(func(_, args string) {
		mu.Lock()
		defer mu.Unlock()
		lines = append(lines, args)
	}, funcr.Options{Verbosity: 1})
	ctx := context.Background()
	r := &imageRecorder{}
	c := driver.NewClient(r, &egressproxy.Options{Logger: log, TracerProvider: tp})
	c.ListImages(ctx)
	r.mu.Lock()
	r.err = errs.Errorf(egressproxy.NotFound, "no base")
	r.mu.Unlock()
	c.VerifyImage(ctx, "deb-12")
	c.EvictImage(ctx, "deb-12")
	c.Close()
	unsupported := driver.NewClient(&recorder{}, &egressproxy.Options{Logger: log})
	unsupported.EvictImage(ctx, "deb-12")
	unsupported.Close()

	var got []string
	for _, s := range rec.Ended() {
		if s.Name() == "egressproxy.Close" {
			continue
		}
		var img string
		for _, kv := range s.Attributes() {
			if kv.Key == attribute.Key("egressproxy.image") {
				img = kv.Value.AsString()
			}
			if kv.Key == attribute.Key("egressproxy.instance") {
				t.Errorf("span %s has an instance attribute", s.Name())
			}
		}
		got = append(got, s.Name()+"("+img+")/"+s.Status().Code.String())
	}
	want := []string{"egressproxy.ListImages()/" + codes.Unset.String(), "egressproxy.VerifyImage(deb-12)/Error", "egressproxy.EvictImage(deb-12)/Error"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("spans %v, want %v", got, want)
	}

	mu.Lock()
	defer mu.Unlock()
	if len(lines) != 4 {
		t.Fatalf("%d log lines, want 4:\n%s", len(lines), strings.Join(lines, "\n"))
	}
	for i, w := range []string{
		`"level"=1 "msg"="operation done" "op"="list-images" "elapsed"=`,
		`"level"=1 "msg"="operation failed as expected" "op"="verify-image" "image"="deb-12" "code"="NotFound"`,
		`"level"=1 "msg"="operation failed as expected" "op"="evict-image" "image"="deb-12" "code"="NotFound"`,
		`"msg"="operation failed" "error"="egressproxy evict-image deb-12: not supported by this provider`,
	} {
		if !strings.Contains(lines[i], w) || strings.Contains(lines[i], `"instance"`) {
			t.Errorf("line %d = %s\nwant it to contain %s and no instance key", i, lines[i], w)
		}
	}
}
