//go:build integration

package kvm2

import (
	"errors"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
	"github.com/go-logr/logr/testr"
)

// TestIntegrationSpecConflict: Create of an existing UID with another
// port, user-data, image key or machine type is ErrSpecConflict (Permanent)
// and leaves the instance as it was; Get, List and Create report the
// spec's digest.
func TestIntegrationSpecConflict(t *testing.T) {
	e := newLifecycleEnv(t)
	cfg := e.cfg
	cfg.MachineTypes = map[string]MachineType{"tiny": {VCPUs: 1, MemoryMiB: 128}, "tiny2": {VCPUs: 1, MemoryMiB: 160}}
	cfg.DefaultMachineType = "tiny"
	p := openT(t, cfg, testr.New(t))
	ctx := ctxT(t)
	spec := egressproxy.Spec{Name: "drift", UID: "uid-drift", UserData: "#cloud-config\n# secret-token-1\n"}
	inst, err := p.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if inst.SpecDigest != spec.Digest() {
		t.Errorf("Create SpecDigest %q, want %q", inst.SpecDigest, spec.Digest())
	}
	for name, mutate := range map[string]func(*egressproxy.Spec){
		"port":         func(s *egressproxy.Spec) { s.Port = 8080 },
		"user-data":    func(s *egressproxy.Spec) { s.UserData = "#cloud-config\n# secret-token-2\n" },
		"image key":    func(s *egressproxy.Spec) { s.ImageKey = "tiny" }, // the default, named: another spec
		"machine type": func(s *egressproxy.Spec) { s.MachineType = "tiny2" },
	} {
		other := spec
		mutate(&other)
		_, err := p.Create(ctx, other)
		if !errors.Is(err, errs.ErrSpecConflict) || errs.Code(err) != errs.Permanent {
			t.Errorf("Create with another %s: %v (code %v), want ErrSpecConflict (Permanent)", name, err, errs.Code(err))
		} else {
			t.Logf("another %s: %v", name, err)
		}
	}
	got, err := p.Get(ctx, spec.Ref())
	if err != nil || got.SpecDigest != spec.Digest() || !got.CreatedAt.Equal(inst.CreatedAt) || got.Port != naming.DefaultPort {
		t.Errorf("Get after the conflicts = %+v, %v; want the original instance", got, err)
	}
	h := HostInstanceT(t, cfg, spec.Name)
	if h.State != libvirt.DomainRunning || h.UserData != spec.UserData {
		t.Errorf("host: state %d user-data %q; want running with the original user-data", h.State, h.UserData)
	}
	if err := p.Delete(ctx, spec.Ref()); err != nil {
		t.Fatal(err)
	}
	AssertInstanceGoneT(t, cfg, spec.Name, " after Delete")
}

// TestIntegrationLegacyDomainNotChecked: a domain defined by an earlier
// version (metadata without a spec digest) and never started is completed
// by Create (volumes made, started) and never reported as a conflict.
func TestIntegrationLegacyDomainNotChecked(t *testing.T) {
	e := newLifecycleEnv(t)
	p := openT(t, e.cfg, testr.New(t))
	ctx := ctxT(t)
	spec := egressproxy.Spec{Name: "legacy", UID: "uid-legacy", UserData: "#cloud-config\n"}
	name := domainName(e.cfg.Entry, spec.Name)
	created := time.Now().UTC().Add(-time.Hour).Truncate(time.Second)
	x, err := buildDomainXML(domainParams{
		Name: name, Type: e.cfg.DomainType, VCPUs: 1, MemoryMiB: 128, Pool: e.cfg.Pool,
		Overlay: overlayVolume(name), Seed: seedVolume(name), Network: e.cfg.Network,
		Meta: instanceMeta{UID: spec.UID, Created: created, Entry: e.cfg.Entry, Owner: e.cfg.Owner, Port: 3128},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := rawLibvirt(t, func(l *libvirt.Libvirt) error { _, err := l.DomainDefineXML(x); return err }); err != nil {
		t.Fatalf("define the legacy domain: %v", err)
	}
	inst, err := p.Create(ctx, spec)
	if err != nil {
		t.Fatalf("Create over the legacy domain: %v", err)
	}
	if inst.State != egressproxy.StateProvisioning || !inst.CreatedAt.Equal(created) || inst.SpecDigest != "" {
		t.Errorf("Create = %+v; want the legacy instance (created %v, no digest) started", inst, created)
	}
	h := SettledHostInstanceT(t, e.cfg, spec.Name)
	if h.State != libvirt.DomainRunning || !h.Overlay || h.OverlayBacking != h.BasePath || h.UserData != spec.UserData {
		t.Errorf("host: %+v; want running with overlay and seed", h)
	}
	other := spec
	other.Port = 8080
	if again, err := p.Create(ctx, other); err != nil || !again.CreatedAt.Equal(created) {
		t.Errorf("Create with another port over a domain without digest = %+v, %v; want the instance, unchecked", again, err)
	}
	if err := p.Delete(ctx, spec.Ref()); err != nil {
		t.Fatal(err)
	}
	AssertInstanceGoneT(t, e.cfg, spec.Name, " after Delete")
}
