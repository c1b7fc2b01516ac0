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
	"github.com/egressproxy/egressproxy/sshconn"
)

// mustCreate creates fakeSpec(name) and returns its fake domain.
func (e *fakeEnv) mustCreate(name string) fakeDomain {
	e.t.Helper()
	if _, err := e.p.Create(context.Background(), fakeSpec(name)); err != nil {
		e.t.Fatalf("create %s: %v", name, err)
	}
	d, _ := e.lv.domain(e.dom(name))
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
			e.lv.defineXML(t, foreignXML(t, e.dom("f"), "", "", false))
		case "another owner":
			e.lv.defineXML(t, foreignXML(t, e.dom("o"), e.cfg.Entry, "someone-else", false))
		case "malformed metadata":
			e.lv.defineXML(t, foreignXML(t, e.dom("m"), "", "", true))
		}
		_, err := e.p.Get(ctx, tc.ref)
		wantCode(t, tc.name, err, errs.NotFound)
		if !errors.Is(err, errs.ErrNotFound) {
			t.Errorf("%s: %v is not ErrNotFound", tc.name, err)
		}
	}

	// Address discovery: agent (only its answer for our NIC), lease, ARP.
	e.lv.setDomain(e.dom("a"), func(d *fakeDomain) { d.agentIP = "192.0.2.30" })
	inst, err := e.p.Get(ctx, ref)
	if err != nil || inst.IP != "192.0.2.30" || inst.AddressSource != SourceAgent || inst.State != egressproxy.StateRunning {
		t.Errorf("agent: %+v, %v", inst, err)
	}
	e.lv.setDomain(e.dom("a"), func(d *fakeDomain) { d.mac = "52:54:00:ff:ff:ff" }) // agent reports another NIC
	e.lv.setARP("52:54:00:ff:ff:ff", "2001:db8::7")
	inst, err = e.p.Get(ctx, ref)
	if err != nil || inst.IP != "2001:db8::7" || inst.AddressSource != SourceARP {
		t.Errorf("arp: %+v, %v", inst, err)
	}
	e.lv.setLease("52:54:00:ff:ff:ff", "192.0.2.31")
	inst, err = e.p.Get(ctx, ref)
	if err != nil || inst.IP != "192.0.2.31" || inst.AddressSource != SourceLease {
		t.Errorf("lease: %+v, %v", inst, err)
	}

	for _, tc := range []struct {
		name  string
		fault func(fakeCall) error
		want  errs.ErrorCode
		is    func(error) bool
	}{
		{"every source fails", failOn("DomainInterfaceAddresses", "", false, lvErrorf(libvirt.ErrInternalError, "internal error")),
			errs.Transient, func(err error) bool {
				var ae *AddressError
				return errors.As(err, &ae) && len(ae.Sources) == 3 && !ae.LinkDead
			}},
		{"link dies", failOn("DomainInterfaceAddresses", "", false, libvirt.ErrInterrupted),
			errs.Transient, func(err error) bool {
				var ae *AddressError
				return errors.As(err, &ae) && ae.LinkDead
			}},
		{"domain vanished", failOn("DomainInterfaceAddresses", "", false, lvErrorf(libvirt.ErrNoDomain, "Domain not found")),
			errs.NotFound, nil},
		{"XML unreadable", failOn("DomainGetXMLDesc", "", false, lvErrorf(libvirt.ErrInternalError, "internal error")),
			errs.Transient, nil},
		// A read answered "invalid argument" never latches the instance as failed.
		{"XML invalid argument", failOn("DomainGetXMLDesc", "", false, lvErrorf(libvirt.ErrInvalidArg, "invalid argument")),
			errs.Transient, nil},
		{"state unreadable", failOn("DomainGetState", "", false, lvErrorf(libvirt.ErrInternalError, "internal error")),
			errs.Transient, nil},
		// A denial of the entry's rights is the entry's fault, not the
		// instance's: Permanent, as on every other operation.
		{"lookup refused", failOn("DomainLookupByName", "", false, lvErrorf(libvirt.ErrAccessDenied, "access denied")),
			errs.Permanent, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e.lv.setFault(tc.fault)
			defer e.lv.setFault(nil)
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
	e.lv.setDomain(e.dom("a"), func(d *fakeDomain) {
		d.state, d.reason = libvirt.DomainShutoff, int32(libvirt.DomainShutoffShutdown)
	})
	e.lv.resetCalls()
	inst, err = e.p.Get(ctx, ref)
	if err != nil || inst.State != egressproxy.StateStopped || inst.IP != "" || e.lv.callCount("DomainInterfaceAddresses") != 0 {
		t.Errorf("stopped: %+v, %v", inst, err)
	}
	e.lv.setDomain(e.dom("a"), func(d *fakeDomain) { d.state = libvirt.DomainCrashed })
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
	hook, entered, release := e.lv.block("DomainInterfaceAddresses", "")
	e.lv.setFault(hook)
	ctx, cancel := context.WithCancel(context.Background())
	go func() { <-entered; cancel() }()
	_, err := e.p.Get(ctx, fakeSpec("a").Ref())
	wantCode(t, "cancelled", err, errs.Canceled)
	release()
}

func TestFakeList(t *testing.T) {
	e := newFakeEnv(t)
	ctx := context.Background()
	for _, n := range []string{"c", "a", "b"} {
		e.mustCreate(n)
	}
	e.lv.setDomain(e.dom("c"), func(d *fakeDomain) {
		d.state, d.reason = libvirt.DomainShutoff, int32(libvirt.DomainShutoffShutdown)
	})
	da, _ := e.lv.domain(e.dom("a"))
	e.lv.setLease(da.mac, "192.0.2.40")
	// Not ours: another entry, another owner, no metadata, malformed
	// metadata, a name without our prefix.
	e.lv.defineXML(t, foreignXML(t, domainName("lab-2", "x"), "lab-2", e.cfg.Owner, false))
	e.lv.defineXML(t, foreignXML(t, e.dom("y"), e.cfg.Entry, "another-owner", false))
	e.lv.defineXML(t, foreignXML(t, e.dom("z"), "", "", false))
	e.lv.defineXML(t, foreignXML(t, e.dom("m"), "", "", true))
	e.lv.defineXML(t, foreignXML(t, "plain-vm", e.cfg.Entry, e.cfg.Owner, false))

	e.lv.resetCalls()
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
	if n := e.lv.callCount("DomainGetXMLDesc"); n != 6 {
		t.Errorf("%d domain XML reads, want 6 (every prefixed domain; not plain-vm)", n)
	}

	// An address that cannot be read: listed without one.
	e.lv.setFault(failOn("DomainInterfaceAddresses", e.dom("a"), false, lvErrorf(libvirt.ErrInternalError, "internal error")))
	got, err = e.p.List(ctx)
	if err != nil || len(got) != 3 || got[0].IP != "" || got[0].State != egressproxy.StateProvisioning {
		t.Errorf("address failing: %+v, %v", got, err)
	}
	// Undefined between the listing and the read: skipped.
	e.lv.setFault(failOn("DomainGetXMLDesc", e.dom("b"), false, lvErrorf(libvirt.ErrNoDomain, "Domain not found")))
	got, err = e.p.List(ctx)
	if err != nil || len(got) != 2 || got[0].Name != "a" || got[1].Name != "c" {
		t.Errorf("b vanished: %+v, %v", got, err)
	}

	for _, tc := range []struct {
		name  string
		fault func(fakeCall) error
		want  errs.ErrorCode
	}{
		{"listing fails", failOn("ConnectGetAllDomainStats", "", false, lvErrorf(libvirt.ErrInternalError, "internal error")), errs.Transient},
		{"a read fails", failOn("DomainGetXMLDesc", e.dom("b"), false, lvErrorf(libvirt.ErrInvalidArg, "invalid argument")), errs.Transient},
		{"link dies", failOn("ConnectGetAllDomainStats", "", false, libvirt.ErrInterrupted), errs.Transient},
	} {
		e.lv.setFault(tc.fault)
		_, err := e.p.List(ctx)
		wantCode(t, tc.name, err, tc.want)
	}
	e.lv.setFault(nil)

	// The context ending during address discovery ends List.
	hook, entered, release := e.lv.block("DomainInterfaceAddresses", "")
	e.lv.setFault(hook)
	cctx, cancel := context.WithCancel(ctx)
	go func() { <-entered; cancel() }()
	_, err = e.p.List(cctx)
	wantCode(t, "cancelled", err, errs.Canceled)
	release()
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
		if n := e.lv.callCount("DomainDestroy"); n != 1 {
			t.Errorf("destroyed %d times", n)
		}
		if len(e.lv.volNames(e.cfg.Pool)) != 1 {
			t.Errorf("the base went too: %v", e.lv.volNames(e.cfg.Pool))
		}
		// Again: missing succeeds.
		if err := e.p.Delete(ctx, ref); err != nil {
			t.Errorf("second Delete: %v", err)
		}
	})

	t.Run("stopped", func(t *testing.T) {
		e := newFakeEnv(t)
		e.mustCreate("a")
		e.lv.setDomain(e.dom("a"), func(d *fakeDomain) {
			d.state, d.reason = libvirt.DomainShutoff, int32(libvirt.DomainShutoffShutdown)
		})
		e.lv.resetCalls()
		if err := e.p.Delete(ctx, ref); err != nil {
			t.Fatal(err)
		}
		e.onlyBases("after Delete")
		if n := e.lv.callCount("DomainDestroy"); n != 0 {
			t.Errorf("a stopped domain was destroyed")
		}
	})

	t.Run("missing, with leftovers of a failed Create", func(t *testing.T) {
		e := newFakeEnv(t)
		e.lv.setFault(failOn("DomainDefineXMLFlags", "", false, libvirt.ErrInterrupted))
		if _, err := e.p.Create(ctx, fakeSpec("a")); err == nil {
			t.Fatal("want the interrupted define's error")
		}
		e.lv.setFault(nil)
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
		e.lv.defineXML(t, foreignXML(t, e.dom("f"), "", "", false))
		if err := e.p.Delete(ctx, egressproxy.Ref{Name: "f", UID: "u"}); err != nil {
			t.Fatal(err)
		}
		if _, ok := e.lv.domain(e.dom("f")); !ok {
			t.Error("a foreign domain was deleted")
		}
	})

	t.Run("vanished while read", func(t *testing.T) {
		e := newFakeEnv(t)
		e.mustCreate("a")
		e.lv.setFault(failOn("DomainGetXMLDesc", "", false, lvErrorf(libvirt.ErrNoDomain, "Domain not found")))
		if err := e.p.Delete(ctx, ref); err != nil {
			t.Fatal(err)
		}
		// The domain (still there for the fake) keeps its volumes.
		e.hasInstance("a", libvirt.DomainRunning)
	})

	t.Run("defined again meanwhile", func(t *testing.T) {
		e := newFakeEnv(t)
		d := e.mustCreate("a")
		e.lv.setFault(func(c fakeCall) error {
			if c.Op == "DomainUndefineFlags" && c.After {
				e.lv.defineXML(t, d.xml) // a Create elsewhere defines it again
			}
			return nil
		})
		if err := e.p.Delete(ctx, ref); err != nil {
			t.Fatal(err)
		}
		e.hasInstance("a", libvirt.DomainShutoff) // its volumes stay with it
	})

	t.Run("pool gone", func(t *testing.T) {
		e := newFakeEnv(t)
		e.mustCreate("a")
		e.lv.mu.Lock()
		delete(e.lv.pools, e.cfg.Pool)
		e.lv.mu.Unlock()
		// Its volumes may still be on disk: Delete cannot succeed, and
		// must not say NotFound; it names the pool.
		err := e.p.Delete(ctx, ref)
		if errs.Code(err) != errs.Permanent || !strings.Contains(err.Error(), e.cfg.Pool) {
			t.Fatalf("Delete with the pool gone: %v (code %v), want Permanent naming the pool", err, errs.Code(err))
		}
		if len(e.lv.domainNames()) != 0 {
			t.Error("domain left")
		}
		if err := e.p.Delete(ctx, ref); errs.Code(err) != errs.Permanent {
			t.Errorf("Delete again: %v (code %v), want Permanent", err, errs.Code(err))
		}
	})

	for _, tc := range []struct {
		name  string
		fault func(fakeCall) error
		want  errs.ErrorCode
		left  bool // the domain stays
	}{
		{"destroy fails", failOn("DomainDestroy", "", false, lvErrorf(libvirt.ErrInternalError, "internal error")), errs.Transient, true},
		{"destroy: not running", failOn("DomainDestroy", "", false, lvErrorf(libvirt.ErrOperationInvalid, "domain is not running")), errs.OK, true}, // undefined while running: transient until destroyed
		{"undefine fails", failOn("DomainUndefineFlags", "", false, lvErrorf(libvirt.ErrInternalError, "internal error")), errs.Transient, true},
		{"undefine: gone", failOn("DomainUndefineFlags", "", false, lvErrorf(libvirt.ErrNoDomain, "Domain not found")), errs.OK, true},
		{"lookup fails", failOn("DomainLookupByName", "", false, lvErrorf(libvirt.ErrInternalError, "internal error")), errs.Transient, true},
		{"state fails", failOn("DomainGetState", "", false, lvErrorf(libvirt.ErrInternalError, "internal error")), errs.Transient, true},
		{"volume busy", failOn("StorageVolDelete", "", false, lvErrorf(libvirt.ErrOperationInvalid, "volume is still in use")), errs.Transient, false},
		{"volume gone meanwhile", failOn("StorageVolDelete", "", false, lvErrorf(libvirt.ErrNoStorageVol, "Storage volume not found")), errs.OK, false},
		{"volume lookup fails", failOn("StorageVolLookupByName", "", false, lvErrorf(libvirt.ErrInternalError, "internal error")), errs.Transient, false},
		{"link dies", failOn("DomainDestroy", "", false, libvirt.ErrInterrupted), errs.Transient, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newFakeEnv(t)
			e.mustCreate("a")
			e.lv.setFault(tc.fault)
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
			if _, ok := e.lv.domain(e.dom("a")); ok != tc.left {
				t.Errorf("domain left: %v, want %v", ok, tc.left)
			}
			// Once the cause is gone, Delete finishes.
			e.lv.setFault(nil)
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
			e.sess.setDial(func() error {
				return &sshconn.Error{Kind: k, Address: fakeAddr, Op: "dial", Err: errors.New(k.String())}
			})
		}
	}
	fault := func(op string, err error) func(*fakeEnv) {
		return func(e *fakeEnv) { e.lv.setFault(failOn(op, "", false, err)) }
	}
	pool := func(f func(*fakePool)) func(*fakeEnv) {
		return func(e *fakeEnv) { e.lv.mu.Lock(); f(e.lv.pools[e.cfg.Pool]); e.lv.mu.Unlock() }
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
		{"libvirt access denied", fault("ConnectGetHostname", lvErrorf(libvirt.ErrAccessDenied, "access denied")), egressproxy.ReasonForbidden, nil},
		{"link dies", fault("ConnectGetLibVersion", libvirt.ErrInterrupted), egressproxy.ReasonUnreachable, []string{"hostname"}},
		{"rpc error", fault("ConnectGetLibVersion", lvErrorf(libvirt.ErrRPC, "rpc error")), egressproxy.ReasonUnreachable, []string{"hostname"}},
		{"pool missing", pool(func(p *fakePool) { p.pool.Name = "renamed" }), egressproxy.ReasonPoolNotFound, []string{"hostname", "libvirtVersion"}},
		{"pool inactive", pool(func(p *fakePool) { p.state = uint8(libvirt.StoragePoolInactive) }), egressproxy.ReasonPoolNotActive, []string{"hostname", "libvirtVersion", "poolState"}},
		{"pool info fails", fault("StoragePoolGetInfo", lvErrorf(libvirt.ErrInternalError, "internal error")), egressproxy.ReasonUnknown, []string{"hostname", "libvirtVersion"}},
		{"pool refresh fails", fault("StoragePoolRefresh", lvErrorf(libvirt.ErrInternalError, "internal error")), egressproxy.ReasonUnknown, []string{"hostname", "libvirtVersion", "poolState"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newFakeEnv(t)
			tc.setup(e)
			if tc.name == "pool missing" {
				// The fake finds pools by map key: move it.
				e.lv.mu.Lock()
				e.lv.pools["renamed"] = e.lv.pools[e.cfg.Pool]
				delete(e.lv.pools, e.cfg.Pool)
				e.lv.mu.Unlock()
			}
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
		fault("StoragePoolRefresh", lvErrorf(libvirt.ErrInternalError, "internal error: pool '%s' has asynchronous jobs running.", e.cfg.Pool))(e)
		h, err := e.p.Check(ctx)
		if err != nil || !h.Reachable || h.Details["poolFreeGiB"] == "" || !strings.Contains(h.Details["poolRefresh"], "asynchronous jobs running") {
			t.Errorf("%+v, %v; want Reachable with poolFreeGiB and a poolRefresh detail", h, err)
		}
	})

	t.Run("pool in an unknown state", func(t *testing.T) {
		e := newFakeEnv(t)
		pool(func(p *fakePool) { p.state = 9 })(e)
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
		hook, entered, _ := e.lv.block("ConnectGetLibVersion", "")
		e.lv.setFault(hook)
		done := make(chan error, 1)
		go func() { <-entered; done <- e.p.Close() }()
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
	if e.images.closed != 1 || e.sess.closes != 1 {
		t.Errorf("images closed %d, session %d times; want once each", e.images.closed, e.sess.closes)
	}
	e.lv.resetCalls()
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
	if n := e.lv.callCount(""); n != 0 {
		t.Errorf("%d libvirt calls after Close", n)
	}
	e.hasInstance("a", libvirt.DomainRunning) // Close deletes nothing
}

// TestFakeSessionClosedUnderneath: a session that reports closed (the
// provider not closed) is ErrClosed, Permanent, for every call.
func TestFakeSessionClosedUnderneath(t *testing.T) {
	e := newFakeEnv(t)
	e.mustCreate("a")
	e.sess.setDial(func() error { return e.sess.closedError() })
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
	internal := lvErrorf(libvirt.ErrInternalError, "internal error")
	for _, tc := range []struct {
		name     string
		fault    func(fakeCall) error
		contains string
	}{
		{"pool lookup fails", failOn("StoragePoolLookupByName", "", false, internal), "look up pool"},
		{"domain lookup before a volume fails", failNth("DomainLookupByName", 2, internal), "look up domain"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newFakeEnv(t)
			e.mustCreate("a")
			e.lv.setFault(tc.fault)
			err := e.p.Delete(ctx, fakeSpec("a").Ref())
			wantCode(t, tc.name, err, errs.Transient)
			if !strings.Contains(err.Error(), tc.contains) {
				t.Errorf("err %q: want %q", err, tc.contains)
			}
			if len(e.lv.volNames(e.cfg.Pool)) != 3 {
				t.Errorf("volumes %v: want them kept", e.lv.volNames(e.cfg.Pool))
			}
			e.lv.setFault(nil)
			if err := e.p.Delete(ctx, fakeSpec("a").Ref()); err != nil {
				t.Fatal(err)
			}
			e.onlyBases("after the retried Delete")
		})
	}
}
