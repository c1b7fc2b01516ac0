//go:build integration

package kvm2

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/imagecache"
)

// TestIntegrationImageProgress: Options.ImageProgress sees a cold fetch on
// the real stack (the last report covers every byte of the image), and a
// Create that finds the base cached reports nothing.
func TestIntegrationImageProgress(t *testing.T) {
	t.Parallel()
	e := newLifecycleEnv(t)
	var mu sync.Mutex
	var got []imagecache.Progress
	p, err := open(context.Background(), e.cfg, &Options{
		Logger:                testr.New(t),
		ImageProgressInterval: time.Millisecond,
		ImageProgress: func(pr imagecache.Progress) {
			mu.Lock()
			got = append(got, pr)
			mu.Unlock()
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctx := ctxT(t)
	spec := egressproxy.Spec{Name: "progress", UID: "uid-progress"}
	if _, err := p.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := p.Delete(ctx, spec.Ref()); err != nil {
			t.Error(err)
		}
	}()
	mu.Lock()
	cold := append([]imagecache.Progress(nil), got...)
	got = nil
	mu.Unlock()
	if len(cold) == 0 {
		t.Fatal("a cold Create reported no progress")
	}
	last := cold[len(cold)-1]
	if last.Total <= 0 || last.Bytes != last.Total || last.Volume == "" {
		t.Errorf("last progress %+v; want every byte of a known total, the base named", last)
	}
	t.Logf("%d progress reports, last %+v", len(cold), last)

	spec2 := egressproxy.Spec{Name: "progress2", UID: "uid-progress2"}
	if _, err := p.Create(ctx, spec2); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := p.Delete(ctx, spec2.Ref()); err != nil {
			t.Error(err)
		}
	}()
	mu.Lock()
	defer mu.Unlock()
	if len(got) != 0 {
		t.Errorf("a Create with the base cached reported progress: %+v", got)
	}
}
