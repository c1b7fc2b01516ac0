package kvm2

import (
	"context"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
)

// FuzzConfigErrorText: whatever the configuration, the error Open returns
// is valid UTF-8 of at most errs.MaxErrorText bytes, and map keys
// (image keys, machine type names) are quoted bounded in the field names.
func FuzzConfigErrorText(f *testing.F) {
	f.Add("lab-1", "operator-a", "127.0.0.1:22", "root", "default", "debian-12", "small", "")
	f.Add(strings.Repeat("E", 1<<20), "\xff\xfe", "host:\x00", "a b@c", strings.Repeat("/", 300), strings.Repeat("K\xff", 1<<16), strings.Repeat("\n", 1000), "br0\x1b")
	f.Add("lab-1", "", "[::1]:99999", "", "p\x7f", "a--b", "Big_One", strings.Repeat("b", 16))
	f.Fuzz(func(t *testing.T, entry, owner, addr, user, pool, imgKey, mtName, bridge string) {
		cfg := validConfig()
		cfg.Entry, cfg.Owner, cfg.Address, cfg.User, cfg.Pool, cfg.Bridge = entry, owner, addr, user, pool, bridge
		cfg.Network = pool
		cfg.LibvirtSocket, cfg.Kernel, cfg.ConsoleLogDir = user, addr, pool
		cfg.Images = map[string]imagecache.Image{
			imgKey:       {URL: addr, SHA256: owner, Format: user},
			imgKey + "2": {Key: entry, URL: "https://example.com/" + pool, SHA256: strings.Repeat("0", 64), Format: "qcow2"},
		}
		cfg.DefaultImage = mtName
		cfg.MachineTypes = map[string]MachineType{mtName: {VCPUs: -1, MemoryMiB: 1 << 30}, imgKey: {VCPUs: 1, MemoryMiB: 512}}
		cfg.DefaultMachineType = imgKey + mtName
		p, err := open(context.Background(), cfg, nil)
		if p != nil {
			p.Close()
		}
		if err == nil {
			return
		}
		msg := err.Error()
		if !utf8.ValidString(msg) || len(msg) > errs.MaxErrorText {
			t.Fatalf("Open error text is %d bytes, valid UTF-8 %v: %.200q", len(msg), utf8.ValidString(msg), msg)
		}
		if errs.Code(err) != errs.Permanent {
			t.Fatalf("Open: Code = %v: %v", errs.Code(err), err)
		}
		for _, line := range strings.Split(msg, "\n") {
			if len(line) > 400 {
				t.Fatalf("one violation is %d bytes long: %.200q", len(line), line)
			}
		}
	})
}

// TestMessagesThroughClient: kvm2's errors read through egressproxy.Client
// say the operation and the instance once (the client's prefix) and the
// entry once (kvm2's), then what failed.
func TestMessagesThroughClient(t *testing.T) {
	p := openOffline(t)
	c := driver.NewClient(p, nil)
	ctx := context.Background()
	ref := egressproxy.Ref{Name: "a", UID: "u"}
	exact := []struct {
		name string
		call func() error
		want string
	}{
		{"unknown image", func() error {
			_, err := c.Create(ctx, egressproxy.Spec{Name: "a", UID: "u", ImageKey: "nope"})
			return err
		}, `egressproxy create a: invalid ImageKey "nope": is not a configured image of this provider entry`},
		{"unknown machine type", func() error {
			_, err := c.Create(ctx, egressproxy.Spec{Name: "a", UID: "u", MachineType: "huge"})
			return err
		}, `egressproxy create a: invalid MachineType "huge": is not a configured machine type of this provider entry`},
	}
	for _, tt := range exact {
		if got := tt.call().Error(); got != tt.want {
			t.Errorf("%s:\n got %q\nwant %q", tt.name, got, tt.want)
		}
	}
	// The host cannot be reached (the key file does not exist): the text
	// below kvm2's prefix is sshconn's.
	for _, tt := range []struct {
		prefix string
		call   func() error
	}{
		{"egressproxy get a: kvm2 lab-1: sshconn 127.0.0.1:22: ", func() error { _, err := c.Get(ctx, ref); return err }},
		{"egressproxy create a: kvm2 lab-1: sshconn 127.0.0.1:22: ", func() error { _, err := c.Create(ctx, egressproxy.Spec{Name: "a", UID: "u"}); return err }},
		{"egressproxy delete a: kvm2 lab-1: sshconn 127.0.0.1:22: ", func() error { return c.Delete(ctx, ref) }},
		{"egressproxy list: kvm2 lab-1: sshconn 127.0.0.1:22: ", func() error { _, err := c.List(ctx); return err }},
	} {
		got := tt.call().Error()
		if !strings.HasPrefix(got, tt.prefix) || strings.Count(got, "lab-1") != 1 || strings.Count(got, " a:") > 1 ||
			strings.Count(got, "127.0.0.1:22") != 1 {
			t.Errorf("got %q, want %q and what failed, nothing said twice", got, tt.prefix+"…")
		}
	}
	p.Close()
	if _, err := c.Get(ctx, ref); err == nil || err.Error() != "egressproxy get a: kvm2 lab-1: provider closed" {
		t.Errorf("Get after the provider's Close = %v", err)
	}
	c.Close()
	if _, err := c.Get(ctx, ref); err == nil || err.Error() != "egressproxy get a: provider closed" {
		t.Errorf("Get after the client's Close = %v", err)
	}
}
