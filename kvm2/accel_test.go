package kvm2

import (
	"context"
	_ "embed"
	"errors"
	"strings"
	"testing"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/testing/libvirtfake"
	"libvirt.org/go/libvirtxml"
)

// The domain capabilities of the real test stack (libvirt 9.0, QEMU 7.2),
// captured with `virsh domcapabilities --arch x86_64`: as it is (the host
// offers KVM), and with /dev/null bound over /dev/kvm and libvirt's
// capabilities cache cleared (it offers only TCG).
var (
	//go:embed testdata/domcaps-kvm.xml
	domcapsKVM string
	//go:embed testdata/domcaps-qemu.xml
	domcapsQEMU string
)

func TestKVMOffered(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name, doc string
		kvm       bool
		err       string
	}{
		{"real stack, KVM offered", domcapsKVM, true, ""},
		{"real stack, /dev/kvm unusable", domcapsQEMU, false, ""},
		{"minimal kvm", "<domainCapabilities><domain>kvm</domain></domainCapabilities>", true, ""},
		{"another type", "<domainCapabilities><domain>hvf</domain></domainCapabilities>", false, ""},
		{"no domain", "<domainCapabilities><arch>x86_64</arch></domainCapabilities>", false, "no domain type"},
		{"not XML", "kvm", false, "parse domain capabilities"},
		{"another document", "<capabilities><domain>kvm</domain></capabilities>", false, "parse domain capabilities"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			kvm, err := kvmOffered(tt.doc)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("kvmOffered = %v, %v; want an error containing %q", kvm, err, tt.err)
				}
				return
			}
			if err != nil || kvm != tt.kvm {
				t.Fatalf("kvmOffered = %v, %v; want %v", kvm, err, tt.kvm)
			}
		})
	}
}

// domainTypeOf returns the type attribute of the fake's domain of name.
func (e *fakeEnv) domainTypeOf(name string) string {
	e.t.Helper()
	d, ok := e.host.Domain(e.dom(name))
	if !ok {
		e.t.Fatalf("domain of %s missing", name)
	}
	var dx libvirtxml.Domain
	if err := dx.Unmarshal(d.XML); err != nil {
		e.t.Fatal(err)
	}
	return dx.Type
}

func (c *fakeImages) ensureCount() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.ensured)
}

func (e *fakeEnv) setDomcaps(doc string) { e.host.SetDomainCapabilities(doc) }

// TestFakeAcceleration: every combination of host (offers KVM or not) and
// Config.DomainType (automatic, "kvm", "qemu") — what Create defines, what
// Check reports, and how often the host is asked.
func TestFakeAcceleration(t *testing.T) {
	ctx := context.Background()
	for _, tt := range []struct {
		name     string
		domcaps  string
		cfgType  string
		want     string // the domain type defined; "" = Create fails naming DomainType
		degraded bool
		asks     int // ConnectGetDomainCapabilities calls of Create then Check
	}{
		{"auto, host offers kvm", domcapsKVM, "", "kvm", false, 2},
		{"auto, host without kvm", domcapsQEMU, "", "qemu", true, 2},
		{"kvm, host offers kvm", domcapsKVM, "kvm", "kvm", false, 2},
		{"kvm, host without kvm", domcapsQEMU, "kvm", "", false, 2},
		{"qemu, host offers kvm", domcapsKVM, "qemu", "qemu", false, 0},
		{"qemu, host without kvm", domcapsQEMU, "qemu", "qemu", false, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := newFakeEnv(t, func(c *Config) { c.DomainType = tt.cfgType })
			e.setDomcaps(tt.domcaps)
			if got := e.p.cfg.DomainType; got != tt.cfgType {
				t.Errorf("Config().DomainType = %q, want %q as configured (\"\" stays automatic)", got, tt.cfgType)
			}
			if n := e.host.Calls(""); n != 0 {
				t.Fatalf("building the provider made %d calls", n)
			}

			_, err := e.p.Create(ctx, fakeSpec("a"))
			if tt.want == "" {
				wantCode(t, "Create", err, errs.Permanent)
				var fe *errs.FieldError
				if !errors.As(err, &fe) || fe.Field != "DomainType" || !strings.Contains(fe.Rule, "does not offer KVM") {
					t.Fatalf("Create error %v: want a FieldError naming DomainType", err)
				}
				if n := e.images.ensureCount(); n != 0 {
					t.Errorf("Create fetched the base %d times before refusing the domain type", n)
				}
				e.onlyBases("after the refused Create")
			} else {
				if err != nil {
					t.Fatalf("Create: %v", err)
				}
				e.hasInstance("a", libvirt.DomainRunning)
				if got := e.domainTypeOf("a"); got != tt.want {
					t.Errorf("domain type %q, want %q", got, tt.want)
				}
			}

			h, err := e.p.Check(ctx)
			if err != nil {
				t.Fatalf("Check: %v", err)
			}
			if tt.want == "" {
				if h.Reachable || h.Reason != egressproxy.ReasonUnknown || !strings.Contains(h.Message, "DomainType") {
					t.Errorf("Check = %+v, want unreachable, reason Unknown, a message naming DomainType", h)
				}
				if h.Details["acceleration"] != "none" || h.Details["hostname"] == "" || h.Details["poolFreeGiB"] == "" {
					t.Errorf("details %v: want acceleration none and the details learnt before", h.Details)
				}
			} else {
				if !h.Reachable || h.Reason != egressproxy.ReasonNone {
					t.Errorf("Check = %+v, want reachable", h)
				}
				accel := "none"
				if tt.want == "kvm" {
					accel = "kvm"
				}
				if h.Details["domainType"] != tt.want || h.Details["acceleration"] != accel {
					t.Errorf("details %v: want domainType %s, acceleration %s", h.Details, tt.want, accel)
				}
			}
			if d, ok := h.Details["degraded"]; ok != tt.degraded || (ok && !strings.Contains(d, "without acceleration")) {
				t.Errorf("degraded detail %q (set %v), want set %v saying guests run without acceleration", d, ok, tt.degraded)
			}
			if n := e.host.Calls("ConnectGetDomainCapabilities"); n != tt.asks {
				t.Errorf("%d capability reads, want %d", n, tt.asks)
			}
			for _, c := range e.host.Log() {
				// The guests' architecture, libvirt's default domain type.
				if c.Method == "ConnectGetDomainCapabilities" && c.Args != `emulator=[] arch=["x86_64"] machine=[] virttype=[] flags=0` {
					t.Errorf("capabilities asked with %s", c.Args)
				}
			}
		})
	}
}

