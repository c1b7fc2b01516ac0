package egressproxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/egressproxy/egressproxy/provider"
	"github.com/egressproxy/egressproxy/provider/memprovider"
)

var classSentinels = map[provider.ErrorCode]error{
	provider.Transient: provider.ErrTransient,
	provider.Permanent: provider.ErrPermanent,
	provider.NotFound:  provider.ErrNotFound,
}

// oneClass fails unless err has exactly the class want: Code says it and
// errors.Is matches its sentinel and no other.
func oneClass(t *testing.T, what string, err error, want provider.ErrorCode) {
	t.Helper()
	if got := provider.Code(err); got != want {
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
		want provider.ErrorCode
	}{
		{"bare not found", provider.ErrNotFound, provider.NotFound},
		{"fmt-wrapped not found", fmt.Errorf("lookup: %w", provider.ErrNotFound), provider.NotFound},
		{"fmt-wrapped closed", fmt.Errorf("backend: %w", provider.ErrClosed), provider.Permanent},
		{"fmt-wrapped spec conflict", fmt.Errorf("backend: %w", provider.ErrSpecConflict), provider.Permanent},
		{"unclassed", io.ErrUnexpectedEOF, provider.Transient},
		{"unclassed join", errors.Join(io.EOF, io.ErrUnexpectedEOF), provider.Transient},
		{"classed", provider.Errorf(provider.Permanent, "refused: %w", io.EOF), provider.Permanent},
		{"join of classes: the first", errors.Join(io.EOF, provider.ErrNotFound, provider.WithCode(provider.Transient, io.EOF)), provider.NotFound},
		{"WithCode(OK) from a buggy backend", provider.WithCode(provider.OK, provider.ErrNotFound), provider.Transient},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p := memprovider.New(nil)
			c := New(p, nil)
			defer c.Close()
			p.InjectFault(memprovider.OpGet, memprovider.Fault{Err: tt.err}) // returned as is
			_, err := c.Get(context.Background(), provider.Ref{Name: "proxy-1", UID: "u1"})
			if tt.name == "join of classes: the first" {
				// Several classes stay visible; Code is the first and
				// errors.Is agrees with it.
				if provider.Code(err) != tt.want || !errors.Is(err, classSentinels[tt.want]) {
					t.Fatalf("Code = %v, errors.Is(%v) = %v", provider.Code(err), tt.want, errors.Is(err, classSentinels[tt.want]))
				}
				return
			}
			oneClass(t, "Get", err, tt.want)
			if errors.Is(tt.err, provider.ErrClosed) && !errors.Is(err, provider.ErrClosed) {
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
	good := provider.Spec{Name: "proxy-1", UID: "u1"}
	tests := []struct {
		name string
		call func(c *Client, p *memprovider.Provider) error
		code provider.ErrorCode
		want string
	}{
		{"not found", func(c *Client, p *memprovider.Provider) error {
			_, err := c.Get(ctx, provider.Ref{Name: "proxy-2", UID: "u2"})
			return err
		}, provider.NotFound, `egressproxy get proxy-2: memprovider: no instance with UID "u2"`},
		{"name required", func(c *Client, p *memprovider.Provider) error {
			_, err := c.Create(ctx, provider.Spec{UID: "u1"})
			return err
		}, provider.Permanent, `egressproxy create: invalid Name: is required`},
		{"name shape", func(c *Client, p *memprovider.Provider) error {
			_, err := c.Create(ctx, provider.Spec{Name: "Proxy_1", UID: "u1"})
			return err
		}, provider.Permanent, `egressproxy create: invalid Name "Proxy_1": may contain only lowercase letters, digits and '-'`},
		{"name ends", func(c *Client, p *memprovider.Provider) error {
			_, err := c.Create(ctx, provider.Spec{Name: "-a", UID: "u1"})
			return err
		}, provider.Permanent, `egressproxy create: invalid Name "-a": must start and end with a lowercase letter or digit`},
		{"name double dash", func(c *Client, p *memprovider.Provider) error {
			_, err := c.Create(ctx, provider.Spec{Name: "a--b", UID: "u1"})
			return err
		}, provider.Permanent, `egressproxy create: invalid Name "a--b": must not contain "--"`},
		{"name 1 MiB", func(c *Client, p *memprovider.Provider) error {
			_, err := c.Create(ctx, provider.Spec{Name: long, UID: "u1"})
			return err
		}, provider.Permanent, `egressproxy create: invalid Name "` + a64 + `"… (1048576 bytes): must be at most 63 characters`},
		{"name not UTF-8 with control characters", func(c *Client, p *memprovider.Provider) error {
			_, err := c.Get(ctx, provider.Ref{Name: "a\xff\nb", UID: "u1"})
			return err
		}, provider.Permanent, `egressproxy get: invalid Name "a\xff\nb": may contain only lowercase letters, digits and '-'`},
		{"uid required", func(c *Client, p *memprovider.Provider) error {
			return c.Delete(ctx, provider.Ref{Name: "proxy-1"})
		}, provider.Permanent, `egressproxy delete proxy-1: invalid UID: is required`},
		{"uid too long", func(c *Client, p *memprovider.Provider) error {
			return c.Delete(ctx, provider.Ref{Name: "proxy-1", UID: long})
		}, provider.Permanent, `egressproxy delete proxy-1: invalid UID "` + a64 + `"… (1048576 bytes): must be at most 128 bytes`},
		{"uid not UTF-8", func(c *Client, p *memprovider.Provider) error {
			return c.Delete(ctx, provider.Ref{Name: "proxy-1", UID: "u\xff"})
		}, provider.Permanent, `egressproxy delete proxy-1: invalid UID "u\xff": must be valid UTF-8`},
		{"uid control", func(c *Client, p *memprovider.Provider) error {
			return c.Delete(ctx, provider.Ref{Name: "proxy-1", UID: "u\x1b[31m"})
		}, provider.Permanent, `egressproxy delete proxy-1: invalid UID "u\x1b[31m": must not contain control characters`},
		{"port", func(c *Client, p *memprovider.Provider) error {
			_, err := c.Create(ctx, provider.Spec{Name: "proxy-1", UID: "u1", Port: 70000})
			return err
		}, provider.Permanent, `egressproxy create proxy-1: invalid Port "70000": must be 0 (default 3128) or 1-65535`},
		{"image key", func(c *Client, p *memprovider.Provider) error {
			_, err := c.Create(ctx, provider.Spec{Name: "proxy-1", UID: "u1", ImageKey: "Debian 12"})
			return err
		}, provider.Permanent, `egressproxy create proxy-1: invalid ImageKey "Debian 12": may contain only lowercase letters, digits, '.' and '-'`},
		{"machine type", func(c *Client, p *memprovider.Provider) error {
			_, err := c.Create(ctx, provider.Spec{Name: "proxy-1", UID: "u1", MachineType: long})
			return err
		}, provider.Permanent, `egressproxy create proxy-1: invalid MachineType "` + a64 + `"… (1048576 bytes): must be at most 63 characters`},
		{"user data (never echoed)", func(c *Client, p *memprovider.Provider) error {
			_, err := c.Create(ctx, provider.Spec{Name: "proxy-1", UID: "u1", UserData: "password: " + long})
			return err
		}, provider.Permanent, `egressproxy create proxy-1: invalid UserData: is 1048586 bytes, at most 65536 allowed`},
		{"every field at once", func(c *Client, p *memprovider.Provider) error {
			_, err := c.Create(ctx, provider.Spec{Port: -1, ImageKey: "-"})
			return err
		}, provider.Permanent, "egressproxy create: invalid Name: is required\ninvalid UID: is required\n" +
			`invalid Port "-1": must be 0 (default 3128) or 1-65535` + "\n" +
			`invalid ImageKey "-": must start and end with a lowercase letter or digit`},
		{"closed", func(c *Client, p *memprovider.Provider) error {
			c.Close()
			_, err := c.Get(ctx, good.Ref())
			return err
		}, provider.Permanent, `egressproxy get proxy-1: provider closed`},
		{"provider closed under the client", func(c *Client, p *memprovider.Provider) error {
			p.Close()
			_, err := c.Get(ctx, good.Ref())
			return err
		}, provider.Permanent, `egressproxy get proxy-1: memprovider: provider closed`},
		{"canceled", func(c *Client, p *memprovider.Provider) error {
			cctx, cancel := context.WithCancel(ctx)
			cancel()
			_, err := c.Get(cctx, good.Ref())
			return err
		}, provider.Canceled, `egressproxy get proxy-1: context canceled`},
		{"deadline", func(c *Client, p *memprovider.Provider) error {
			dctx, cancel := context.WithDeadline(ctx, time.Unix(0, 0))
			defer cancel()
			return c.Delete(dctx, good.Ref())
		}, provider.DeadlineExceeded, `egressproxy delete proxy-1: context deadline exceeded`},
		{"canceled in the provider", func(c *Client, p *memprovider.Provider) error {
			dctx, cancel := context.WithCancel(ctx)
			defer cancel()
			// The fault's delay is cut by the context, canceled as the
			// call waits: no sleep, no race.
			p.InjectFault(memprovider.OpList, memprovider.Fault{Delay: time.Hour, Waiting: cancel})
			_, err := c.List(dctx)
			return err
		}, provider.Canceled, `egressproxy list: context canceled`},
		{"spec conflict", func(c *Client, p *memprovider.Provider) error {
			c.Create(ctx, good)
			s := good
			s.Port, s.ImageKey, s.UserData = 8080, "debian-12", "secret"
			_, err := c.Create(ctx, s)
			return err
		}, provider.Permanent, `egressproxy create proxy-1: memprovider: instance exists with another spec (Port 3128, now 8080; ImageKey "", now "debian-12"; UserData differs)`},
		{"name taken", func(c *Client, p *memprovider.Provider) error {
			c.Create(ctx, good)
			_, err := c.Create(ctx, provider.Spec{Name: "proxy-1", UID: "u2"})
			return err
		}, provider.Permanent, `egressproxy create proxy-1: memprovider: the name is taken by an instance with another UID`},
		{"injected transient", func(c *Client, p *memprovider.Provider) error {
			p.InjectFault(memprovider.OpCreate, memprovider.Fault{Code: provider.Transient})
			_, err := c.Create(ctx, good)
			return err
		}, provider.Transient, `egressproxy create proxy-1: memprovider: injected Transient fault`},
		{"injected permanent with a cause", func(c *Client, p *memprovider.Provider) error {
			p.InjectFault(memprovider.OpDelete, memprovider.Fault{Code: provider.Permanent, Err: errors.New("disk refused")})
			return c.Delete(ctx, good.Ref())
		}, provider.Permanent, `egressproxy delete proxy-1: disk refused`},
		{"injected unclassed", func(c *Client, p *memprovider.Provider) error {
			p.InjectFault(memprovider.OpList, memprovider.Fault{Err: io.ErrUnexpectedEOF})
			_, err := c.List(ctx)
			return err
		}, provider.Transient, `egressproxy list: unexpected EOF`},
		{"injected huge, invalid text", func(c *Client, p *memprovider.Provider) error {
			p.InjectFault(memprovider.OpGet, memprovider.Fault{Code: provider.Transient, Err: errors.New("\xff" + long)})
			_, err := c.Get(ctx, good.Ref())
			return err
		}, provider.Transient, "egressproxy get proxy-1: \uFFFD" + strings.Repeat("a", 973) + "… (1047603 bytes cut)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := memprovider.New(nil)
			c := New(p, nil)
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
// provider.MaxErrorText bytes.
func checkText(t testing.TB, err error) {
	t.Helper()
	if err == nil {
		return
	}
	msg := err.Error()
	if !utf8.ValidString(msg) || len(msg) > provider.MaxErrorText {
		t.Fatalf("error text is %d bytes, valid UTF-8 %v: %.200q", len(msg), utf8.ValidString(msg), msg)
	}
}

// FuzzClientErrorText: whatever the input, every error the client returns
// over memprovider is valid UTF-8 of at most provider.MaxErrorText bytes and
// has a class.
func FuzzClientErrorText(f *testing.F) {
	f.Add("proxy-1", "u1", 0, "", "", "")
	f.Add(strings.Repeat("a", 1<<20), strings.Repeat("\xff", 1<<16), -1, strings.Repeat("K", 4096), "\x00\n", "x")
	f.Add("a\xff\nb", "u\x1b[31m", 70000, "a--b", "Mt", strings.Repeat("u", provider.MaxUserDataBytes+1))
	f.Add(strings.Repeat("\u202e", 500), strings.Repeat("日本", 100), 3128, "debian-12", "small", "#cloud-config")
	f.Fuzz(func(t *testing.T, name, uid string, port int, key, mt, ud string) {
		p := memprovider.New(nil)
		c := New(p, nil)
		defer c.Close()
		ctx := context.Background()
		spec := provider.Spec{Name: name, UID: uid, Port: port, ImageKey: key, MachineType: mt, UserData: ud}
		_, err := c.Create(ctx, spec)
		checkText(t, err)
		if err != nil && provider.Code(err) != provider.Permanent {
			t.Fatalf("Create: Code = %v, want Permanent: %v", provider.Code(err), err)
		}
		_, err = c.Get(ctx, spec.Ref())
		checkText(t, err)
		if c := provider.Code(err); err != nil && c != provider.Permanent && c != provider.NotFound {
			t.Fatalf("Get: Code = %v: %v", c, err)
		}
		// A second Create of the same name with another spec: conflict or
		// name taken, quoting what differs.
		spec.UID += "x"
		spec.ImageKey += "\xff"
		_, err = c.Create(ctx, spec)
		checkText(t, err)
		p.InjectFault(memprovider.OpDelete, memprovider.Fault{Code: provider.Transient, Err: errors.New(name + uid), Times: 1})
		checkText(t, c.Delete(ctx, spec.Ref()))
		checkText(t, c.Delete(ctx, spec.Ref()))
	})
}
