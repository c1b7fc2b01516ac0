//go:build integration

package kvm2

import (
	"bytes"
	"testing"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy"
	"github.com/go-logr/logr/testr"
)

// TestIntegrationCreateNoTempDir: on the real stack, with TMPDIR pointing
// at something no temporary file can be made in, a cold Create (the base
// fetched too) succeeds, the guest runs, and the seed volume on the host is
// byte for byte the in-memory image buildSeed makes for the instance; a
// second Create of the existing instance succeeds as well and builds no
// seed. Not parallel: it sets TMPDIR and reads the package's seed counter.
func TestIntegrationCreateNoTempDir(t *testing.T) {
	e := newLifecycleEnv(t)
	p := openT(t, e.cfg, testr.New(t))
	ctx := ctxT(t)
	spec := egressproxy.Spec{Name: "notmp", UID: "uid-notmp", UserData: "#cloud-config\nhostname: notmp\n"}
	unusableTempDir(t)

	inst, err := p.Create(ctx, spec)
	if err != nil {
		t.Fatalf("Create with TMPDIR unusable: %v", err)
	}
	h := HostInstanceT(t, e.cfg, spec.Name)
	if h.State != libvirt.DomainRunning || h.UserData != spec.UserData {
		t.Errorf("host: state %d user-data %q; want running with the spec's user-data", h.State, h.UserData)
	}
	want, err := buildSeed(seedData{InstanceID: spec.UID, Hostname: spec.Name, UserData: spec.UserData, Created: inst.CreatedAt})
	if err != nil {
		t.Fatal(err)
	}
	if got := downloadVolume(t, e.cfg, seedVolume(domainName(e.cfg.Entry, spec.Name))); !bytes.Equal(got, want) {
		t.Errorf("seed on the host (%d bytes) is not the in-memory image (%d bytes)", len(got), len(want))
	}
	t.Logf("seed: %d bytes", len(want))

	built := p.seedsBuilt.Load()
	if again, err := p.Create(ctx, spec); err != nil || !again.CreatedAt.Equal(inst.CreatedAt) {
		t.Errorf("Create of the existing instance: %+v, %v", again, err)
	}
	if n := p.seedsBuilt.Load() - built; n != 0 {
		t.Errorf("Create of the existing instance built %d seeds, want none", n)
	}
	if err := p.Delete(ctx, spec.Ref()); err != nil {
		t.Fatal(err)
	}
	AssertInstanceGoneT(t, e.cfg, spec.Name, " after Delete")
}
