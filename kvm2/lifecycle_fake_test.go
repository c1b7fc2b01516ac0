package kvm2

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/testing/libvirtfake"
	"github.com/egressproxy/egressproxy/sshconn"
)

// mustCreate creates fakeSpec(name) and returns its fake domain.
func (e *fakeEnv) mustCreate(name string) libvirtfake.Domain {
	e.t.Helper()
	if _, err := e.p.Create(context.Background(), fakeSpec(name)); err != nil {
		e.t.Fatalf("create %s: %v", name, err)
	}
	d, _ := e.host.Domain(e.dom(name))
	return d
}

// foreignXML is a domain named dn carrying our metadata of entry and owner
// (or none when entry is ""), or malformed metadata with malformed.
func foreignXML(t *testing.T, dn, entry, owner string, malformed bool) string {
	t.Helper()
	meta := ""
	switch {
	case malformed:
		meta = `<metadata><egressproxy:instance xmlns:egressproxy="` + metadataNamespace + `"><egressproxy:uid>u</egressproxy:uid></egressproxy:instance></metadata>`
	case entry != "":
		m, err := marshalMetadata(instanceMeta{UID: "uid-x", Created: time.Now().UTC(), Entry: entry, Owner: owner, Port: 3128})
		if err != nil {
			t.Fatal(err)
		}
		meta = "<metadata>" + m + "</metadata>"
	}
	return "<domain type='kvm'><name>" + dn + "</name>" + meta + "<memory>1024</memory></domain>"
}

