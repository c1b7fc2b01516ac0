package kvm2

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/sshconn"
)

func lverr(code libvirt.ErrorNumber) error {
	return libvirt.Error{Code: uint32(code), Message: code.String()}
}

func TestNeverRan(t *testing.T) {
	for _, tc := range []struct {
		st     libvirt.DomainState
		reason libvirt.DomainShutoffReason
		want   bool
	}{
		{libvirt.DomainShutoff, libvirt.DomainShutoffUnknown, true}, // defined, never started
		{libvirt.DomainShutoff, libvirt.DomainShutoffFailed, true},  // its start failed
		{libvirt.DomainShutoff, libvirt.DomainShutoffShutdown, false},
		{libvirt.DomainShutoff, libvirt.DomainShutoffDestroyed, false},
		{libvirt.DomainShutoff, libvirt.DomainShutoffCrashed, false},
		{libvirt.DomainRunning, 0, false},
		{libvirt.DomainPaused, 0, false},
	} {
		if got := neverRan(tc.st, int32(tc.reason)); got != tc.want {
			t.Errorf("neverRan(%v, %v) = %v, want %v", tc.st, tc.reason, got, tc.want)
		}
	}
}

func TestRacedIsTransient(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want errs.ErrorCode // after classify
	}{
		{"volume exists", lverr(libvirt.ErrStorageVolExist), errs.Transient},
		{"volume gone", lverr(libvirt.ErrNoStorageVol), errs.Transient},
		{"domain gone", lverr(libvirt.ErrNoDomain), errs.Transient},
		{"still being allocated", lverr(libvirt.ErrOperationInvalid), errs.Transient},
		{"no network stays permanent", lverr(libvirt.ErrNoNetwork), errs.Permanent},
		{"XML error stays permanent", lverr(libvirt.ErrXMLError), errs.Permanent},
		{"link dead stays transient", fmt.Errorf("x: %w", io.EOF), errs.Transient},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := classify(raced(fmt.Errorf("step: %w", tc.err)))
			if got := errs.Code(err); got != tc.want {
				t.Errorf("code %v, want %v (%v)", got, tc.want, err)
			}
		})
	}
	if raced(nil) != nil {
		t.Error("raced(nil) != nil")
	}
}

func TestInterrupted(t *testing.T) {
	p := openOffline(t)
	live := context.Background()
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		name string
		ctx  context.Context
		err  error
		want bool
	}{
		{"context ended", cancelled, errors.New("anything"), true},
		{"deadline error", live, fmt.Errorf("x: %w", context.DeadlineExceeded), true},
		{"link unreachable", live, &sshconn.Error{Kind: sshconn.KindUnreachable, Op: "libvirt call", Err: io.EOF}, true},
		{"closed", live, &sshconn.Error{Kind: sshconn.KindClosed, Op: "libvirt call"}, true},
		{"interrupted RPC", live, fmt.Errorf("define: %w", libvirt.ErrInterrupted), true},
		{"libvirt answered", live, fmt.Errorf("start: %w", lverr(libvirt.ErrNoNetwork)), false},
		{"classed by us", live, errs.Errorf(errs.Permanent, "overlay backed by another base"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := interrupted(tc.ctx, p, tc.err); got != tc.want {
				t.Errorf("interrupted = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestCheckOwned: an existing domain is this spec's instance only when it
// is ours with the UID and (when recorded) the digest; another digest is
// ErrSpecConflict, Permanent, and the message shows no user-data.
func TestCheckOwned(t *testing.T) {
	p := openOffline(t)
	spec := egressproxy.Spec{Name: "a", UID: "u", UserData: "#cloud-config\npassword: hunter2-secret\n"}
	c := &creation{p: p, spec: spec, name: domainName(p.cfg.Entry, "a"),
		meta: instanceMeta{UID: "u", Port: 3128, SpecDigest: spec.Digest()}}
	other := spec
	other.UserData = "#cloud-config\npassword: other-secret\n"
	other.Port = 8080
	mk := func(uid, digest string, port int) domainInfo {
		return domainInfo{ours: true, meta: instanceMeta{UID: uid, Created: time.Now(), Entry: p.cfg.Entry, Owner: p.cfg.Owner, Port: port, SpecDigest: digest}}
	}
	if err := c.checkOwned(mk("u", spec.Digest(), 3128)); err != nil {
		t.Errorf("same digest: %v", err)
	}
	if err := c.checkOwned(mk("u", "", 8080)); err != nil {
		t.Errorf("no recorded digest (an older domain) must not be checked: %v", err)
	}
	err := c.checkOwned(mk("u", other.Digest(), 8080))
	if !errors.Is(err, errs.ErrSpecConflict) || !errors.Is(err, errs.ErrPermanent) || errs.Code(err) != errs.Permanent {
		t.Fatalf("other digest: %v (code %v), want ErrSpecConflict, Permanent", err, errs.Code(err))
	}
	if msg := err.Error(); strings.Contains(msg, "secret") || !strings.Contains(msg, "port 8080, now 3128") {
		t.Errorf("message %q: want the port change and no user-data", msg)
	}
	err = c.checkOwned(mk("other-uid", spec.Digest(), 3128))
	if errs.Code(err) != errs.Permanent || errors.Is(err, errs.ErrSpecConflict) {
		t.Errorf("another UID: %v, want Permanent name taken (not a spec conflict)", err)
	}
}