// TestFakeAccelerationCache: the host's answer is read once by Create and
// kept; a Check re-reads it and the next Create follows; a Create of an
// instance that exists asks nothing.
func TestFakeAccelerationCache(t *testing.T) {
	ctx := context.Background()
	e := newFakeEnv(t)
	asks := func() int { return e.host.Calls("ConnectGetDomainCapabilities") }
	for _, n := range []string{"a", "b"} {
		if _, err := e.p.Create(ctx, fakeSpec(n)); err != nil {
			t.Fatal(err)
		}
		if got := e.domainTypeOf(n); got != "kvm" {
			t.Fatalf("%s: domain type %q, want kvm", n, got)
		}
	}
	if asks() != 1 {
		t.Fatalf("two Creates read the capabilities %d times, want once", asks())
	}

	// The host loses KVM: Create keeps what it learnt until a Check.
	e.setDomcaps(domcapsQEMU)
	if _, err := e.p.Create(ctx, fakeSpec("c")); err != nil {
		t.Fatal(err)
	}
	if got := e.domainTypeOf("c"); got != "kvm" {
		t.Errorf("c: domain type %q, want kvm (cached)", got)
	}
	h, err := e.p.Check(ctx)
	if err != nil || !h.Reachable || h.Details["degraded"] == "" || h.Details["domainType"] != "qemu" {
		t.Fatalf("Check = %+v, %v; want reachable, degraded, domainType qemu", h, err)
	}
	if _, err := e.p.Create(ctx, fakeSpec("d")); err != nil {
		t.Fatal(err)
	}
	if got := e.domainTypeOf("d"); got != "qemu" {
		t.Errorf("d: domain type %q after the Check, want qemu", got)
	}
	if asks() != 2 {
		t.Errorf("%d capability reads, want 2 (one Create, one Check)", asks())
	}

	// A provider that knows nothing yet (as a fresh one of the entry)
	// returns the existing instance without asking the host.
	e.p.accel.mu.Lock()
	e.p.accel.known = false
	e.p.accel.mu.Unlock()
	if _, err := e.p.Create(ctx, fakeSpec("a")); err != nil {
		t.Fatal(err)
	}
	if asks() != 2 {
		t.Errorf("a Create of an existing instance read the capabilities (%d reads)", asks())
	}
}

// TestFakeAccelerationReadFails: a failed capabilities read fails Create
// with its class before anything is made (a retry then works), and fails
// Check with its reason, keeping the details learnt before.
func TestFakeAccelerationReadFails(t *testing.T) {
	ctx := context.Background()
	for _, tt := range []struct {
		name   string
		err    error
		doc    string
		code   errs.ErrorCode
		reason egressproxy.HealthReason
	}{
		{"link dies", libvirt.ErrInterrupted, "", errs.Transient, egressproxy.ReasonUnreachable},
		{"access denied", libvirtfake.Errorf(libvirt.ErrAccessDenied, "access denied"), "", errs.Permanent, egressproxy.ReasonForbidden},
		{"not a capabilities document", nil, "<capabilities/>", errs.Transient, egressproxy.ReasonUnknown},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := newFakeEnv(t)
			if tt.err != nil {
				e.host.SetHook("ConnectGetDomainCapabilities", libvirtfake.Fail(tt.err))
			} else {
				e.setDomcaps(tt.doc)
			}
			_, err := e.p.Create(ctx, fakeSpec("a"))
			wantCode(t, "Create", err, tt.code)
			if !strings.Contains(err.Error(), "domain capabilities") {
				t.Errorf("Create error %q does not say what failed", err)
			}
			if e.images.ensureCount() != 0 {
				t.Error("Create fetched the base although the domain type is unknown")
			}
			e.onlyBases("after the failed Create")

			h, err := e.p.Check(ctx)
			if err != nil || h.Reachable || h.Reason != tt.reason || h.Details["poolFreeGiB"] == "" || h.Details["domainType"] != "" {
				t.Errorf("Check = %+v, %v; want reason %s, pool details kept, no domainType", h, err, tt.reason)
			}

			e.host.ClearHooks()
			e.setDomcaps(domcapsKVM)
			if _, err := e.p.Create(ctx, fakeSpec("a")); err != nil {
				t.Fatalf("retried Create: %v", err)
			}
			if got := e.domainTypeOf("a"); got != "kvm" {
				t.Errorf("domain type %q, want kvm", got)
			}
		})
	}
}
