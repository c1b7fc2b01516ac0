package egressproxy_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/memprovider"
)

func newWaitClient(t *testing.T, o *memprovider.Options) (*egressproxy.Client, *memprovider.Control) {
	t.Helper()
	c := memprovider.New(o)
	t.Cleanup(func() { c.Close() })
	var ctl *memprovider.Control
	if !c.As(&ctl) {
		t.Fatal("no memprovider.Control")
	}
	return c, ctl
}

var fast = &egressproxy.WaitOptions{Interval: time.Millisecond}

func TestWaitRunning(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	spec := egressproxy.Spec{Name: "proxy-1", UID: "u1"}

	t.Run("comes up", func(t *testing.T) {
		t.Parallel()
		c, _ := newWaitClient(t, &memprovider.Options{ProvisionDelay: 30 * time.Millisecond})
		inst, err := c.Create(ctx, spec)
		if err != nil || inst.State != egressproxy.StateProvisioning {
			t.Fatalf("Create = %+v, %v; want Provisioning", inst, err)
		}
		inst, err = c.WaitRunning(ctx, spec.Ref(), fast)
		if err != nil || inst.State != egressproxy.StateRunning || inst.Address() == "" {
			t.Fatalf("WaitRunning = %+v, %v; want Running with an address", inst, err)
		}
	})
	t.Run("budget ends", func(t *testing.T) {
		t.Parallel()
		c, _ := newWaitClient(t, &memprovider.Options{ProvisionDelay: time.Hour})
		if _, err := c.Create(ctx, spec); err != nil {
			t.Fatal(err)
		}
		wctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
		defer cancel()
		_, err := c.WaitRunning(wctx, spec.Ref(), fast)
		if egressproxy.Code(err) != egressproxy.DeadlineExceeded || !errors.Is(err, context.DeadlineExceeded) ||
			!strings.Contains(err.Error(), "egressproxy wait proxy-1: not running (state Provisioning)") {
			t.Fatalf("err = %v (%v), want DeadlineExceeded naming the last state", err, egressproxy.Code(err))
		}
	})
	t.Run("failed and stopped end the wait", func(t *testing.T) {
		t.Parallel()
		for _, st := range []egressproxy.State{egressproxy.StateFailed, egressproxy.StateStopped} {
			c, ctl := newWaitClient(t, &memprovider.Options{ProvisionDelay: time.Hour})
			if _, err := c.Create(ctx, spec); err != nil {
				t.Fatal(err)
			}
			if err := ctl.SetState(spec.Ref(), st); err != nil {
				t.Fatal(err)
			}
			_, err := c.WaitRunning(ctx, spec.Ref(), fast)
			if egressproxy.Code(err) != egressproxy.Permanent || !strings.HasSuffix(err.Error(), "instance is "+string(st)) {
				t.Fatalf("%s: err = %v (%v), want Permanent naming the state", st, err, egressproxy.Code(err))
			}
		}
	})
	t.Run("transient reads are waited through", func(t *testing.T) {
		t.Parallel()
		c, ctl := newWaitClient(t, nil)
		if _, err := c.Create(ctx, spec); err != nil {
			t.Fatal(err)
		}
		ctl.InjectFault(memprovider.OpGet, memprovider.Fault{Code: egressproxy.Transient, Times: 3})
		if inst, err := c.WaitRunning(ctx, spec.Ref(), fast); err != nil || inst.State != egressproxy.StateRunning {
			t.Fatalf("WaitRunning = %+v, %v", inst, err)
		}
	})
	t.Run("other errors end it with their class", func(t *testing.T) {
		t.Parallel()
		c, ctl := newWaitClient(t, nil)
		if _, err := c.WaitRunning(ctx, spec.Ref(), fast); egressproxy.Code(err) != egressproxy.NotFound {
			t.Fatalf("missing instance: %v, want NotFound", err)
		}
		if _, err := c.Create(ctx, spec); err != nil {
			t.Fatal(err)
		}
		ctl.InjectFault(memprovider.OpGet, memprovider.Fault{Code: egressproxy.Permanent, Times: 1})
		if _, err := c.WaitRunning(ctx, spec.Ref(), fast); egressproxy.Code(err) != egressproxy.Permanent {
			t.Fatalf("Permanent read: %v, want Permanent", err)
		}
		var fe *egressproxy.FieldError
		if _, err := c.WaitRunning(ctx, egressproxy.Ref{Name: "Bad_Name", UID: "u"}, nil); !errors.As(err, &fe) || fe.Field != "Name" {
			t.Fatalf("bad ref: %v, want a FieldError for Name", err)
		}
	})
}