func TestFakeGet(t *testing.T) {
	e := newFakeEnv(t)
	ctx := context.Background()
	e.mustCreate("a")
	ref := fakeSpec("a").Ref()

	for _, tc := range []struct {
		name string
		ref  egressproxy.Ref
	}{
		{"missing", egressproxy.Ref{Name: "nope", UID: "u"}},
		{"another UID", egressproxy.Ref{Name: "a", UID: "other"}},
		{"no metadata", egressproxy.Ref{Name: "f", UID: "uid-x"}},
		{"another owner", egressproxy.Ref{Name: "o", UID: "uid-x"}},
		{"malformed metadata", egressproxy.Ref{Name: "m", UID: "u"}},
	} {
		switch tc.name {
		case "no metadata":
			e.defineXML(t, foreignXML(t, e.dom("f"), "", "", false))
		case "another owner":
			e.defineXML(t, foreignXML(t, e.dom("o"), e.cfg.Entry, "someone-else", false))
		case "malformed metadata":
			e.defineXML(t, foreignXML(t, e.dom("m"), "", "", true))
		}
		_, err := e.p.Get(ctx, tc.ref)
		wantCode(t, tc.name, err, errs.NotFound)
		if !errors.Is(err, errs.ErrNotFound) {
			t.Errorf("%s: %v is not ErrNotFound", tc.name, err)
		}
	}

	// Address discovery: agent (only its answer for our NIC), lease, ARP.
	e.host.UpdateDomain(e.dom("a"), func(d *libvirtfake.Domain) { d.AgentAddress = "192.0.2.30" })
	inst, err := e.p.Get(ctx, ref)
	if err != nil || inst.IP != "192.0.2.30" || inst.AddressSource != SourceAgent || inst.State != egressproxy.StateRunning {
		t.Errorf("agent: %+v, %v", inst, err)
	}
	e.host.UpdateDomain(e.dom("a"), func(d *libvirtfake.Domain) { d.MAC = "52:54:00:ff:ff:ff" }) // agent reports another NIC
	e.host.SetARP("52:54:00:ff:ff:ff", "2001:db8::7")
	inst, err = e.p.Get(ctx, ref)
	if err != nil || inst.IP != "2001:db8::7" || inst.AddressSource != SourceARP {
		t.Errorf("arp: %+v, %v", inst, err)
	}
	e.host.SetLease("52:54:00:ff:ff:ff", "192.0.2.31")
	inst, err = e.p.Get(ctx, ref)
	if err != nil || inst.IP != "192.0.2.31" || inst.AddressSource != SourceLease {
		t.Errorf("lease: %+v, %v", inst, err)
	}

	for _, tc := range []struct {
		name  string
		fault fakeFault
		want  errs.ErrorCode
		is    func(error) bool
	}{
		{"every source fails", failCalls("DomainInterfaceAddresses", libvirtfake.Errorf(libvirt.ErrInternalError, "internal error")),
			errs.Transient, func(err error) bool {
				var ae *AddressError
				return errors.As(err, &ae) && len(ae.Sources) == 3 && !ae.LinkDead
			}},
		{"link dies", failCalls("DomainInterfaceAddresses", libvirt.ErrInterrupted),
			errs.Transient, func(err error) bool {
				var ae *AddressError
				return errors.As(err, &ae) && ae.LinkDead
			}},
		{"domain vanished", failCalls("DomainInterfaceAddresses", libvirtfake.Errorf(libvirt.ErrNoDomain, "Domain not found")),
			errs.NotFound, nil},
		{"XML unreadable", failCalls("DomainGetXMLDesc", libvirtfake.Errorf(libvirt.ErrInternalError, "internal error")),
			errs.Transient, nil},
		// A read answered "invalid argument" never latches the instance as failed.
		{"XML invalid argument", failCalls("DomainGetXMLDesc", libvirtfake.Errorf(libvirt.ErrInvalidArg, "invalid argument")),
			errs.Transient, nil},
		{"state unreadable", failCalls("DomainGetState", libvirtfake.Errorf(libvirt.ErrInternalError, "internal error")),
			errs.Transient, nil},
		// A denial of the entry's rights is the entry's fault, not the
		// instance's: Permanent, as on every other operation.
		{"lookup refused", failCalls("DomainLookupByName", libvirtfake.Errorf(libvirt.ErrAccessDenied, "access denied")),
			errs.Permanent, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.fault.install(e.host)
			defer e.host.ClearHooks()
			_, err := e.p.Get(ctx, ref)
			wantCode(t, tc.name, err, tc.want)
			if tc.is != nil && !tc.is(err) {
				t.Errorf("err %v", err)
			}
			if !strings.HasPrefix(err.Error(), "kvm2 "+e.cfg.Entry+": ") {
				t.Errorf("err %q does not name the entry", err)
			}
		})
	}

	// Stopped: no address lookup.
	e.host.UpdateDomain(e.dom("a"), func(d *libvirtfake.Domain) {
		d.State, d.Reason = libvirt.DomainShutoff, int32(libvirt.DomainShutoffShutdown)
	})
	e.host.ResetCalls()
	inst, err = e.p.Get(ctx, ref)
	if err != nil || inst.State != egressproxy.StateStopped || inst.IP != "" || e.host.Calls("DomainInterfaceAddresses") != 0 {
		t.Errorf("stopped: %+v, %v", inst, err)
	}
	e.host.UpdateDomain(e.dom("a"), func(d *libvirtfake.Domain) { d.State = libvirt.DomainCrashed })
	if inst, err = e.p.Get(ctx, ref); err != nil || inst.State != egressproxy.StateFailed {
		t.Errorf("crashed: %+v, %v", inst, err)
	}

	cctx, cancel := context.WithCancel(ctx)
	cancel()
	_, err = e.p.Get(cctx, ref)
	wantCode(t, "cancelled", err, errs.Canceled)
}

// TestFakeGetCancelledDuringAddress: a context ending while the address is
// asked for is returned as such, not as an address error.
func TestFakeGetCancelledDuringAddress(t *testing.T) {
	e := newFakeEnv(t)
	e.mustCreate("a")
	pause := libvirtfake.NewPause()
	e.host.SetHook("DomainInterfaceAddresses", pause.Hook)
	ctx, cancel := context.WithCancel(context.Background())
	go func() { <-pause.Entered(); cancel() }()
	_, err := e.p.Get(ctx, fakeSpec("a").Ref())
	wantCode(t, "cancelled", err, errs.Canceled)
	pause.Release()
}

