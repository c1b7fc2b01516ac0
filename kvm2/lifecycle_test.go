package kvm2

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
)

// The provider below points at a host that does not exist and a key file
// that does not exist: any attempt to touch the host would fail with an
// sshconn error, never with a *errs.FieldError.
func openOffline(t *testing.T) *provider {
	t.Helper()
	c := validConfig()
	c.Images = map[string]imagecache.Image{"tiny": {URL: "http://127.0.0.1:1/tiny.qcow2"}}
	p, err := open(context.Background(), c, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func TestBadInputTouchesNothing(t *testing.T) {
	p := openOffline(t)
	ctx := context.Background()
	tests := []struct {
		name  string
		call  func() error
		field string
	}{
		{"create bad name", func() error { _, err := p.Create(ctx, egressproxy.Spec{Name: "Bad_Name", UID: "u"}); return err }, "Name"},
		{"create no uid", func() error { _, err := p.Create(ctx, egressproxy.Spec{Name: "a"}); return err }, "UID"},
		{"create oversized user-data", func() error {
			_, err := p.Create(ctx, egressproxy.Spec{Name: "a", UID: "u", UserData: strings.Repeat("x", naming.MaxUserDataBytes+1)})
			return err
		}, "UserData"},
		{"create unknown image", func() error {
			_, err := p.Create(ctx, egressproxy.Spec{Name: "a", UID: "u", ImageKey: "nope"})
			return err
		}, "ImageKey"},
		{"create unknown machine type", func() error {
			_, err := p.Create(ctx, egressproxy.Spec{Name: "a", UID: "u", MachineType: "huge"})
			return err
		}, "MachineType"},
		{"create uid XML cannot carry", func() error { _, err := p.Create(ctx, egressproxy.Spec{Name: "a", UID: "a\uFFFEb"}); return err }, "UID"},
		{"get bad ref", func() error { _, err := p.Get(ctx, egressproxy.Ref{Name: "a--b", UID: "u"}); return err }, "Name"},
		{"delete bad ref", func() error { return p.Delete(ctx, egressproxy.Ref{Name: "a", UID: ""}) }, "UID"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.call()
			if errs.Code(err) != errs.Permanent {
				t.Fatalf("err = %v (code %v), want Permanent", err, errs.Code(err))
			}
			found := false
			for _, e := range unjoin(err) {
				var fe *errs.FieldError
				if errors.As(e, &fe) && fe.Field == tt.field {
					found = true
				}
			}
			if !found {
				t.Errorf("err %v does not name field %s", err, tt.field)
			}
		})
	}
}

func TestCallsAfterClose(t *testing.T) {
	p := openOffline(t)
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	_, e1 := p.Create(ctx, egressproxy.Spec{Name: "a", UID: "u"})
	_, e2 := p.Get(ctx, egressproxy.Ref{Name: "a", UID: "u"})
	e3 := p.Delete(ctx, egressproxy.Ref{Name: "a", UID: "u"})
	_, e4 := p.List(ctx)
	_, e5 := p.Check(ctx)
	for i, err := range []error{e1, e2, e3, e4, e5} {
		if !errors.Is(err, errs.ErrClosed) || errs.Code(err) != errs.Permanent {
			t.Errorf("call %d after Close: %v", i, err)
		}
	}
	if err := p.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

func TestNameLocks(t *testing.T) {
	var n nameLocks
	unlock, err := n.lock(context.Background(), "a")
	if err != nil {
		t.Fatal(err)
	}
	// Another name is independent.
	u2, err := n.lock(context.Background(), "b")
	if err != nil {
		t.Fatal(err)
	}
	u2()
	// The same name waits; a cancelled wait returns the context code.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := n.lock(ctx, "a"); errs.Code(err) != errs.Canceled {
		t.Errorf("locked name with cancelled ctx: %v", err)
	}
	unlock()
	u3, err := n.lock(context.Background(), "a")
	if err != nil {
		t.Fatal(err)
	}
	u3()
	if len(n.locks) != 0 {
		t.Errorf("locks not released: %v", n.locks)
	}
}
