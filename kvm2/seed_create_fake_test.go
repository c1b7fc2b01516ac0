package kvm2

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/testing/libvirtfake"
)

// unusableTempDir points TMPDIR at a regular file for the rest of t, so
// that making a temporary file or directory fails, for root too (a
// directory without write permission would not stop root).
func unusableTempDir(t *testing.T) {
	t.Helper()
	f := filepath.Join(t.TempDir(), "not-a-directory")
	if err := os.WriteFile(f, nil, 0o444); err != nil {
		t.Fatal(err)
	}
	t.Setenv("TMPDIR", f)
	if _, err := os.MkdirTemp("", ""); err == nil {
		t.Fatal("a temporary directory could still be made")
	}
}

// TestFakeCreateSeedNoTempDir: Create builds its seed in memory (TMPDIR
// unusable), builds one only when it makes or completes the instance (a
// Create of an existing instance builds none and touches no volume), and a
// completed instance gets the same seed bytes as its first attempt.
// Not parallel: it sets TMPDIR.
func TestFakeCreateSeedNoTempDir(t *testing.T) {
	unusableTempDir(t)
	e := newFakeEnv(t)
	ctx := context.Background()
	spec := fakeSpec("a")

	built := e.p.seedsBuilt.Load()
	if _, err := e.p.Create(ctx, spec); err != nil {
		t.Fatalf("Create with TMPDIR unusable: %v", err)
	}
	e.hasInstance("a", libvirt.DomainRunning)
	if n := e.p.seedsBuilt.Load() - built; n != 1 {
		t.Errorf("fresh Create built %d seeds, want 1", n)
	}

	e.host.ResetCalls()
	built = e.p.seedsBuilt.Load()
	if _, err := e.p.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	if n := e.p.seedsBuilt.Load() - built; n != 0 {
		t.Errorf("Create of an existing instance built %d seeds, want none", n)
	}
	for _, op := range []string{"StorageVolCreateXML", "StorageVolUpload", "StorageVolDelete"} {
		if n := e.host.Calls(op); n != 0 {
			t.Errorf("Create of an existing instance: %d %s calls", n, op)
		}
	}

	// Interrupted after the define, then completed: the seed is built
	// again (uploaded again) and is byte for byte the first one.
	b := fakeSpec("b")
	e.host.SetHook("DomainCreate", libvirtfake.Fail(libvirt.ErrInterrupted))
	_, err := e.p.Create(ctx, b)
	wantCode(t, "start interrupted", err, errs.Transient)
	first, _ := e.host.Volume(e.cfg.Pool, seedVolume(e.dom("b")))
	e.host.ClearHooks()
	built = e.p.seedsBuilt.Load()
	if _, err := e.p.Create(ctx, b); err != nil {
		t.Fatal(err)
	}
	if n := e.p.seedsBuilt.Load() - built; n != 1 {
		t.Errorf("completing Create built %d seeds, want 1", n)
	}
	again, _ := e.host.Volume(e.cfg.Pool, seedVolume(e.dom("b")))
	if len(first.Data) == 0 || !bytes.Equal(first.Data, again.Data) {
		t.Errorf("completed seed differs from the first attempt's (%d vs %d bytes)", len(first.Data), len(again.Data))
	}
}
