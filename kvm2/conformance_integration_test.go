//go:build integration

package kvm2

import (
	"context"
	"testing"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/go-logr/logr/testr"
	"libvirt.org/go/libvirtxml"

	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/driver/drivertest"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// kvm2Harness gives each conformance subtest a fresh entry (and base, and
// isolated network) on the real stack; a second entry shares host and pool.
type kvm2Harness struct {
	t       *testing.T
	e       *lifecycleEnv
	poolXML string // the harness's own transient pool (RemoveStorage destroys it)
}

// newKvm2Harness makes a test entry whose pool is its own transient dir
// pool, so that RemoveStorage can take it away without touching the stack's
// pool other tests use.
func newKvm2Harness(t *testing.T) *kvm2Harness {
	dir := t.TempDir()
	name := "k2pt-" + randSuffix(t)
	x, err := (&libvirtxml.StoragePool{Type: "dir", Name: name, Target: &libvirtxml.StoragePoolTarget{Path: dir}}).Marshal()
	if err != nil {
		t.Fatal(err)
	}
	h := &kvm2Harness{t: t, poolXML: x}
	if err := h.RestoreStorage(context.Background()); err != nil {
		t.Fatalf("create pool %s: %v", name, err)
	}
	t.Cleanup(func() { // after the entry's own cleanup (registered later, run first)
		err := rawLibvirt(t, func(l *libvirt.Libvirt) error {
			p, err := l.StoragePoolLookupByName(name)
			if isLibvirtCode(err, libvirt.ErrNoStoragePool) {
				return nil
			} else if err != nil {
				return err
			}
			return l.StoragePoolDestroy(p)
		})
		if err != nil {
			t.Errorf("destroy pool %s: %v", name, err)
		}
	})
	h.e = newLifecycleEnv(t)
	h.e.cfg.Pool = name
	return h
}

// RemoveStorage destroys the harness's transient pool: it is gone from
// libvirt, its files stay.
func (h *kvm2Harness) RemoveStorage(ctx context.Context) error {
	return rawLibvirt(h.t, func(l *libvirt.Libvirt) error {
		p, err := l.StoragePoolLookupByName(h.e.cfg.Pool)
		if err != nil {
			return err
		}
		return l.StoragePoolDestroy(p)
	})
}

// RestoreStorage creates the pool again over the same directory.
func (h *kvm2Harness) RestoreStorage(ctx context.Context) error {
	return rawLibvirt(h.t, func(l *libvirt.Libvirt) error {
		_, err := l.StoragePoolCreateXML(h.poolXML, 0)
		return err
	})
}

var _ drivertest.StorageHarness = (*kvm2Harness)(nil)

func (h *kvm2Harness) MakeProvider(ctx context.Context) (driver.Provider, error) {
	return open(ctx, h.e.cfg, &Options{Logger: testr.New(h.t)})
}

func (h *kvm2Harness) MakeOtherEntryProvider(ctx context.Context) (driver.Provider, error) {
	cfg := h.e.cfg
	cfg.Entry += "-o" // contains the first entry's name, so the env's cleanup covers it
	return open(ctx, cfg, &Options{Logger: testr.New(h.t)})
}

func (h *kvm2Harness) Close() {}

func TestIntegrationConformance(t *testing.T) {
	teststack.Require(t)
	drivertest.RunConformanceTests(t, func(ctx context.Context, t *testing.T) (drivertest.Harness, error) {
		return newKvm2Harness(t), nil
	}, &drivertest.Options{
		NamePrefix:   "pt",
		NeverRunning: true, // the test guests have no OS, so never an address
		// The template leaves ImageKey and MachineType empty (the entry's
		// defaults); naming the default explicitly is another spec.
		OtherImageKey:    "tiny",
		OtherMachineType: "tiny",
		ImageKeys:        []string{"tiny"}, // the Images/ subtests: exactly these listed
	})
}
