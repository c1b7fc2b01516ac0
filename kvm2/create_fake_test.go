package kvm2

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/basecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
	"github.com/egressproxy/egressproxy/internal/testing/libvirtfake"
)

// Create, Get, List, Delete and Check on the in-memory libvirt
// (internal/testing/libvirtfake): what the calls leave on the "host" and
// how their errors are classed.

func fakeSpec(name string) egressproxy.Spec {
	return egressproxy.Spec{Name: name, UID: "uid-" + name, UserData: "#cloud-config\nhostname: " + name + "\n"}
}

func wantCode(t *testing.T, what string, err error, want errs.ErrorCode) {
	t.Helper()
	if got := errs.Code(err); got != want {
		t.Fatalf("%s: code %v, want %v (err: %v)", what, got, want, err)
	}
}

// onlyBases fails t unless the fake holds no domain and only base volumes.
func (e *fakeEnv) onlyBases(when string) {
	e.t.Helper()
	if d := e.host.DomainNames(); len(d) != 0 {
		e.t.Errorf("%s: domains left: %v", when, d)
	}
	for _, v := range e.host.VolumeNames(e.cfg.Pool) {
		if !strings.HasPrefix(v, "base-") {
			e.t.Errorf("%s: volume left: %s (all: %v)", when, v, e.host.VolumeNames(e.cfg.Pool))
		}
	}
}

// hasInstance fails t unless the fake holds name's domain in state st with
// its overlay (backed by the base) and its seed.
func (e *fakeEnv) hasInstance(name string, st libvirt.DomainState) libvirtfake.Domain {
	e.t.Helper()
	dn := e.dom(name)
	d, ok := e.host.Domain(dn)
	if !ok {
		e.t.Fatalf("domain %s missing (domains %v)", dn, e.host.DomainNames())
	}
	if d.State != st {
		e.t.Errorf("domain %s state %v, want %v", dn, d.State, st)
	}
	ov, ok := e.host.Volume(e.cfg.Pool, overlayVolume(dn))
	if !ok {
		e.t.Fatalf("overlay of %s missing (volumes %v)", dn, e.host.VolumeNames(e.cfg.Pool))
	}
	base, _ := e.host.Volume(e.cfg.Pool, basecache.BaseName(e.cfg.Entry, "tiny", "qcow2"))
	if base.Path == "" || ov.BackingPath != base.Path || ov.Format != "qcow2" {
		e.t.Errorf("overlay %+v: want qcow2 backed by the base", ov)
	}
	if _, ok := e.host.Volume(e.cfg.Pool, seedVolume(dn)); !ok {
		e.t.Fatalf("seed of %s missing", dn)
	}
	return d
}

func TestFakeCreateFresh(t *testing.T) {
	e := newFakeEnv(t)
	ctx := context.Background()
	spec := fakeSpec("a")
	inst, err := e.p.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if inst.Ref != spec.Ref() || inst.State != egressproxy.StateProvisioning || inst.Port != naming.DefaultPort ||
		inst.SpecDigest != spec.Digest() || inst.CreatedAt.IsZero() || inst.IP != "" {
		t.Errorf("instance %+v", inst)
	}
	d := e.hasInstance("a", libvirt.DomainRunning)
	meta, err := parseMetadata(d.XML)
	if err != nil || meta.UID != spec.UID || meta.Entry != e.cfg.Entry || meta.Owner != e.cfg.Owner ||
		meta.SpecDigest != spec.Digest() || !meta.Created.Equal(inst.CreatedAt) {
		t.Errorf("metadata %+v (%v)", meta, err)
	}
	seed, _ := e.host.Volume(e.cfg.Pool, seedVolume(e.dom("a")))
	if uint64(len(seed.Data)) != seed.Capacity {
		t.Errorf("seed holds %d bytes, capacity %d", len(seed.Data), seed.Capacity)
	}
	label, files := readSeed(t, seed.Data)
	if label != seedLabel || files["user-data"] != spec.UserData || !strings.Contains(files["meta-data"], spec.UID) {
		t.Errorf("seed %q %v", label, files)
	}
	if got := e.images.ensured; len(got) != 1 || got[0] != "tiny" {
		t.Errorf("images ensured: %v", got)
	}
	for op, n := range map[string]int{"StorageVolCreateXML": 2, "StorageVolUpload": 1, "DomainDefineXMLFlags": 1, "DomainCreate": 1, "StorageVolDelete": 0} {
		if got := e.host.Calls(op); got != n {
			t.Errorf("%s called %d times, want %d", op, got, n)
		}
	}

	// Read back: no address yet, then the DHCP lease's.
	got, err := e.p.Get(ctx, spec.Ref())
	if err != nil || got.State != egressproxy.StateProvisioning || got.IP != "" || !got.CreatedAt.Equal(inst.CreatedAt) {
		t.Errorf("Get before lease: %+v, %v", got, err)
	}
	e.host.SetLease(d.MAC, "192.0.2.10")
	got, err = e.p.Get(ctx, spec.Ref())
	if err != nil || got.State != egressproxy.StateRunning || got.IP != "192.0.2.10" || got.AddressSource != SourceLease {
		t.Errorf("Get with lease: %+v, %v", got, err)
	}
}

