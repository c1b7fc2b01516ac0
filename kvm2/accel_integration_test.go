//go:build integration

package kvm2

import (
	"errors"
	"os"
	"strings"
	"testing"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/go-logr/logr/testr"
	"libvirt.org/go/libvirtxml"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// The automatic DomainType on the real stack. No test here starts a KVM
// guest: the test machines offer KVM, but KVM guests hang in their firmware
// (docs/config.md), so the kvm branch is proven by what Check reports, by
// the decision Create would use, and by libvirt accepting (defining, never
// starting) the domain Create would define.

// kvmUsable reports whether this machine's /dev/kvm can be opened for
// reading and writing, as libvirt requires before it offers KVM.
func kvmUsable() bool {
	f, err := os.OpenFile(teststack.DevKVM, os.O_RDWR, 0)
	if err != nil {
		return false
	}
	_ = f.Close()
	return true
}

// TestIntegrationAccelerationAuto: with the zero DomainType, the provider
// reads the host's real capabilities and picks kvm here (qemu on a machine
// without a usable /dev/kvm); libvirt accepts the domain of that type.
func TestIntegrationAccelerationAuto(t *testing.T) {
	cfg := stackConfig(t)
	cfg.DomainType = ""
	want := domainTypeQEMU
	if kvmUsable() {
		want = domainTypeKVM
	}
	t.Logf("%s usable: %v, want domain type %s", teststack.DevKVM, want == domainTypeKVM, want)

	p := openT(t, cfg, testr.New(t))
	h := checkT(t, p)
	if !h.Reachable {
		t.Fatalf("Check = %+v, want reachable", h)
	}
	accel := map[string]string{domainTypeKVM: "kvm", domainTypeQEMU: "none"}[want]
	if h.Details[detailDomainType] != want || h.Details[detailAcceleration] != accel {
		t.Errorf("details %v: want domainType %s, acceleration %s", h.Details, want, accel)
	}
	if d, degraded := h.Details[detailDegraded]; degraded != (want == domainTypeQEMU) {
		t.Errorf("degraded detail %q with domain type %s", d, want)
	}

	// What the next Create of a new instance defines (from Check's read).
	got, err := p.createDomainType(ctxT(t))
	if err != nil || got != want {
		t.Fatalf("createDomainType = %q, %v; want %q", got, err, want)
	}
	// A fresh provider decides the same from its own read, as Create does.
	q := openT(t, cfg, testr.New(t))
	if got, err := q.createDomainType(ctxT(t)); err != nil || got != want {
		t.Fatalf("fresh provider: createDomainType = %q, %v; want %q", got, err, want)
	}

	// libvirt accepts (validates and defines) a domain of that type as
	// Create builds it; it is undefined without being started.
	name := domainName("accel"+randSuffix(t), "probe")
	x, err := buildDomainXML(domainParams{
		Name: name, Type: got, VCPUs: 1, MemoryMiB: 128, Pool: cfg.Pool,
		Overlay: overlayVolume(name), Seed: seedVolume(name), Network: "default",
		Meta: instanceMeta{UID: "uid-probe", Entry: "accel", Owner: cfg.Owner, Port: 3128},
	})
	if err != nil {
		t.Fatal(err)
	}
	var defined string
	err = rawLibvirt(t, func(l *libvirt.Libvirt) error {
		dom, err := l.DomainDefineXMLFlags(x, libvirt.DomainDefineValidate)
		if err != nil {
			return err
		}
		defer func() { _ = l.DomainUndefineFlags(dom, 0) }()
		defined, err = l.DomainGetXMLDesc(dom, libvirt.DomainXMLInactive)
		return err
	})
	if err != nil {
		t.Fatalf("define a %s domain: %v", got, err)
	}
	var dx libvirtxml.Domain
	if err := dx.Unmarshal(defined); err != nil || dx.Type != want {
		t.Errorf("defined domain type %q (%v), want %q", dx.Type, err, want)
	}
}

// TestIntegrationAccelerationFallback: with libvirtd started where
// /dev/kvm is /dev/null (teststack.HideKVM), the zero DomainType falls back
// to qemu — Check is reachable but degraded, Create defines a qemu domain —
// and an explicit "kvm" fails Create and Check naming DomainType, leaving
// nothing on the host.
func TestIntegrationAccelerationFallback(t *testing.T) {
	teststack.HideKVM(t)
	e := newLifecycleEnv(t) // after the restart: its network is the new daemon's
	ctx := ctxT(t)

	auto := e.cfg
	auto.DomainType = ""
	p := openT(t, auto, testr.New(t))
	h := checkT(t, p)
	if !h.Reachable || h.Reason != egressproxy.ReasonNone {
		t.Fatalf("Check = %+v, want reachable", h)
	}
	if h.Details[detailDomainType] != domainTypeQEMU || h.Details[detailAcceleration] != "none" ||
		!strings.Contains(h.Details[detailDegraded], "without acceleration") {
		t.Errorf("details %v: want domainType qemu, acceleration none, degraded without acceleration", h.Details)
	}
	t.Logf("degraded: %s", h.Details[detailDegraded])

	// A fresh provider's first Create reads the capabilities itself.
	q := openT(t, auto, testr.New(t))
	spec := egressproxy.Spec{Name: "tcg", UID: "uid-tcg"}
	if _, err := q.Create(ctx, spec); err != nil {
		t.Fatalf("Create: %v", err)
	}
	var defined string
	err := rawLibvirt(t, func(l *libvirt.Libvirt) error {
		dom, err := l.DomainLookupByName(domainName(auto.Entry, spec.Name))
		if err != nil {
			return err
		}
		defined, err = l.DomainGetXMLDesc(dom, 0)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	var dx libvirtxml.Domain
	if err := dx.Unmarshal(defined); err != nil || dx.Type != domainTypeQEMU {
		t.Errorf("Create defined domain type %q (%v), want qemu", dx.Type, err)
	}
	if err := q.Delete(ctx, spec.Ref()); err != nil {
		t.Fatal(err)
	}

	explicit := e.cfg
	explicit.DomainType = domainTypeKVM
	k := openT(t, explicit, testr.New(t))
	_, err = k.Create(ctx, egressproxy.Spec{Name: "kvm", UID: "uid-kvm"})
	var fe *errs.FieldError
	if errs.Code(err) != errs.Permanent || !errors.As(err, &fe) || fe.Field != "DomainType" {
		t.Fatalf("Create with DomainType kvm = %v (code %v), want Permanent naming DomainType", err, errs.Code(err))
	}
	t.Logf("explicit kvm: %v", err)
	AssertInstanceGoneT(t, explicit, "kvm", " after the refused Create")
	if hk := checkT(t, k); hk.Reachable || hk.Reason != egressproxy.ReasonUnknown || !strings.Contains(hk.Message, "DomainType") {
		t.Errorf("Check with DomainType kvm = %+v, want unreachable with a message naming DomainType", hk)
	}
}
