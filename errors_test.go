package egressproxy_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
	"github.com/egressproxy/egressproxy/memprovider"
)

var classSentinels = map[egressproxy.ErrorCode]error{
	egressproxy.Transient: egressproxy.ErrTransient,
	egressproxy.Permanent: egressproxy.ErrPermanent,
	egressproxy.NotFound:  egressproxy.ErrNotFound,
}

// oneClass fails unless err has exactly the class want: Code says it and
// errors.Is matches its sentinel and no other.
func oneClass(t *testing.T, what string, err error, want egressproxy.ErrorCode) {
	t.Helper()
	if got := egressproxy.Code(err); got != want {
		t.Errorf("%s: Code = %v, want %v (err: %v)", what, got, want, err)
	}
	for c, s := range classSentinels {
		if errors.Is(err, s) != (c == want) {
			t.Errorf("%s: errors.Is(err, %v) = %v with class %v (err: %v)", what, s, errors.Is(err, s), want, err)
		}
	}
}

// TestClientAddsNoSecondClass: whatever a provider returns, the client's
// error has one class: the provider's when it has one (even a bare
// sentinel), Transient when it has none.
func TestClientAddsNoSecondClass(t *testing.T) {
	for _, tt := range []struct {
		name string
		err  error
		want egressproxy.ErrorCode
	}{
		{"bare not found", egressproxy.ErrNotFound, egressproxy.NotFound},
		{"fmt-wrapped not found", fmt.Errorf("lookup: %w", egressproxy.ErrNotFound), egressproxy.NotFound},
		{"fmt-wrapped closed", fmt.Errorf("backend: %w", egressproxy.ErrClosed), egressproxy.Permanent},
		{"fmt-wrapped spec conflict", fmt.Errorf("backend: %w", egressproxy.ErrSpecConflict), egressproxy.Permanent},
		{"unclassed", io.ErrUnexpectedEOF, egressproxy.Transient},
		{"unclassed join", errors.Join(io.EOF, io.ErrUnexpectedEOF), egressproxy.Transient},
		{"classed", errs.Errorf(egressproxy.Permanent, "refused: %w", io.EOF), egressproxy.Permanent},
		{"join of classes: the first", errors.Join(io.EOF, egressproxy.ErrNotFound, errs.WithCode(egressproxy.Transient, io.EOF)), egressproxy.NotFound},
		{"WithCode(OK) from a buggy backend", errs.WithCode(egressproxy.OK, egressproxy.ErrNotFound), egressproxy.Transient},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := memprovider.New(nil)

			var p *memprovider.Control

			c.As(&p)
			defer c.Close()
			p.InjectFault(memprovider.OpGet, memprovider.Fault{Err: tt.err}) // returned as is
			_, err := c.Get(context.Background(), egressproxy.Ref{Name: "proxy-1", UID: "u1"})
			if tt.name == "join of classes: the first" {
				// Several classes stay visible; Code is the first and
				// errors.Is agrees with it.
				if egressproxy.Code(err) != tt.want || !errors.Is(err, classSentinels[tt.want]) {
					t.Fatalf("Code = %v, errors.Is(%v) = %v", egressproxy.Code(err), tt.want, errors.Is(err, classSentinels[tt.want]))
				}
				return
			}
			oneClass(t, "Get", err, tt.want)
			if errors.Is(tt.err, egressproxy.ErrClosed) && !errors.Is(err, egressproxy.ErrClosed) {
				t.Errorf("ErrClosed lost: %v", err)
			}
		})
	}
}

