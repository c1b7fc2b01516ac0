package kvm2

import (
	"context"
	"errors"
	"fmt"
	"testing"

	libvirt "github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/libvirterr"
	"github.com/egressproxy/egressproxy/internal/testing/libvirtfake"
	"github.com/egressproxy/egressproxy/sshconn"
)

// One fault of the entry itself has one class on every operation: the
// faults the link reports (sshconn's kinds) and the one libvirtd answers to
// every call (access denied), injected into the fakes after an instance
// and its base exist, so that every operation would otherwise succeed.

// entryFault is a fault of the entry itself and the class and health
// reason it has wherever it surfaces.
type entryFault struct {
	name   string
	inject func(e *fakeEnv)
	code   errs.ErrorCode
	reason egressproxy.HealthReason
}

// linkFault makes every call of the entry fail as sshconn reports a link
// that cannot be set up with kind: the libvirt session's calls (kvm2's) and
// the image cache's, which classifies through the same table.
func linkFault(kind sshconn.Kind, op string, cause error) func(e *fakeEnv) {
	return func(e *fakeEnv) {
		err := &sshconn.Error{Kind: kind, Address: fakeAddr, Op: op, Err: cause}
		e.host.SetHook("Do", libvirtfake.Fail(err))
		e.images.setErr(libvirterr.Classify(fmt.Errorf("list volumes of pool %s: %w", e.cfg.Pool, err)))
	}
}

// libvirtFault makes libvirtd answer every call with code.
func libvirtFault(code libvirt.ErrorNumber, msg string) func(e *fakeEnv) {
	return func(e *fakeEnv) {
		err := libvirtfake.Errorf(code, "%s", msg)
		e.host.SetHook("", libvirtfake.Fail(err))
		e.images.setErr(libvirterr.Classify(fmt.Errorf("list volumes of pool %s: %w", e.cfg.Pool, err)))
	}
}

var entryFaults = []entryFault{
	{"credentials unreadable", linkFault(sshconn.KindKeyUnreadable, "read key file", errors.New("open /etc/egress/id: no such file or directory")),
		errs.Permanent, egressproxy.ReasonCredentialsUnavailable},
	{"unauthorized", linkFault(sshconn.KindAuthRefused, "handshake", errors.New("ssh: unable to authenticate")),
		errs.Permanent, egressproxy.ReasonUnauthorized},
	{"host key unknown", linkFault(sshconn.KindHostUnknown, "handshake", errors.New("knownhosts: key is unknown")),
		errs.Permanent, egressproxy.ReasonHostKeyUnknown},
	{"host key changed", linkFault(sshconn.KindHostKeyMismatch, "handshake", errors.New("knownhosts: key mismatch")),
		errs.Permanent, egressproxy.ReasonHostKeyMismatch},
	{"libvirt access denied", libvirtFault(libvirt.ErrAccessDenied, "access denied: 'domain:read' denied"),
		errs.Permanent, egressproxy.ReasonForbidden},
	{"libvirt operation denied", libvirtFault(libvirt.ErrOperationDenied, "operation forbidden: read only access prevents this"),
		errs.Permanent, egressproxy.ReasonForbidden},
	// OpenSSH refuses the socket channel alike when the user may not open
	// it and while libvirtd's socket is absent (a restart): Transient.
	{"socket channel refused", linkFault(sshconn.KindForbidden, "open unix socket", errors.New("ssh: rejected: administratively prohibited")),
		errs.Transient, egressproxy.ReasonForbidden},
	{"unreachable", linkFault(sshconn.KindUnreachable, "dial", errors.New("connect: connection refused")),
		errs.Transient, egressproxy.ReasonUnreachable},
}

// entryOp is one operation of the portable client.
type entryOp struct {
	name string
	run  func(ctx context.Context, c *egressproxy.Client, spec egressproxy.Spec) error
}

var entryOps = []entryOp{
	{"Create", func(ctx context.Context, c *egressproxy.Client, s egressproxy.Spec) error {
		_, err := c.Create(ctx, s)
		return err
	}},
	{"Get", func(ctx context.Context, c *egressproxy.Client, s egressproxy.Spec) error {
		_, err := c.Get(ctx, s.Ref())
		return err
	}},
	{"Delete", func(ctx context.Context, c *egressproxy.Client, s egressproxy.Spec) error {
		return c.Delete(ctx, s.Ref())
	}},
	{"List", func(ctx context.Context, c *egressproxy.Client, _ egressproxy.Spec) error {
		_, err := c.List(ctx)
		return err
	}},
	{"ListImages", func(ctx context.Context, c *egressproxy.Client, _ egressproxy.Spec) error {
		_, err := c.ListImages(ctx)
		return err
	}},
	{"VerifyImage", func(ctx context.Context, c *egressproxy.Client, s egressproxy.Spec) error {
		_, err := c.VerifyImage(ctx, s.ImageKey)
		return err
	}},
	{"EvictImage", func(ctx context.Context, c *egressproxy.Client, s egressproxy.Spec) error {
		return c.EvictImage(ctx, s.ImageKey)
	}},
}

// checkEntryFault runs every operation, and Check, against a client of an
// entry with the fault (client returns it; a fresh one per call when the
// link's redial backoff would slow the next call down): every error has
// the fault's class (and the same one on every operation), Check reports
// the fault's reason (its error is for the call itself: none here).
func checkEntryFault(t *testing.T, ctx context.Context, client func() *egressproxy.Client, spec egressproxy.Spec, code errs.ErrorCode, reason egressproxy.HealthReason) {
	t.Helper()
	classes := map[errs.ErrorCode][]string{}
	for _, op := range entryOps {
		err := op.run(ctx, client(), spec)
		got := errs.Code(err)
		classes[got] = append(classes[got], op.name)
		if got != code {
			t.Errorf("%s = %v (%v), want %v", op.name, got, err, code)
		}
	}
	if len(classes) > 1 {
		t.Errorf("one fault, %d classes: %v", len(classes), classes)
	}
	h, err := client().Check(ctx)
	if err != nil || h.Reachable || h.Reason != reason || h.Message == "" {
		t.Errorf("Check = %+v, %v; want not Reachable, Reason %q, a Message and no error", h, err, reason)
	}
}

func TestEntryFaultOneClassEveryOperation(t *testing.T) {
	t.Parallel()
	for _, f := range entryFaults {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			e := newFakeEnv(t)
			c := driver.NewClient(e.p, nil)
			ctx := fakeCtx(t)
			spec := egressproxy.Spec{Name: "proxy-1", UID: "uid-1", ImageKey: "tiny"}
			if _, err := c.Create(ctx, spec); err != nil {
				t.Fatalf("Create before the fault: %v", err)
			}
			f.inject(e)
			checkEntryFault(t, ctx, func() *egressproxy.Client { return c }, spec, f.code, f.reason)
		})
	}
}