func TestFakeList(t *testing.T) {
	e := newFakeEnv(t)
	ctx := context.Background()
	for _, n := range []string{"c", "a", "b"} {
		e.mustCreate(n)
	}
	e.host.UpdateDomain(e.dom("c"), func(d *libvirtfake.Domain) {
		d.State, d.Reason = libvirt.DomainShutoff, int32(libvirt.DomainShutoffShutdown)
	})
	da, _ := e.host.Domain(e.dom("a"))
	e.host.SetLease(da.MAC, "192.0.2.40")
	// Not ours: another entry, another owner, no metadata, malformed
	// metadata, a name without our prefix.
	e.defineXML(t, foreignXML(t, domainName("lab-2", "x"), "lab-2", e.cfg.Owner, false))
	e.defineXML(t, foreignXML(t, e.dom("y"), e.cfg.Entry, "another-owner", false))
	e.defineXML(t, foreignXML(t, e.dom("z"), "", "", false))
	e.defineXML(t, foreignXML(t, e.dom("m"), "", "", true))
	e.defineXML(t, foreignXML(t, "plain-vm", e.cfg.Entry, e.cfg.Owner, false))

	e.host.ResetCalls()
	got, err := e.p.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := []struct {
		name  string
		state egressproxy.State
		ip    string
	}{{"a", egressproxy.StateRunning, "192.0.2.40"}, {"b", egressproxy.StateProvisioning, ""}, {"c", egressproxy.StateStopped, ""}}
	if len(got) != len(want) {
		t.Fatalf("List = %+v, want a, b, c", got)
	}
	for i, w := range want {
		if g := got[i]; g.Name != w.name || g.UID != "uid-"+w.name || g.State != w.state || g.IP != w.ip || g.CreatedAt.IsZero() {
			t.Errorf("List[%d] = %+v, want %+v", i, g, w)
		}
	}
	if n := e.host.Calls("DomainGetXMLDesc"); n != 6 {
		t.Errorf("%d domain XML reads, want 6 (every prefixed domain; not plain-vm)", n)
	}

	// An address that cannot be read: listed without one.
	e.host.SetHook("DomainInterfaceAddresses", libvirtfake.Named(e.dom("a"), libvirtfake.Fail(libvirtfake.Errorf(libvirt.ErrInternalError, "internal error"))))
	got, err = e.p.List(ctx)
	if err != nil || len(got) != 3 || got[0].IP != "" || got[0].State != egressproxy.StateProvisioning {
		t.Errorf("address failing: %+v, %v", got, err)
	}
	// Undefined between the listing and the read: skipped.
	e.host.ClearHooks()
	e.host.SetHook("DomainGetXMLDesc", libvirtfake.Named(e.dom("b"), libvirtfake.Fail(libvirtfake.Errorf(libvirt.ErrNoDomain, "Domain not found"))))
	got, err = e.p.List(ctx)
	if err != nil || len(got) != 2 || got[0].Name != "a" || got[1].Name != "c" {
		t.Errorf("b vanished: %+v, %v", got, err)
	}

	for _, tc := range []struct {
		name  string
		fault fakeFault
		want  errs.ErrorCode
	}{
		{"listing fails", failCalls("ConnectGetAllDomainStats", libvirtfake.Errorf(libvirt.ErrInternalError, "internal error")), errs.Transient},
		{"a read fails", fakeFault{"DomainGetXMLDesc", libvirtfake.Named(e.dom("b"), libvirtfake.Fail(libvirtfake.Errorf(libvirt.ErrInvalidArg, "invalid argument")))}, errs.Transient},
		{"link dies", failCalls("ConnectGetAllDomainStats", libvirt.ErrInterrupted), errs.Transient},
	} {
		e.host.ClearHooks()
		tc.fault.install(e.host)
		_, err := e.p.List(ctx)
		wantCode(t, tc.name, err, tc.want)
	}
	e.host.ClearHooks()

	// The context ending during address discovery ends List.
	pause := libvirtfake.NewPause()
	e.host.SetHook("DomainInterfaceAddresses", pause.Hook)
	cctx, cancel := context.WithCancel(ctx)
	go func() { <-pause.Entered(); cancel() }()
	_, err = e.p.List(cctx)
	wantCode(t, "cancelled", err, errs.Canceled)
	pause.Release()
}