// TestGoldenMessages pins the exact text of every failure shape of the
// client over memprovider: one prefix per layer, nothing said twice, caller
// input quoted, escaped and bounded.
func TestGoldenMessages(t *testing.T) {
	ctx := context.Background()
	long := strings.Repeat("a", 1<<20)
	a64 := strings.Repeat("a", 64)
	good := egressproxy.Spec{Name: "proxy-1", UID: "u1"}
	tests := []struct {
		name string
		call func(c *egressproxy.Client, p *memprovider.Control) error
		code egressproxy.ErrorCode
		want string
	}{
		{"not found", func(c *egressproxy.Client, p *memprovider.Control) error {
			_, err := c.Get(ctx, egressproxy.Ref{Name: "proxy-2", UID: "u2"})
			return err
		}, egressproxy.NotFound, `egressproxy get proxy-2: memprovider: no instance with UID "u2"`},
		{"name required", func(c *egressproxy.Client, p *memprovider.Control) error {
			_, err := c.Create(ctx, egressproxy.Spec{UID: "u1"})
			return err
		}, egressproxy.Permanent, `egressproxy create: invalid Name: is required`},
		{"name shape", func(c *egressproxy.Client, p *memprovider.Control) error {
			_, err := c.Create(ctx, egressproxy.Spec{Name: "Proxy_1", UID: "u1"})
			return err
		}, egressproxy.Permanent, `egressproxy create: invalid Name "Proxy_1": may contain only lowercase letters, digits and '-'`},
		{"name ends", func(c *egressproxy.Client, p *memprovider.Control) error {
			_, err := c.Create(ctx, egressproxy.Spec{Name: "-a", UID: "u1"})
			return err
		}, egressproxy.Permanent, `egressproxy create: invalid Name "-a": must start and end with a lowercase letter or digit`},
		{"name double dash", func(c *egressproxy.Client, p *memprovider.Control) error {
			_, err := c.Create(ctx, egressproxy.Spec{Name: "a--b", UID: "u1"})
			return err
		}, egressproxy.Permanent, `egressproxy create: invalid Name "a--b": must not contain "--"`},
		{"name 1 MiB", func(c *egressproxy.Client, p *memprovider.Control) error {
			_, err := c.Create(ctx, egressproxy.Spec{Name: long, UID: "u1"})
			return err
		}, egressproxy.Permanent, `egressproxy create: invalid Name "` + a64 + `"… (1048576 bytes): must be at most 63 characters`},
		{"name not UTF-8 with control characters", func(c *egressproxy.Client, p *memprovider.Control) error {
			_, err := c.Get(ctx, egressproxy.Ref{Name: "a\xff\nb", UID: "u1"})
			return err
		}, egressproxy.Permanent, `egressproxy get: invalid Name "a\xff\nb": may contain only lowercase letters, digits and '-'`},
		{"uid required", func(c *egressproxy.Client, p *memprovider.Control) error {
			return c.Delete(ctx, egressproxy.Ref{Name: "proxy-1"})
		}, egressproxy.Permanent, `egressproxy delete proxy-1: invalid UID: is required`},
		{"uid too long", func(c *egressproxy.Client, p *memprovider.Control) error {
			return c.Delete(ctx, egressproxy.Ref{Name: "proxy-1", UID: long})
		}, egressproxy.Permanent, `egressproxy delete proxy-1: invalid UID "` + a64 + `"… (1048576 bytes): must be at most 128 bytes`},
		{"uid not UTF-8", func(c *egressproxy.Client, p *memprovider.Control) error {
			return c.Delete(ctx, egressproxy.Ref{Name: "proxy-1", UID: "u\xff"})
		}, egressproxy.Permanent, `egressproxy delete proxy-1: invalid UID "u\xff": must be valid UTF-8`},
		{"uid control", func(c *egressproxy.Client, p *memprovider.Control) error {
			return c.Delete(ctx, egressproxy.Ref{Name: "proxy-1", UID: "u\x1b[31m"})
		}, egressproxy.Permanent, `egressproxy delete proxy-1: invalid UID "u\x1b[31m": must not contain control characters`},
		{"port", func(c *egressproxy.Client, p *memprovider.Control) error {
			_, err := c.Create(ctx, egressproxy.Spec{Name: "proxy-1", UID: "u1", Port: 70000})
			return err
		}, egressproxy.Permanent, `egressproxy create proxy-1: invalid Port "70000": must be 0 (default 3128) or 1-65535`},
		{"image key", func(c *egressproxy.Client, p *memprovider.Control) error {
			_, err := c.Create(ctx, egressproxy.Spec{Name: "proxy-1", UID: "u1", ImageKey: "Debian 12"})
			return err
		}, egressproxy.Permanent, `egressproxy create proxy-1: invalid ImageKey "Debian 12": may contain only lowercase letters, digits, '.' and '-'`},
		{"machine type", func(c *egressproxy.Client, p *memprovider.Control) error {
			_, err := c.Create(ctx, egressproxy.Spec{Name: "proxy-1", UID: "u1", MachineType: long})
			return err
		}, egressproxy.Permanent, `egressproxy create proxy-1: invalid MachineType "` + a64 + `"… (1048576 bytes): must be at most 63 characters`},
		{"user data (never echoed)", func(c *egressproxy.Client, p *memprovider.Control) error {
			_, err := c.Create(ctx, egressproxy.Spec{Name: "proxy-1", UID: "u1", UserData: "password: " + long})
			return err
		}, egressproxy.Permanent, `egressproxy create proxy-1: invalid UserData: is 1048586 bytes, at most 65536 allowed`},
		{"every field at once", func(c *egressproxy.Client, p *memprovider.Control) error {
			_, err := c.Create(ctx, egressproxy.Spec{Port: -1, ImageKey: "-"})
			return err
		}, egressproxy.Permanent, "egressproxy create: invalid Name: is required\ninvalid UID: is required\n" +
			`invalid Port "-1": must be 0 (default 3128) or 1-65535` + "\n" +
			`invalid ImageKey "-": must start and end with a lowercase letter or digit`},
		{"closed", func(c *egressproxy.Client, p *memprovider.Control) error {
			c.Close()
			_, err := c.Get(ctx, good.Ref())
			return err
		}, egressproxy.Permanent, `egressproxy get proxy-1: provider closed`},
		{"canceled", func(c *egressproxy.Client, p *memprovider.Control) error {
			cctx, cancel := context.WithCancel(ctx)
			cancel()
			_, err := c.Get(cctx, good.Ref())
			return err
		}, egressproxy.Canceled, `egressproxy get proxy-1: context canceled`},
		{"deadline", func(c *egressproxy.Client, p *memprovider.Control) error {
			dctx, cancel := context.WithDeadline(ctx, time.Unix(0, 0))
			defer cancel()
			return c.Delete(dctx, good.Ref())
		}, egressproxy.DeadlineExceeded, `egressproxy delete proxy-1: context deadline exceeded`},
		{"canceled in the provider", func(c *egressproxy.Client, p *memprovider.Control) error {
			dctx, cancel := context.WithCancel(ctx)
			defer cancel()
			// The fault's delay is cut by the context, canceled as the
			// call waits: no sleep, no race.
			p.InjectFault(memprovider.OpList, memprovider.Fault{Delay: time.Hour, Waiting: cancel})
			_, err := c.List(dctx)
			return err
		}, egressproxy.Canceled, `egressproxy list: context canceled`},
		{"spec conflict", func(c *egressproxy.Client, p *memprovider.Control) error {
			c.Create(ctx, good)
			s := good
			s.Port, s.ImageKey, s.UserData = 8080, "debian-12", "secret"
			_, err := c.Create(ctx, s)
			return err
		}, egressproxy.Permanent, `egressproxy create proxy-1: memprovider: instance exists with another spec (Port 3128, now 8080; ImageKey "", now "debian-12"; UserData differs)`},
		{"name taken", func(c *egressproxy.Client, p *memprovider.Control) error {
			c.Create(ctx, good)
			_, err := c.Create(ctx, egressproxy.Spec{Name: "proxy-1", UID: "u2"})
			return err
		}, egressproxy.Permanent, `egressproxy create proxy-1: memprovider: the name is taken by an instance with another UID`},
		{"injected transient", func(c *egressproxy.Client, p *memprovider.Control) error {
			p.InjectFault(memprovider.OpCreate, memprovider.Fault{Code: egressproxy.Transient})
			_, err := c.Create(ctx, good)
			return err
		}, egressproxy.Transient, `egressproxy create proxy-1: memprovider: injected Transient fault`},
		{"injected permanent with a cause", func(c *egressproxy.Client, p *memprovider.Control) error {
			p.InjectFault(memprovider.OpDelete, memprovider.Fault{Code: egressproxy.Permanent, Err: errors.New("disk refused")})
			return c.Delete(ctx, good.Ref())
		}, egressproxy.Permanent, `egressproxy delete proxy-1: disk refused`},
		{"injected unclassed", func(c *egressproxy.Client, p *memprovider.Control) error {
			p.InjectFault(memprovider.OpList, memprovider.Fault{Err: io.ErrUnexpectedEOF})
			_, err := c.List(ctx)
			return err
		}, egressproxy.Transient, `egressproxy list: unexpected EOF`},
		{"injected huge, invalid text", func(c *egressproxy.Client, p *memprovider.Control) error {
			p.InjectFault(memprovider.OpGet, memprovider.Fault{Code: egressproxy.Transient, Err: errors.New("\xff" + long)})
			_, err := c.Get(ctx, good.Ref())
			return err
		}, egressproxy.Transient, "egressproxy get proxy-1: \uFFFD" + strings.Repeat("a", 973) + "… (1047603 bytes cut)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := memprovider.New(nil)

			var p *memprovider.Control

			c.As(&p)
			defer c.Close()
			err := tt.call(c, p)
			if err == nil {
				t.Fatal("no error")
			}
			if got := err.Error(); got != tt.want {
				t.Errorf("message:\n got %q\nwant %q", got, tt.want)
			}
			oneClass(t, tt.name, err, tt.code)
			checkText(t, err)
		})
	}
}