// TestFakeCreateAgain: Create of an existing instance returns it as it is:
// nothing is made, the base is not ensured again, a stopped instance stays
// stopped.
func TestFakeCreateAgain(t *testing.T) {
	e := newFakeEnv(t)
	ctx := context.Background()
	spec := fakeSpec("a")
	first, err := e.p.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	e.host.UpdateDomain(e.dom("a"), func(d *libvirtfake.Domain) { d.AgentAddress = "192.0.2.20" })
	e.host.ResetCalls()
	again, err := e.p.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	if !again.CreatedAt.Equal(first.CreatedAt) || again.State != egressproxy.StateRunning || again.IP != "192.0.2.20" || again.AddressSource != SourceAgent {
		t.Errorf("again: %+v, first %+v", again, first)
	}
	for _, op := range []string{"StorageVolCreateXML", "DomainDefineXMLFlags", "DomainCreate", "StorageVolUpload"} {
		if n := e.host.Calls(op); n != 0 {
			t.Errorf("%s called %d times by a Create of an existing instance", op, n)
		}
	}
	if len(e.images.ensured) != 1 {
		t.Errorf("base ensured again: %v", e.images.ensured)
	}

	// The address is best-effort for an existing instance: every source
	// failing still returns it (without an address).
	e.host.SetHook("DomainInterfaceAddresses", libvirtfake.Fail(libvirtfake.Errorf(libvirt.ErrInternalError, "internal error")))
	again, err = e.p.Create(ctx, spec)
	if err != nil || again.IP != "" || again.State != egressproxy.StateProvisioning {
		t.Errorf("address failing: %+v, %v", again, err)
	}
	e.host.ClearHooks()

	// Stopped on purpose (shut down): left as it is.
	e.host.UpdateDomain(e.dom("a"), func(d *libvirtfake.Domain) {
		d.State, d.Reason = libvirt.DomainShutoff, int32(libvirt.DomainShutoffShutdown)
	})
	again, err = e.p.Create(ctx, spec)
	if err != nil || again.State != egressproxy.StateStopped {
		t.Errorf("stopped: %+v, %v", again, err)
	}
	if n := e.host.Calls("DomainCreate"); n != 0 {
		t.Errorf("a stopped instance was started")
	}
}

// TestFakeCreateCompletesDefined: a Create interrupted after the define
// (the start's reply lost) leaves everything in place; the next Create
// recreates a volume that went missing meanwhile and starts the domain,
// keeping the first call's metadata.
func TestFakeCreateCompletesDefined(t *testing.T) {
	e := newFakeEnv(t)
	ctx := context.Background()
	spec := fakeSpec("a")
	e.host.SetHook("DomainCreate", libvirtfake.Fail(libvirt.ErrInterrupted))
	_, err := e.p.Create(ctx, spec)
	wantCode(t, "start interrupted", err, errs.Transient)
	d := e.hasInstance("a", libvirt.DomainShutoff)
	if !neverRan(d.State, d.Reason) {
		t.Fatalf("state %v reason %v", d.State, d.Reason)
	}
	meta, _ := parseMetadata(d.XML)

	e.host.ClearHooks()
	e.host.RemoveVolume(e.cfg.Pool, seedVolume(e.dom("a")))
	e.host.ResetCalls()
	inst, err := e.p.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	e.hasInstance("a", libvirt.DomainRunning)
	if !inst.CreatedAt.Equal(meta.Created) || inst.State != egressproxy.StateProvisioning {
		t.Errorf("instance %+v, want the defined domain's creation time %v", inst, meta.Created)
	}
	if n := e.host.Calls("StorageVolCreateXML"); n != 1 {
		t.Errorf("%d volumes created, want the missing seed only", n)
	}
	if n := e.host.Calls("DomainDefineXMLFlags"); n != 0 {
		t.Errorf("domain defined again")
	}
	seed, _ := e.host.Volume(e.cfg.Pool, seedVolume(e.dom("a")))
	if _, files := readSeed(t, seed.Data); files["user-data"] != spec.UserData {
		t.Errorf("recreated seed: %v", files)
	}

	// The overlay missing instead: recreated too.
	e2 := newFakeEnv(t)
	e2.host.SetHook("DomainCreate", libvirtfake.Fail(libvirt.ErrInterrupted))
	if _, err := e2.p.Create(ctx, spec); err == nil {
		t.Fatal("want the interrupted start's error")
	}
	e2.host.ClearHooks()
	e2.host.RemoveVolume(e2.cfg.Pool, overlayVolume(e2.dom("a")))
	if _, err := e2.p.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	e2.hasInstance("a", libvirt.DomainRunning)
}

// TestFakeCreateDefineReplyLost: the define took effect but its reply was
// lost: nothing is removed, and the retry converges on the domain.
func TestFakeCreateDefineReplyLost(t *testing.T) {
	e := newFakeEnv(t)
	ctx := context.Background()
	spec := fakeSpec("a")
	e.host.SetReplyHook("DomainDefineXMLFlags", libvirtfake.Fail(libvirt.ErrInterrupted))
	_, err := e.p.Create(ctx, spec)
	wantCode(t, "define reply lost", err, errs.Transient)
	e.hasInstance("a", libvirt.DomainShutoff)
	e.host.ClearHooks()
	if _, err := e.p.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	e.hasInstance("a", libvirt.DomainRunning)
	if n := e.host.Calls("StorageVolDelete"); n != 0 {
		t.Errorf("%d volumes deleted", n)
	}
}

