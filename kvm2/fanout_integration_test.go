//go:build integration

package kvm2

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// otherEntry is e's config under another entry name, its domains and
// volumes removed when the test ends.
func otherEntry(t *testing.T, e *lifecycleEnv) Config {
	t.Helper()
	cfg := e.cfg
	cfg.Entry = "k2fo" + randSuffix(t)
	t.Cleanup(func() {
		err := rawLibvirt(t, func(l *libvirt.Libvirt) error { return removeEntry(l, cfg) })
		if err != nil {
			t.Errorf("cleanup of %s: %v", cfg.Entry, err)
		}
	})
	return cfg
}

// sourceLog is a logger that keeps the source of each "created" line.
type sourceLog struct {
	mu      sync.Mutex
	sources map[string]string // entry -> source
}

func (s *sourceLog) logger() logr.Logger {
	return funcr.New(func(prefix, args string) {
		if !strings.Contains(args, `"msg"="created"`) {
			return
		}
		entry, source := field(args, "entry"), field(args, "source")
		s.mu.Lock()
		s.sources[entry] = source
		s.mu.Unlock()
	}, funcr.Options{})
}

func (s *sourceLog) of(entry string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sources[entry]
}

// field is the quoted value of key in a funcr line.
func field(line, key string) string {
	_, rest, ok := strings.Cut(line, `"`+key+`"="`)
	if !ok {
		return ""
	}
	v, _, _ := strings.Cut(rest, `"`)
	return v
}

// Without any option, the providers of one process share image fan-out
// (basecache.ProcessFanout): two entries creating an instance of a cold
// image at once cost the mirror one GET (sources mirror and shared); a
// third entry going cold afterwards on the same host never copies its
// host's bases over the network (nor inside the host: libvirt would
// convert a qcow2 one), so it downloads (source mirror). An entry opened
// with PrivateImageCache downloads on its own.
func TestIntegrationImageFanoutByDefault(t *testing.T) {
	e := newLifecycleEnv(t)
	img := teststack.TinyQCOW2(t)
	sum := sha256.Sum256(img)
	var gets atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		gets.Add(1)
		// A mirror's first byte takes a moment: the tiny image would
		// otherwise be downloaded before the second entry's fetch joins.
		time.Sleep(300 * time.Millisecond)
		w.Header().Set("Content-Length", fmt.Sprint(len(img)))
		_, _ = w.Write(img)
	}))
	t.Cleanup(srv.Close)
	image := map[string]imagecache.Image{"tiny": {URL: srv.URL + "/fan.qcow2", SHA256: hex.EncodeToString(sum[:])}}
	logs := &sourceLog{sources: map[string]string{}}
	open := func(opts *Options) (*provider, string) {
		cfg := otherEntry(t, e)
		cfg.Images = image
		if opts == nil {
			opts = &Options{}
		}
		opts.Logger = logs.logger()
		p, err := open(t.Context(), cfg, opts)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = p.Close() })
		return p, cfg.Entry
	}
	create := func(p *provider, name string) error {
		spec := egressproxy.Spec{Name: name, UID: "uid-" + name, MachineType: "tiny"}
		_, err := p.Create(ctxT(t), spec)
		if err == nil {
			t.Cleanup(func() { _ = p.Delete(ctxT(t), spec.Ref()) })
		}
		return err
	}
	p1, e1 := open(nil)
	p2, e2 := open(nil)
	var wg sync.WaitGroup
	var err1, err2 error
	wg.Go(func() { err1 = create(p1, "fan1") })
	wg.Go(func() { err2 = create(p2, "fan2") })
	wg.Wait()
	if err1 != nil || err2 != nil {
		t.Fatalf("Creates: %v, %v", err1, err2)
	}
	if g := gets.Load(); g != 1 {
		t.Fatalf("two entries' cold Creates made %d GETs, want 1 (sources %q, %q)", g, logs.of(e1), logs.of(e2))
	}
	if s := logs.of(e1) + "+" + logs.of(e2); s != "mirror+shared" && s != "shared+mirror" {
		t.Fatalf("sources %s, want one mirror and one shared", s)
	}
	p3, e3 := open(nil)
	if err := create(p3, "fan3"); err != nil {
		t.Fatal(err)
	}
	if g, s := gets.Load(), logs.of(e3); g != 2 || s != imagecache.SourceMirror {
		t.Fatalf("a third entry going cold later on the same host: %d GETs in all, source %q; want 2 and mirror", g, s)
	}
	p4, e4 := open(&Options{PrivateImageCache: true})
	if err := create(p4, "fan4"); err != nil {
		t.Fatal(err)
	}
	if g, s := gets.Load(), logs.of(e4); g != 3 || s != imagecache.SourceMirror {
		t.Fatalf("an entry with PrivateImageCache: %d GETs in all, source %q; want 3 and mirror", g, s)
	}
}