func TestFakeDelete(t *testing.T) {
	ctx := context.Background()
	ref := fakeSpec("a").Ref()

	t.Run("running", func(t *testing.T) {
		e := newFakeEnv(t)
		e.mustCreate("a")
		if err := e.p.Delete(ctx, ref); err != nil {
			t.Fatal(err)
		}
		e.onlyBases("after Delete")
		if n := e.host.Calls("DomainDestroy"); n != 1 {
			t.Errorf("destroyed %d times", n)
		}
		if len(e.host.VolumeNames(e.cfg.Pool)) != 1 {
			t.Errorf("the base went too: %v", e.host.VolumeNames(e.cfg.Pool))
		}
		// Again: missing succeeds.
		if err := e.p.Delete(ctx, ref); err != nil {
			t.Errorf("second Delete: %v", err)
		}
	})

	t.Run("stopped", func(t *testing.T) {
		e := newFakeEnv(t)
		e.mustCreate("a")
		e.host.UpdateDomain(e.dom("a"), func(d *libvirtfake.Domain) {
			d.State, d.Reason = libvirt.DomainShutoff, int32(libvirt.DomainShutoffShutdown)
		})
		e.host.ResetCalls()
		if err := e.p.Delete(ctx, ref); err != nil {
			t.Fatal(err)
		}
		e.onlyBases("after Delete")
		if n := e.host.Calls("DomainDestroy"); n != 0 {
			t.Errorf("a stopped domain was destroyed")
		}
	})

	t.Run("missing, with leftovers of a failed Create", func(t *testing.T) {
		e := newFakeEnv(t)
		e.host.SetHook("DomainDefineXMLFlags", libvirtfake.Fail(libvirt.ErrInterrupted))
		if _, err := e.p.Create(ctx, fakeSpec("a")); err == nil {
			t.Fatal("want the interrupted define's error")
		}
		e.host.ClearHooks()
		if err := e.p.Delete(ctx, ref); err != nil {
			t.Fatal(err)
		}
		e.onlyBases("after Delete")
	})

	t.Run("not this instance", func(t *testing.T) {
		e := newFakeEnv(t)
		e.mustCreate("a")
		if err := e.p.Delete(ctx, egressproxy.Ref{Name: "a", UID: "other"}); err != nil {
			t.Fatal(err)
		}
		e.hasInstance("a", libvirt.DomainRunning)
		e.defineXML(t, foreignXML(t, e.dom("f"), "", "", false))
		if err := e.p.Delete(ctx, egressproxy.Ref{Name: "f", UID: "u"}); err != nil {
			t.Fatal(err)
		}
		if _, ok := e.host.Domain(e.dom("f")); !ok {
			t.Error("a foreign domain was deleted")
		}
	})

	t.Run("vanished while read", func(t *testing.T) {
		e := newFakeEnv(t)
		e.mustCreate("a")
		e.host.SetHook("DomainGetXMLDesc", libvirtfake.Fail(libvirtfake.Errorf(libvirt.ErrNoDomain, "Domain not found")))
		if err := e.p.Delete(ctx, ref); err != nil {
			t.Fatal(err)
		}
		// The domain (still there for the fake) keeps its volumes.
		e.hasInstance("a", libvirt.DomainRunning)
	})

	t.Run("defined again meanwhile", func(t *testing.T) {
		e := newFakeEnv(t)
		d := e.mustCreate("a")
		e.host.SetReplyHook("DomainUndefineFlags", func(libvirtfake.Call) error {
			e.defineXML(t, d.XML) // a Create elsewhere defines it again
			return nil
		})
		if err := e.p.Delete(ctx, ref); err != nil {
			t.Fatal(err)
		}
		e.hasInstance("a", libvirt.DomainShutoff) // its volumes stay with it
	})

	t.Run("started late between removal steps", func(t *testing.T) {
		// A start libvirtd received earlier (a Create's, sent on a link
		// that closed meanwhile) runs right after one of Delete's calls:
		// the domain must not survive the Delete, transient and running.
		for _, after := range []string{"DomainDestroy", "DomainUndefineFlags"} {
			e := newFakeEnv(t)
			e.mustCreate("a")
			e.host.SetReplyHook(after, func(libvirtfake.Call) error {
				e.host.UpdateDomain(e.dom("a"), func(d *libvirtfake.Domain) {
					d.State, d.Reason, d.ID = libvirt.DomainRunning, int32(libvirt.DomainRunningBooted), 7
				})
				return nil
			})
			if err := e.p.Delete(ctx, ref); err != nil {
				t.Fatalf("start after %s: Delete: %v", after, err)
			}
			e.onlyBases("start after " + after + ", Delete")
		}
	})

	t.Run("transient, left running by an earlier removal", func(t *testing.T) {
		e := newFakeEnv(t)
		e.mustCreate("a")
		e.host.UpdateDomain(e.dom("a"), func(d *libvirtfake.Domain) { d.Persistent = false })
		if err := e.p.Delete(ctx, ref); err != nil {
			t.Fatal(err)
		}
		e.onlyBases("after Delete")
	})

	t.Run("pool gone", func(t *testing.T) {
		e := newFakeEnv(t)
		e.mustCreate("a")
		e.host.RemovePool(e.cfg.Pool)
		// Its volumes may still be on disk: Delete cannot succeed, and
		// must not say NotFound; it names the pool.
		err := e.p.Delete(ctx, ref)
		if errs.Code(err) != errs.Permanent || !strings.Contains(err.Error(), e.cfg.Pool) {
			t.Fatalf("Delete with the pool gone: %v (code %v), want Permanent naming the pool", err, errs.Code(err))
		}
		if len(e.host.DomainNames()) != 0 {
			t.Error("domain left")
		}
		if err := e.p.Delete(ctx, ref); errs.Code(err) != errs.Permanent {
			t.Errorf("Delete again: %v (code %v), want Permanent", err, errs.Code(err))
		}
	})

	for _, tc := range []struct {
		name  string
		fault fakeFault
		want  errs.ErrorCode
		left  bool // the domain stays
	}{
		{"destroy fails", failCalls("DomainDestroy", libvirtfake.Errorf(libvirt.ErrInternalError, "internal error")), errs.Transient, true},
		{"destroy: not running", failCalls("DomainDestroy", libvirtfake.Errorf(libvirt.ErrOperationInvalid, "domain is not running")), errs.OK, true}, // undefined while running: transient until destroyed
		{"undefine fails", failCalls("DomainUndefineFlags", libvirtfake.Errorf(libvirt.ErrInternalError, "internal error")), errs.Transient, true},
		{"undefine: gone", failCalls("DomainUndefineFlags", libvirtfake.Errorf(libvirt.ErrNoDomain, "Domain not found")), errs.OK, true},
		{"lookup fails", failCalls("DomainLookupByName", libvirtfake.Errorf(libvirt.ErrInternalError, "internal error")), errs.Transient, true},
		{"state fails", failCalls("DomainGetState", libvirtfake.Errorf(libvirt.ErrInternalError, "internal error")), errs.Transient, true},
		{"volume busy", failCalls("StorageVolDelete", libvirtfake.Errorf(libvirt.ErrOperationInvalid, "volume is still in use")), errs.Transient, false},
		{"volume gone meanwhile", failCalls("StorageVolDelete", libvirtfake.Errorf(libvirt.ErrNoStorageVol, "Storage volume not found")), errs.OK, false},
		{"volume lookup fails", failCalls("StorageVolLookupByName", libvirtfake.Errorf(libvirt.ErrInternalError, "internal error")), errs.Transient, false},
		{"link dies", failCalls("DomainDestroy", libvirt.ErrInterrupted), errs.Transient, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newFakeEnv(t)
			e.mustCreate("a")
			tc.fault.install(e.host)
			err := e.p.Delete(ctx, ref)
			if tc.want == errs.OK {
				if err != nil {
					t.Fatal(err)
				}
			} else {
				wantCode(t, tc.name, err, tc.want)
				if !strings.HasPrefix(err.Error(), "kvm2 "+e.cfg.Entry+": ") {
					t.Errorf("err %q does not name the entry", err)
				}
			}
			if _, ok := e.host.Domain(e.dom("a")); ok != tc.left {
				t.Errorf("domain left: %v, want %v", ok, tc.left)
			}
			// Once the cause is gone, Delete finishes.
			e.host.ClearHooks()
			if err := e.p.Delete(ctx, ref); err != nil {
				t.Fatal(err)
			}
			e.onlyBases("after the retried Delete")
		})
	}

	t.Run("cancelled", func(t *testing.T) {
		e := newFakeEnv(t)
		e.mustCreate("a")
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		wantCode(t, "cancelled", e.p.Delete(cctx, ref), errs.Canceled)
		e.hasInstance("a", libvirt.DomainRunning)
	})
}