// TestFakeCreateReusesLeftovers: volumes left by an interrupted Create are
// reused (the overlay when backed by the base, the seed when of the same
// size) or replaced (a seed of another size); an overlay backed by anything
// else is refused and left alone.
func TestFakeCreateReusesLeftovers(t *testing.T) {
	ctx := context.Background()
	spec := fakeSpec("a")
	leftovers := func(t *testing.T) *fakeEnv {
		e := newFakeEnv(t)
		e.host.SetHook("DomainDefineXMLFlags", libvirtfake.Fail(libvirt.ErrInterrupted))
		_, err := e.p.Create(ctx, spec)
		wantCode(t, "define interrupted", err, errs.Transient)
		if len(e.host.DomainNames()) != 0 || len(e.host.VolumeNames(e.cfg.Pool)) != 3 {
			t.Fatalf("want overlay and seed left, no domain: %v %v", e.host.DomainNames(), e.host.VolumeNames(e.cfg.Pool))
		}
		e.host.ClearHooks()
		e.host.ResetCalls()
		return e
	}

	t.Run("same spec", func(t *testing.T) {
		e := leftovers(t)
		if _, err := e.p.Create(ctx, spec); err != nil {
			t.Fatal(err)
		}
		e.hasInstance("a", libvirt.DomainRunning)
		if n := e.host.Calls("StorageVolDelete"); n != 0 {
			t.Errorf("%d volumes deleted", n)
		}
		if n := e.host.Calls("StorageVolUpload"); n != 1 {
			t.Errorf("seed uploaded %d times, want again once", n)
		}
	})

	t.Run("seed of another size", func(t *testing.T) {
		e := leftovers(t)
		big := spec
		big.UserData = "#cloud-config\n# " + strings.Repeat("x", 40000) + "\n"
		if _, err := e.p.Create(ctx, big); err != nil {
			t.Fatal(err)
		}
		e.hasInstance("a", libvirt.DomainRunning)
		seed, _ := e.host.Volume(e.cfg.Pool, seedVolume(e.dom("a")))
		if _, files := readSeed(t, seed.Data); files["user-data"] != big.UserData {
			t.Error("seed not replaced")
		}
		if n := e.host.Calls("StorageVolDelete"); n != 1 {
			t.Errorf("%d volumes deleted, want the old seed", n)
		}
	})

	t.Run("seed of another size, domain defined meanwhile", func(t *testing.T) {
		e := leftovers(t)
		big := spec
		big.UserData = "#cloud-config\n# " + strings.Repeat("x", 40000) + "\n"
		// Another call defines the domain right after our overlay step.
		var once sync.Once
		e.host.SetHook("StorageVolGetInfo", func(libvirtfake.Call) error {
			once.Do(func() { e.defineXML(t, otherDomainXML(t, e, "a", spec.UID)) })
			return nil
		})
		_, err := e.p.Create(ctx, big)
		wantCode(t, "domain appeared", err, errs.Transient)
		if n := e.host.Calls("StorageVolDelete"); n != 0 {
			t.Errorf("%d volumes deleted while a domain of their name exists", n)
		}
	})

	// An overlay backed by another base, with no domain of its name, is
	// what a Create of this name with another image leaves when its
	// process is killed before the define (the chaos soak's SIGKILLed
	// driver, whose proxy then changed image): Create replaces it, as
	// Delete would remove it, instead of refusing it Permanent (which left
	// the name blocked until someone deleted it by hand).
	t.Run("overlay backed by another base", func(t *testing.T) {
		e := leftovers(t)
		e.putVolume(libvirtfake.Volume{Name: "other-base.qcow2", Capacity: 1 << 20})
		other, _ := e.host.Volume(e.cfg.Pool, "other-base.qcow2")
		e.putVolume(libvirtfake.Volume{Name: overlayVolume(e.dom("a")), Format: "qcow2", BackingPath: other.Path})
		if _, err := e.p.Create(ctx, spec); err != nil {
			t.Fatalf("Create over a leftover overlay of another base: %v", err)
		}
		e.hasInstance("a", libvirt.DomainRunning) // its overlay backed by our base
		if n := e.host.Calls("StorageVolDelete"); n != 1 {
			t.Errorf("%d volumes deleted, want the leftover overlay", n)
		}
		if _, ok := e.host.Volume(e.cfg.Pool, "other-base.qcow2"); !ok {
			t.Error("the other base was removed")
		}
	})

	t.Run("overlay backed by another base, domain defined meanwhile", func(t *testing.T) {
		e := leftovers(t)
		e.putVolume(libvirtfake.Volume{Name: "other-base.qcow2", Capacity: 1 << 20})
		other, _ := e.host.Volume(e.cfg.Pool, "other-base.qcow2")
		e.putVolume(libvirtfake.Volume{Name: overlayVolume(e.dom("a")), Format: "qcow2", BackingPath: other.Path})
		// Another call defines the domain right after our read of the
		// overlay.
		var once sync.Once
		e.host.SetReplyHook("StorageVolGetXMLDesc", func(libvirtfake.Call) error {
			once.Do(func() { e.defineXML(t, otherDomainXML(t, e, "a", "uid-other")) })
			return nil
		})
		_, err := e.p.Create(ctx, spec)
		wantCode(t, "domain appeared", err, errs.Transient)
		if n := e.host.Calls("StorageVolDelete"); n != 0 {
			t.Errorf("%d volumes deleted while a domain of their name exists", n)
		}
		if ov, ok := e.host.Volume(e.cfg.Pool, overlayVolume(e.dom("a"))); !ok || ov.BackingPath != other.Path {
			t.Errorf("the overlay of the defined domain changed: %+v", ov)
		}
	})

	t.Run("overlay unreadable", func(t *testing.T) {
		e := leftovers(t)
		e.host.SetHook("StorageVolGetXMLDesc", libvirtfake.Fail(libvirtfake.Errorf(libvirt.ErrInternalError, "internal error: cannot read")))
		_, err := e.p.Create(ctx, spec)
		wantCode(t, "overlay unreadable", err, errs.Transient)
	})

	t.Run("overlay vanished", func(t *testing.T) {
		e := leftovers(t)
		e.host.SetHook("StorageVolLookupByName", libvirtfake.Named(overlayVolume(e.dom("a")),
			libvirtfake.Fail(libvirtfake.Errorf(libvirt.ErrNoStorageVol, "Storage volume not found: no storage vol with matching name"))))
		_, err := e.p.Create(ctx, spec)
		wantCode(t, "overlay vanished", err, errs.Transient) // raced: a retry converges
	})

	t.Run("seed busy, then free", func(t *testing.T) {
		e := leftovers(t)
		var mu sync.Mutex
		busy := 2
		e.host.SetHook("StorageVolUpload", func(c libvirtfake.Call) error {
			mu.Lock()
			defer mu.Unlock()
			if busy > 0 {
				busy--
				return libvirtfake.Errorf(libvirt.ErrOperationInvalid, "Requested operation is not valid: volume '%s' is still being allocated.", c.Name())
			}
			return nil
		})
		if _, err := e.p.Create(ctx, spec); err != nil {
			t.Fatal(err)
		}
		if n := e.host.Calls("StorageVolUpload"); n != 3 {
			t.Errorf("%d uploads, want 3 (two busy)", n)
		}
	})
}