// checkText fails unless err's text is valid UTF-8 of at most
// errs.MaxErrorText bytes.
func checkText(t testing.TB, err error) {
	t.Helper()
	if err == nil {
		return
	}
	msg := err.Error()
	if !utf8.ValidString(msg) || len(msg) > errs.MaxErrorText {
		t.Fatalf("error text is %d bytes, valid UTF-8 %v: %.200q", len(msg), utf8.ValidString(msg), msg)
	}
}

// FuzzClientErrorText: whatever the input, every error the client returns
// over memprovider is valid UTF-8 of at most errs.MaxErrorText bytes and
// has a class.
func FuzzClientErrorText(f *testing.F) {
	f.Add("proxy-1", "u1", 0, "", "", "")
	f.Add(strings.Repeat("a", 1<<20), strings.Repeat("\xff", 1<<16), -1, strings.Repeat("K", 4096), "\x00\n", "x")
	f.Add("a\xff\nb", "u\x1b[31m", 70000, "a--b", "Mt", strings.Repeat("u", naming.MaxUserDataBytes+1))
	f.Add(strings.Repeat("\u202e", 500), strings.Repeat("日本", 100), 3128, "debian-12", "small", "#cloud-config")
	f.Fuzz(func(t *testing.T, name, uid string, port int, key, mt, ud string) {
		c := memprovider.New(nil)

		var p *memprovider.Control

		c.As(&p)
		defer c.Close()
		ctx := context.Background()
		spec := egressproxy.Spec{Name: name, UID: uid, Port: port, ImageKey: key, MachineType: mt, UserData: ud}
		_, err := c.Create(ctx, spec)
		checkText(t, err)
		if err != nil && egressproxy.Code(err) != egressproxy.Permanent {
			t.Fatalf("Create: Code = %v, want Permanent: %v", egressproxy.Code(err), err)
		}
		_, err = c.Get(ctx, spec.Ref())
		checkText(t, err)
		if c := egressproxy.Code(err); err != nil && c != egressproxy.Permanent && c != egressproxy.NotFound {
			t.Fatalf("Get: Code = %v: %v", c, err)
		}
		// A second Create of the same name with another spec: conflict or
		// name taken, quoting what differs.
		spec.UID += "x"
		spec.ImageKey += "\xff"
		_, err = c.Create(ctx, spec)
		checkText(t, err)
		p.InjectFault(memprovider.OpDelete, memprovider.Fault{Code: egressproxy.Transient, Err: errors.New(name + uid), Times: 1})
		checkText(t, c.Delete(ctx, spec.Ref()))
		checkText(t, c.Delete(ctx, spec.Ref()))
	})
}