func TestFakeCheck(t *testing.T) {
	ctx := context.Background()
	e := newFakeEnv(t)
	h, err := e.p.Check(ctx)
	if err != nil || !h.Reachable || h.Reason != "" || h.CheckedAt.IsZero() {
		t.Fatalf("healthy: %+v, %v", h, err)
	}
	for k, v := range map[string]string{"hostname": "hv1.example", "libvirtVersion": "10.2.3", "poolState": "running", "poolFreeGiB": "42.00"} {
		if h.Details[k] != v {
			t.Errorf("Details[%s] = %q, want %q", k, h.Details[k], v)
		}
	}

	dial := func(k sshconn.Kind) func(*fakeEnv) {
		return func(e *fakeEnv) {
			e.host.SetHook("Do", libvirtfake.Fail(&sshconn.Error{Kind: k, Address: fakeAddr, Op: "dial", Err: errors.New(k.String())}))
		}
	}
	fault := func(op string, err error) func(*fakeEnv) {
		return func(e *fakeEnv) { e.host.SetHook(op, libvirtfake.Fail(err)) }
	}
	poolState := func(st libvirt.StoragePoolState) func(*fakeEnv) {
		return func(e *fakeEnv) {
			if err := e.host.SetPoolState(e.cfg.Pool, st); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, tc := range []struct {
		name    string
		setup   func(*fakeEnv)
		reason  egressproxy.HealthReason
		details []string // details kept
	}{
		{"key unreadable", dial(sshconn.KindKeyUnreadable), egressproxy.ReasonCredentialsUnavailable, nil},
		{"auth refused", dial(sshconn.KindAuthRefused), egressproxy.ReasonUnauthorized, nil},
		{"host unknown", dial(sshconn.KindHostUnknown), egressproxy.ReasonHostKeyUnknown, nil},
		{"host key mismatch", dial(sshconn.KindHostKeyMismatch), egressproxy.ReasonHostKeyMismatch, nil},
		{"socket forbidden", dial(sshconn.KindForbidden), egressproxy.ReasonForbidden, nil},
		{"unreachable", dial(sshconn.KindUnreachable), egressproxy.ReasonUnreachable, nil},
		{"libvirt access denied", fault("ConnectGetHostname", libvirtfake.Errorf(libvirt.ErrAccessDenied, "access denied")), egressproxy.ReasonForbidden, nil},
		{"link dies", fault("ConnectGetLibVersion", libvirt.ErrInterrupted), egressproxy.ReasonUnreachable, []string{"hostname"}},
		{"rpc error", fault("ConnectGetLibVersion", libvirtfake.Errorf(libvirt.ErrRPC, "rpc error")), egressproxy.ReasonUnreachable, []string{"hostname"}},
		{"pool missing", func(e *fakeEnv) { e.host.RemovePool(e.cfg.Pool) }, egressproxy.ReasonPoolNotFound, []string{"hostname", "libvirtVersion"}},
		{"pool inactive", poolState(libvirt.StoragePoolInactive), egressproxy.ReasonPoolNotActive, []string{"hostname", "libvirtVersion", "poolState"}},
		{"pool info fails", fault("StoragePoolGetInfo", libvirtfake.Errorf(libvirt.ErrInternalError, "internal error")), egressproxy.ReasonUnknown, []string{"hostname", "libvirtVersion"}},
		{"pool refresh fails", fault("StoragePoolRefresh", libvirtfake.Errorf(libvirt.ErrInternalError, "internal error")), egressproxy.ReasonUnknown, []string{"hostname", "libvirtVersion", "poolState"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newFakeEnv(t)
			tc.setup(e)
			h, err := e.p.Check(ctx)
			if err != nil {
				t.Fatalf("Check: %v (the error is for the call only)", err)
			}
			if h.Reachable || h.Reason != tc.reason || h.Message == "" {
				t.Errorf("health %+v, want reason %s", h, tc.reason)
			}
			if len(h.Details) != len(tc.details) {
				t.Errorf("details %v, want %v", h.Details, tc.details)
			}
			for _, k := range tc.details {
				if h.Details[k] == "" {
					t.Errorf("detail %s lost: %v", k, h.Details)
				}
			}
		})
	}

	// A Create building a volume in the pool makes libvirt refuse refreshes
	// ("has asynchronous jobs running"): the entry is still Reachable.
	t.Run("pool busy", func(t *testing.T) {
		e := newFakeEnv(t)
		fault("StoragePoolRefresh", libvirtfake.Errorf(libvirt.ErrInternalError, "internal error: pool '%s' has asynchronous jobs running.", e.cfg.Pool))(e)
		h, err := e.p.Check(ctx)
		if err != nil || !h.Reachable || h.Details["poolFreeGiB"] == "" || !strings.Contains(h.Details["poolRefresh"], "asynchronous jobs running") {
			t.Errorf("%+v, %v; want Reachable with poolFreeGiB and a poolRefresh detail", h, err)
		}
	})

	t.Run("pool in an unknown state", func(t *testing.T) {
		e := newFakeEnv(t)
		poolState(9)(e)
		h, err := e.p.Check(ctx)
		if err != nil || h.Reason != egressproxy.ReasonPoolNotActive || h.Details["poolState"] != "state-9" {
			t.Errorf("%+v, %v", h, err)
		}
	})

	t.Run("cancelled", func(t *testing.T) {
		e := newFakeEnv(t)
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		h, err := e.p.Check(cctx)
		wantCode(t, "cancelled", err, errs.Canceled)
		if h.Reachable || h.Details != nil {
			t.Errorf("health %+v with an error", h)
		}
	})

	t.Run("closed during the call", func(t *testing.T) {
		e := newFakeEnv(t)
		pause := libvirtfake.NewPause()
		e.host.SetHook("ConnectGetLibVersion", pause.Hook)
		done := make(chan error, 1)
		go func() { <-pause.Entered(); done <- e.p.Close() }()
		_, err := e.p.Check(ctx)
		if cerr := <-done; cerr != nil {
			t.Errorf("Close: %v", cerr)
		}
		wantCode(t, "closed", err, errs.Permanent)
		if !errors.Is(err, errs.ErrClosed) {
			t.Errorf("err %v: want ErrClosed", err)
		}
	})
}

// TestFakeClose: Close closes the image cache and the session once; every
// call after it is ErrClosed, Permanent, and touches nothing.
func TestFakeClose(t *testing.T) {
	e := newFakeEnv(t)
	e.mustCreate("a")
	if err := e.p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := e.p.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if e.images.closeCount() != 1 || e.link.closeCount() != 1 {
		t.Errorf("images closed %d, session %d times; want once each", e.images.closeCount(), e.link.closeCount())
	}
	e.host.ResetCalls()
	ctx := context.Background()
	ref := fakeSpec("a").Ref()
	_, e1 := e.p.Create(ctx, fakeSpec("b"))
	_, e2 := e.p.Get(ctx, ref)
	e3 := e.p.Delete(ctx, ref)
	_, e4 := e.p.List(ctx)
	_, e5 := e.p.Check(ctx)
	for i, err := range []error{e1, e2, e3, e4, e5} {
		if !errors.Is(err, errs.ErrClosed) || errs.Code(err) != errs.Permanent {
			t.Errorf("call %d after Close: %v", i, err)
		}
	}
	if n := e.host.Calls(""); n != 0 {
		t.Errorf("%d libvirt calls after Close", n)
	}
	e.hasInstance("a", libvirt.DomainRunning) // Close deletes nothing
}

// TestFakeSessionClosedUnderneath: a session that reports closed (the
// provider not closed) is ErrClosed, Permanent, for every call.
func TestFakeSessionClosedUnderneath(t *testing.T) {
	e := newFakeEnv(t)
	e.mustCreate("a")
	e.host.SetHook("Do", libvirtfake.Fail(fakeClosedError()))
	ctx := context.Background()
	ref := fakeSpec("a").Ref()
	_, e1 := e.p.Create(ctx, fakeSpec("b"))
	_, e2 := e.p.Get(ctx, ref)
	e3 := e.p.Delete(ctx, ref)
	_, e4 := e.p.List(ctx)
	_, e5 := e.p.Check(ctx)
	for i, err := range []error{e1, e2, e3, e4, e5} {
		if !errors.Is(err, errs.ErrClosed) || errs.Code(err) != errs.Permanent {
			t.Errorf("call %d on a closed session: %v (code %v)", i, err, errs.Code(err))
		}
	}
}

// TestOpenCheckKeyUnreadable: a provider built by Open runs its calls on
// the real session; a key file that cannot be read is reported by Check as
// CredentialsUnavailable before any network use.
func TestOpenCheckKeyUnreadable(t *testing.T) {
	p := openOffline(t)
	if p.cfg.Entry != "lab-1" || p.cfg.Pool != "default" {
		t.Errorf("Config() = %+v", p.cfg)
	}
	h, err := p.Check(context.Background())
	if err != nil || h.Reachable || h.Reason != egressproxy.ReasonCredentialsUnavailable {
		t.Errorf("Check = %+v, %v; want CredentialsUnavailable", h, err)
	}
}

func TestFakeDeleteVolumeSteps(t *testing.T) {
	ctx := context.Background()
	internal := libvirtfake.Errorf(libvirt.ErrInternalError, "internal error")
	for _, tc := range []struct {
		name     string
		fault    fakeFault
		contains string
	}{
		{"pool lookup fails", failCalls("StoragePoolLookupByName", internal), "look up pool"},
		{"domain lookup before a volume fails", fakeFault{"DomainLookupByName", libvirtfake.FailNth(2, internal)}, "look up domain"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newFakeEnv(t)
			e.mustCreate("a")
			tc.fault.install(e.host)
			err := e.p.Delete(ctx, fakeSpec("a").Ref())
			wantCode(t, tc.name, err, errs.Transient)
			if !strings.Contains(err.Error(), tc.contains) {
				t.Errorf("err %q: want %q", err, tc.contains)
			}
			if len(e.host.VolumeNames(e.cfg.Pool)) != 3 {
				t.Errorf("volumes %v: want them kept", e.host.VolumeNames(e.cfg.Pool))
			}
			e.host.ClearHooks()
			if err := e.p.Delete(ctx, fakeSpec("a").Ref()); err != nil {
				t.Fatal(err)
			}
			e.onlyBases("after the retried Delete")
		})
	}
}