// otherDomainXML is the domain XML another Create of name (with uid) would
// define.
func otherDomainXML(t *testing.T, e *fakeEnv, name, uid string) string {
	t.Helper()
	spec := fakeSpec(name)
	spec.UID = uid
	x, err := buildDomainXML(domainParams{
		Name: e.dom(name), VCPUs: 1, MemoryMiB: 512, Pool: e.cfg.Pool,
		Overlay: overlayVolume(e.dom(name)), Seed: seedVolume(e.dom(name)), Network: e.cfg.Network,
		Meta: instanceMeta{UID: uid, Created: time.Now().UTC().Truncate(time.Millisecond), Entry: e.cfg.Entry, Owner: e.cfg.Owner, Port: spec.EffectivePort(), SpecDigest: spec.Digest()},
	})
	if err != nil {
		t.Fatal(err)
	}
	return x
}

// TestFakeCreateRaces: a define or start by another call in the middle of
// this Create is converged on; a domain of another UID defined meanwhile is
// Permanent and keeps the volumes (a domain of their name exists).
func TestFakeCreateRaces(t *testing.T) {
	ctx := context.Background()
	spec := fakeSpec("a")
	onceBefore := func(e *fakeEnv, op string, f func()) {
		var once sync.Once
		e.host.SetHook(op, func(libvirtfake.Call) error {
			once.Do(f)
			return nil
		})
	}

	t.Run("defined by a replica", func(t *testing.T) {
		e := newFakeEnv(t)
		onceBefore(e, "DomainDefineXMLFlags", func() { e.defineXML(t, otherDomainXML(t, e, "a", spec.UID)) })
		if _, err := e.p.Create(ctx, spec); err != nil {
			t.Fatal(err)
		}
		e.hasInstance("a", libvirt.DomainRunning)
	})

	t.Run("defined by another UID", func(t *testing.T) {
		e := newFakeEnv(t)
		onceBefore(e, "DomainDefineXMLFlags", func() { e.defineXML(t, otherDomainXML(t, e, "a", "someone-else")) })
		_, err := e.p.Create(ctx, spec)
		wantCode(t, "name taken meanwhile", err, errs.Permanent)
		d := e.hasInstance("a", libvirt.DomainShutoff) // its volumes stay: a domain of their name exists
		if m, _ := parseMetadata(d.XML); m.UID != "someone-else" {
			t.Errorf("the other domain changed: %+v", m)
		}
	})

	t.Run("started by a replica", func(t *testing.T) {
		e := newFakeEnv(t)
		onceBefore(e, "DomainCreate", func() {
			if err := e.host.StartDomain(e.dom("a")); err != nil {
				t.Error(err)
			}
		})
		if _, err := e.p.Create(ctx, spec); err != nil {
			t.Fatal(err)
		}
		e.hasInstance("a", libvirt.DomainRunning)
	})
}

// TestFakeCreateStepFailures: a step libvirt refuses fails the Create with
// the class of libvirt's answer, and what the call made is removed.
func TestFakeCreateStepFailures(t *testing.T) {
	ctx := context.Background()
	spec := fakeSpec("a")
	dn := domainName("lab-1", "a")
	internal := libvirtfake.Errorf(libvirt.ErrInternalError, "internal error: something broke")
	for _, tc := range []struct {
		name     string
		op, on   string
		err      error
		want     errs.ErrorCode
		contains string
	}{
		{"pool lookup", "StoragePoolLookupByName", "", internal, errs.Transient, "look up pool"},
		{"pool missing", "StoragePoolLookupByName", "",
			libvirtfake.Errorf(libvirt.ErrNoStoragePool, "Storage pool not found: no storage pool with matching name 'default'"),
			errs.Code(classify(lverr(libvirt.ErrNoStoragePool))), "look up pool"},
		{"overlay", "StorageVolCreateXML", overlayVolume(dn), internal, errs.Transient, "create overlay"},
		{"seed", "StorageVolCreateXML", seedVolume(dn), internal, errs.Transient, "create seed volume"},
		{"upload", "StorageVolUpload", "", internal, errs.Transient, "upload seed"},
		{"define refused", "DomainDefineXMLFlags", "", libvirtfake.Errorf(libvirt.ErrXMLError, "XML error: bad"), errs.Permanent, "define domain"},
		{"start: no network", "DomainCreate", "", libvirtfake.Errorf(libvirt.ErrNoNetwork, "Network not found: no network with matching name 'default'"), errs.Permanent, "start domain"},
		{"start failed", "DomainCreate", "", libvirtfake.Errorf(libvirt.ErrOperationFailed, "operation failed: qemu exited"), errs.Transient, "start domain"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newFakeEnv(t)
			hook := libvirtfake.Fail(tc.err)
			if tc.on != "" {
				hook = libvirtfake.Named(tc.on, hook)
			}
			e.host.SetHook(tc.op, hook)
			_, err := e.p.Create(ctx, spec)
			wantCode(t, tc.name, err, tc.want)
			// The backend names its entry and the failed step; the client
			// adds the operation and instance (errors wrap once).
			if !strings.Contains(err.Error(), tc.contains) || !strings.HasPrefix(err.Error(), "kvm2 "+e.cfg.Entry+": ") {
				t.Errorf("err %q: want the entry and %q", err, tc.contains)
			}
			if strings.Contains(err.Error(), "hostname: a") {
				t.Errorf("err %q shows user-data", err)
			}
			e.onlyBases("after " + tc.name)
			// A retry converges once the cause is gone.
			e.host.ClearHooks()
			if _, err := e.p.Create(ctx, spec); err != nil {
				t.Fatalf("retry: %v", err)
			}
			e.hasInstance("a", libvirt.DomainRunning)
		})
	}
}

// TestFakeCreateUndoFails: what the failed undo could not remove stays under
// the instance's names (never a volume while its domain stays); Delete
// removes it.
func TestFakeCreateUndoFails(t *testing.T) {
	e := newFakeEnv(t)
	ctx := context.Background()
	spec := fakeSpec("a")
	e.host.SetHook("DomainCreate", libvirtfake.Fail(libvirtfake.Errorf(libvirt.ErrNoNetwork, "Network not found")))
	e.host.SetHook("DomainUndefineFlags", libvirtfake.Fail(libvirtfake.Errorf(libvirt.ErrInternalError, "internal error: undefine")))
	_, err := e.p.Create(ctx, spec)
	wantCode(t, "start", err, errs.Permanent)
	e.hasInstance("a", libvirt.DomainShutoff)
	e.host.ClearHooks()
	if err := e.p.Delete(ctx, spec.Ref()); err != nil {
		t.Fatal(err)
	}
	e.onlyBases("after Delete")
}

func TestFakeCreateRefusals(t *testing.T) {
	ctx := context.Background()
	spec := fakeSpec("a")

	t.Run("spec conflict", func(t *testing.T) {
		e := newFakeEnv(t)
		if _, err := e.p.Create(ctx, spec); err != nil {
			t.Fatal(err)
		}
		before, _ := e.host.Domain(e.dom("a"))
		e.host.ResetCalls()
		other := spec
		other.UserData = "#cloud-config\nsecret: s3cr3t\n"
		_, err := e.p.Create(ctx, other)
		wantCode(t, "spec conflict", err, errs.Permanent)
		if !errors.Is(err, errs.ErrSpecConflict) || strings.Contains(err.Error(), "s3cr3t") {
			t.Errorf("err %v: want ErrSpecConflict without user-data", err)
		}
		after, _ := e.host.Domain(e.dom("a"))
		if after.XML != before.XML || e.host.Calls("StorageVolCreateXML")+e.host.Calls("DomainDefineXMLFlags")+e.host.Calls("StorageVolDelete") != 0 {
			t.Error("a spec conflict changed the host")
		}
	})

	t.Run("name taken by a domain without our metadata", func(t *testing.T) {
		e := newFakeEnv(t)
		e.defineXML(t, "<domain type='kvm'><name>"+e.dom("a")+"</name><memory>1024</memory></domain>")
		_, err := e.p.Create(ctx, spec)
		wantCode(t, "name taken", err, errs.Permanent)
		if errors.Is(err, errs.ErrSpecConflict) || !strings.Contains(err.Error(), "the name is taken") {
			t.Errorf("err %v", err)
		}
		if n := e.host.Calls("StorageVolCreateXML"); n != 0 {
			t.Errorf("%d volumes created", n)
		}
	})

	t.Run("image key unknown", func(t *testing.T) {
		e := newFakeEnv(t)
		s := spec
		s.ImageKey = "nope"
		_, err := e.p.Create(ctx, s)
		wantCode(t, "unknown image", err, errs.Permanent)
		var fe *errs.FieldError
		if !errors.As(err, &fe) || fe.Field != "ImageKey" {
			t.Errorf("err %v: want a FieldError on ImageKey", err)
		}
		if n := e.host.Calls(""); n != 0 || len(e.images.ensured) != 0 {
			t.Errorf("bad input touched the host: %d calls, ensured %v", n, e.images.ensured)
		}
	})

	t.Run("no image configured", func(t *testing.T) {
		e := newFakeEnv(t, func(c *Config) { c.Images = nil })
		_, err := e.p.Create(ctx, spec)
		wantCode(t, "no images", err, errs.Permanent)
		if !strings.Contains(err.Error(), "Config.Images is empty") || e.host.Calls("") != 0 {
			t.Errorf("err %v", err)
		}
	})

	for _, tc := range []struct {
		name string
		err  error
		want errs.ErrorCode
	}{
		{"image fetch failed", errs.Errorf(errs.Transient, "imagecache: mirror answered 503"), errs.Transient},
		{"image digest differs", errs.Errorf(errs.Permanent, "imagecache: digest differs"), errs.Permanent},
		{"image unclassed error", errors.New("imagecache: surprise"), errs.Transient},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newFakeEnv(t)
			e.images.setErr(tc.err)
			_, err := e.p.Create(ctx, spec)
			wantCode(t, tc.name, err, tc.want)
			if !strings.HasPrefix(err.Error(), "kvm2 "+e.cfg.Entry+": base image: ") {
				t.Errorf("err %v", err)
			}
			e.onlyBases(tc.name)
		})
	}

	t.Run("lookup fails", func(t *testing.T) {
		e := newFakeEnv(t)
		e.host.SetHook("DomainLookupByName", libvirtfake.Fail(libvirtfake.Errorf(libvirt.ErrInternalError, "internal error")))
		_, err := e.p.Create(ctx, spec)
		wantCode(t, "lookup", err, errs.Transient)
		if len(e.images.ensured) != 0 {
			t.Error("went on after the lookup failed")
		}
	})
}

// TestFakeCreateContext: a Create whose context ends, or whose provider is
// closed, while a call is in flight returns at once with that class and
// removes nothing; the abandoned call stops before its next RPC; the retry
// converges.
func TestFakeCreateContext(t *testing.T) {
	spec := fakeSpec("a")

	t.Run("cancelled before", func(t *testing.T) {
		e := newFakeEnv(t)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_, err := e.p.Create(ctx, spec)
		wantCode(t, "cancelled", err, errs.Canceled)
		if n := e.host.Calls(""); n != 0 {
			t.Errorf("%d calls with a cancelled context", n)
		}
	})

	for _, tc := range []struct {
		name string
		end  func(cancel context.CancelFunc, e *fakeEnv)
		ctx  func() (context.Context, context.CancelFunc)
		want errs.ErrorCode
		mod  func(*Config)
	}{
		{"cancelled during define", func(cancel context.CancelFunc, e *fakeEnv) { cancel() },
			func() (context.Context, context.CancelFunc) { return context.WithCancel(context.Background()) }, errs.Canceled, nil},
		{"deadline during define", nil,
			func() (context.Context, context.CancelFunc) {
				return context.WithTimeout(context.Background(), 500*time.Millisecond)
			}, errs.DeadlineExceeded, nil},
		// No deadline of the caller's: the entry's CallTimeout ends the
		// call, which is Transient, not the caller's DeadlineExceeded.
		{"CallTimeout during define", nil,
			func() (context.Context, context.CancelFunc) { return context.WithCancel(context.Background()) },
			errs.Transient, func(c *Config) { c.CallTimeout = 300 * time.Millisecond }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var mods []func(*Config)
			if tc.mod != nil {
				mods = append(mods, tc.mod)
			}
			e := newFakeEnv(t, mods...)
			pause := libvirtfake.NewPause()
			e.host.SetHook("DomainDefineXMLFlags", pause.Hook)
			ctx, cancel := tc.ctx()
			defer cancel()
			go func() {
				select {
				case <-pause.Entered():
					if tc.end != nil {
						tc.end(cancel, e)
					}
				case <-ctx.Done():
				}
			}()
			_, err := e.p.Create(ctx, spec)
			wantCode(t, tc.name, err, tc.want)
			pause.Release()
			e.host.Wait() // the abandoned call completes its define and stops
			if n := e.host.Calls("DomainCreate"); n != 0 {
				t.Errorf("the abandoned call went on to start the domain")
			}
			if n := e.host.Calls("StorageVolDelete"); n != 0 {
				t.Errorf("an interrupted Create removed %d volumes", n)
			}
			e.hasInstance("a", libvirt.DomainShutoff)
			if _, err := e.p.Create(context.Background(), spec); err != nil {
				t.Fatal(err)
			}
			e.hasInstance("a", libvirt.DomainRunning)
		})
	}

	t.Run("closed during upload", func(t *testing.T) {
		e := newFakeEnv(t)
		pause := libvirtfake.NewPause()
		e.host.SetHook("StorageVolUpload", pause.Hook)
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-pause.Entered()
			if err := e.p.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
		}()
		_, err := e.p.Create(context.Background(), spec)
		wg.Wait()
		wantCode(t, "closed", err, errs.Permanent)
		if !errors.Is(err, errs.ErrClosed) {
			t.Errorf("err %v: want ErrClosed", err)
		}
		if n := e.host.Calls("StorageVolDelete"); n != 0 {
			t.Errorf("a Create interrupted by Close removed %d volumes", n)
		}
		if e.images.closeCount() != 1 || e.link.closeCount() != 1 {
			t.Errorf("Close closed images %d, session %d times", e.images.closeCount(), e.link.closeCount())
		}
	})

	t.Run("cancelled while waiting for the name", func(t *testing.T) {
		e := newFakeEnv(t)
		pause := libvirtfake.NewPause()
		e.host.SetHook("DomainCreate", pause.Hook)
		done := make(chan error, 1)
		go func() { _, err := e.p.Create(context.Background(), spec); done <- err }()
		select {
		case <-pause.Entered():
		case err := <-done:
			t.Fatalf("the first Create never reached its start: %v", err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		// The name is held by the first Create: the second waits for it
		// and gives up with its context.
		_, err := e.p.Create(ctx, spec)
		wantCode(t, "second", err, errs.Canceled)
		pause.Release()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	})

	t.Run("image wait cancelled", func(t *testing.T) {
		e := newFakeEnv(t)
		e.images.block, e.images.entered = make(chan struct{}), make(chan struct{})
		ctx, cancel := context.WithCancel(context.Background())
		go func() { <-e.images.entered; cancel() }()
		_, err := e.p.Create(ctx, spec)
		wantCode(t, "image wait", err, errs.Canceled)
		e.onlyBases("image wait")
	})
}

// createScenarios set up a fake host on which Create of fakeSpec("a") (or
// bigSpec, with a seed of another size) takes one of its paths.
var createScenarios = []struct {
	name  string
	big   bool
	setup func(t *testing.T, e *fakeEnv)
}{
	{"fresh", false, func(t *testing.T, e *fakeEnv) {}},
	{"leftovers reused", false, leaveVolumes},
	{"leftover seed replaced", true, leaveVolumes},
	{"defined, seed missing", false, func(t *testing.T, e *fakeEnv) {
		e.host.SetHook("DomainCreate", libvirtfake.Fail(libvirt.ErrInterrupted))
		if _, err := e.p.Create(context.Background(), fakeSpec("a")); err == nil {
			t.Fatal("want the interrupted start's error")
		}
		e.host.ClearHooks()
		e.host.RemoveVolume(e.cfg.Pool, seedVolume(e.dom("a")))
	}},
}

// leaveVolumes leaves the overlay and seed of an interrupted Create.
func leaveVolumes(t *testing.T, e *fakeEnv) {
	e.host.SetHook("DomainDefineXMLFlags", libvirtfake.Fail(libvirt.ErrInterrupted))
	if _, err := e.p.Create(context.Background(), fakeSpec("a")); err == nil {
		t.Fatal("want the interrupted define's error")
	}
	e.host.ClearHooks()
}

func bigSpec() egressproxy.Spec {
	s := fakeSpec("a")
	s.UserData = "#cloud-config\n# " + strings.Repeat("x", 40000) + "\n"
	return s
}

// TestFakeCreateCancelledBetweenCalls cancels the context during each RPC
// of each Create path in turn: Create returns Canceled (or, during the last
// RPC, may have finished), the abandoned call makes no further RPC (beyond
// the one independent call it may have in flight beside the cancelled one:
// the pool with the domain's lookup, the seed with the overlay), nothing
// is removed, and a retry converges.
func TestFakeCreateCancelledBetweenCalls(t *testing.T) {
	for _, sc := range createScenarios {
		spec := fakeSpec("a")
		if sc.big {
			spec = bigSpec()
		}
		// The RPCs of this path.
		probe := newFakeEnv(t)
		sc.setup(t, probe)
		mark := probe.host.Calls("")
		if _, err := probe.p.Create(context.Background(), spec); err != nil {
			t.Fatalf("%s: %v", sc.name, err)
		}
		calls := rpcsOf(probe.host.Log()[mark:])
		// The lookup (domain and pool at once): two calls when there is
		// no domain, four when there is (its XML and state at once).
		skip := 2
		for _, c := range calls[:min(4, len(calls))] {
			if c.Method == "DomainGetXMLDesc" {
				skip = 4
			}
		}
		inPath := func(seen []fakeRPC) bool {
			left := slices.Clone(calls)
			for _, c := range seen {
				i := slices.Index(left, c)
				if i < 0 {
					return false
				}
				left = slices.Delete(left, i, i+1)
			}
			return true
		}
		for j := skip; j < len(calls); j++ {
			t.Run(fmt.Sprintf("%s/during %d", sc.name, j), func(t *testing.T) {
				e := newFakeEnv(t)
				sc.setup(t, e)
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				var mu sync.Mutex
				var seen []fakeRPC
				e.host.SetHook("", func(c libvirtfake.Call) error {
					mu.Lock()
					defer mu.Unlock()
					seen = append(seen, fakeRPC{c.Method, c.Name()})
					if len(seen) == j+1 {
						cancel()
					}
					return nil
				})
				_, err := e.p.Create(ctx, spec)
				e.host.Wait()
				if err != nil || j < len(calls)-1 {
					wantCode(t, "cancelled", err, errs.Canceled)
				}
				mu.Lock()
				if len(seen) > j+2 {
					t.Errorf("RPCs after the context ended: %v", seen[j+1:])
				}
				if len(seen) < j+1 || !inPath(seen) {
					t.Errorf("calls %v, want %d or %d of the path's: %v", seen, j+1, j+2, calls)
				}
				mu.Unlock()
				if !sc.big && e.host.Calls("StorageVolDelete") != 0 {
					t.Errorf("an interrupted Create removed volumes")
				}
				e.host.ClearHooks()
				if _, err := e.p.Create(context.Background(), spec); err != nil {
					t.Fatalf("retry: %v", err)
				}
				e.hasInstance("a", libvirt.DomainRunning)
			})
		}
	}
}

// TestFakeCreateRareFailures: failures on the less travelled paths
// (completing a defined domain, converging on a replica's define, replacing
// a leftover seed) are classed and leave what the retry needs.
func TestFakeCreateRareFailures(t *testing.T) {
	ctx := context.Background()
	internal := libvirtfake.Errorf(libvirt.ErrInternalError, "internal error: something broke")
	dn := domainName("lab-1", "a")
	scenario := func(name string) func(*testing.T, *fakeEnv) {
		for _, sc := range createScenarios {
			if sc.name == name {
				return sc.setup
			}
		}
		panic(name)
	}
	for _, tc := range []struct {
		name     string
		setup    func(*testing.T, *fakeEnv)
		big      bool
		fault    func(*testing.T, *fakeEnv) // installs the hooks
		want     errs.ErrorCode
		contains string
	}{
		{"complete: volume lookup fails", scenario("defined, seed missing"), false, func(_ *testing.T, e *fakeEnv) {
			e.host.SetHook("StorageVolLookupByName", libvirtfake.Named(overlayVolume(dn), libvirtfake.Fail(internal)))
		}, errs.Transient, "look up volume"},
		{"complete: seed exists after all, of another size", func(t *testing.T, e *fakeEnv) {
			scenario("defined, seed missing")(t, e)
			e.putVolume(libvirtfake.Volume{Name: seedVolume(dn), Capacity: 7})
		}, false, func(_ *testing.T, e *fakeEnv) {
			// The first look finds no seed; the create then finds one.
			e.host.SetHook("StorageVolLookupByName", libvirtfake.Named(seedVolume(dn),
				libvirtfake.FailFirst(1, libvirtfake.Errorf(libvirt.ErrNoStorageVol, "Storage volume not found"))))
		}, errs.Transient, "not replaced while the domain exists"},
		{"define fails, domain lookup fails", scenario("fresh"), false, func(_ *testing.T, e *fakeEnv) {
			e.host.SetHook("DomainDefineXMLFlags", libvirtfake.Fail(libvirtfake.Errorf(libvirt.ErrXMLError, "XML error")))
			e.host.SetHook("DomainLookupByName", libvirtfake.FailNth(2, internal))
		}, errs.Transient, "look up domain"},
		{"replica's domain unreadable", scenario("fresh"), false, func(t *testing.T, e *fakeEnv) {
			var once sync.Once
			e.host.SetHook("DomainDefineXMLFlags", func(libvirtfake.Call) error {
				once.Do(func() { e.defineXML(t, otherDomainXML(t, e, "a", fakeSpec("a").UID)) })
				return nil
			})
			e.host.SetHook("DomainGetXMLDesc", libvirtfake.Fail(internal))
		}, errs.Transient, "get XML of domain"},
		{"leftover seed lookup fails", leaveVolumes, false, func(_ *testing.T, e *fakeEnv) {
			e.host.SetHook("StorageVolLookupByName", libvirtfake.Named(seedVolume(dn), libvirtfake.Fail(internal)))
		}, errs.Transient, "look up existing seed"},
		{"leftover seed unreadable", leaveVolumes, false, func(_ *testing.T, e *fakeEnv) {
			e.host.SetHook("StorageVolGetInfo", libvirtfake.Fail(internal))
		}, errs.Transient, "read existing seed"},
		{"replacing the seed: domain lookup fails", leaveVolumes, true, func(_ *testing.T, e *fakeEnv) {
			e.host.SetHook("DomainLookupByName", libvirtfake.FailNth(2, internal))
		}, errs.Transient, "look up domain"},
		{"replacing the seed: delete fails", leaveVolumes, true, func(_ *testing.T, e *fakeEnv) {
			e.host.SetHook("StorageVolDelete", libvirtfake.Fail(internal))
		}, errs.Transient, "delete leftover seed"},
		{"replacing the seed: create fails", leaveVolumes, true, func(_ *testing.T, e *fakeEnv) {
			// The seed's second create (the overlay's is made at the same time).
			e.host.SetHook("StorageVolCreateXML", libvirtfake.Named(seedVolume(dn), libvirtfake.FailNth(2, internal)))
		}, errs.Transient, "create seed volume"},
		{"start fails, state unreadable", scenario("fresh"), false, func(_ *testing.T, e *fakeEnv) {
			e.host.SetHook("DomainCreate", libvirtfake.Fail(libvirtfake.Errorf(libvirt.ErrOperationFailed, "operation failed")))
			e.host.SetHook("DomainGetState", libvirtfake.Fail(internal))
		}, errs.Transient, "start domain"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newFakeEnv(t)
			tc.setup(t, e)
			spec := fakeSpec("a")
			if tc.big {
				spec = bigSpec()
			}
			tc.fault(t, e)
			_, err := e.p.Create(ctx, spec)
			wantCode(t, tc.name, err, tc.want)
			if !strings.Contains(err.Error(), tc.contains) {
				t.Errorf("err %q: want %q", err, tc.contains)
			}
			e.host.ClearHooks()
			if tc.name == "complete: seed exists after all, of another size" {
				e.host.RemoveVolume(e.cfg.Pool, seedVolume(dn)) // what an operator would do
			}
			if _, err := e.p.Create(ctx, spec); err != nil {
				t.Fatalf("retry: %v", err)
			}
			e.hasInstance("a", libvirt.DomainRunning)
		})
	}
}
