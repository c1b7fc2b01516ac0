package kvm2

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
)

func validConfig() Config {
	return Config{
		Entry:          "lab-1",
		Owner:          "operator-a",
		Address:        "127.0.0.1:22",
		User:           "root",
		KeyFile:        "/nonexistent/key",
		KnownHostsFile: "/nonexistent/known_hosts",
		Pool:           "default",
	}
}

func TestConfigDefaults(t *testing.T) {
	t.Parallel()
	c, err := validConfig().validate(false)
	if err != nil {
		t.Fatalf("validate: %v", err)
	}
	checks := []struct{ field, got, want string }{
		{"LibvirtSocket", c.LibvirtSocket, defaultLibvirtSocket},
		{"LibvirtURI", c.LibvirtURI, defaultLibvirtURI},
		{"DomainType", c.DomainType, ""}, // automatic: decided on first use (accel.go)
		{"Network", c.Network, "default"},
		{"DefaultMachineType", c.DefaultMachineType, "small"},
	}
	for _, ch := range checks {
		if ch.got != ch.want {
			t.Errorf("%s = %q, want %q", ch.field, ch.got, ch.want)
		}
	}
	if mt := c.MachineTypes["small"]; mt.VCPUs != 1 || mt.MemoryMiB != 512 {
		t.Errorf("default machine type = %+v", mt)
	}
	if c.CallTimeout != defaultCallTimeout {
		t.Errorf("CallTimeout = %v", c.CallTimeout)
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		mutate func(*Config)
		field  string // the field the error must name
		rule   string // part of the rule
	}{
		{"entry missing", func(c *Config) { c.Entry = "" }, "Entry", "required"},
		{"entry upper", func(c *Config) { c.Entry = "Lab" }, "Entry", "lowercase"},
		{"entry double dash", func(c *Config) { c.Entry = "a--b" }, "Entry", `"--"`},
		{"entry too long", func(c *Config) { c.Entry = strings.Repeat("a", 64) }, "Entry", "at most 63"},
		{"owner missing", func(c *Config) { c.Owner = "" }, "Owner", "required"},
		{"owner slash", func(c *Config) { c.Owner = "a/b" }, "Owner", "lowercase"},
		{"address missing", func(c *Config) { c.Address = "" }, "Address", "required"},
		{"address no port", func(c *Config) { c.Address = "host" }, "Address", "host:port"},
		{"address bad port", func(c *Config) { c.Address = "host:99999" }, "Address", "1-65535"},
		{"address empty host", func(c *Config) { c.Address = ":22" }, "Address", "host must not be empty"},
		{"user missing", func(c *Config) { c.User = "" }, "User", "required"},
		{"user at", func(c *Config) { c.User = "a@b" }, "User", "'@'"},
		{"key missing", func(c *Config) { c.KeyFile = "" }, "KeyFile", "required"},
		{"known hosts missing", func(c *Config) { c.KnownHostsFile = "" }, "KnownHostsFile", "cannot be skipped"},
		{"socket relative", func(c *Config) { c.LibvirtSocket = "run/sock" }, "LibvirtSocket", "absolute"},
		{"uri bad", func(c *Config) { c.LibvirtURI = "system" }, "LibvirtURI", "libvirt URI"},
		{"pool missing", func(c *Config) { c.Pool = "" }, "Pool", "required"},
		{"pool slash", func(c *Config) { c.Pool = "a/b" }, "Pool", "'/'"},
		{"pool control", func(c *Config) { c.Pool = "a\nb" }, "Pool", "control"},
		{"machine type key", func(c *Config) { c.MachineTypes = map[string]MachineType{"Big": {1, 512}} }, `MachineTypes["Big"]`, "lowercase"},
		{"machine type vcpus", func(c *Config) { c.MachineTypes = map[string]MachineType{"big": {0, 512}} }, `MachineTypes["big"].VCPUs`, "1-256"},
		{"machine type memory", func(c *Config) { c.MachineTypes = map[string]MachineType{"big": {1, 16}} }, `MachineTypes["big"].MemoryMiB`, "64-"},
		{"default machine type unknown", func(c *Config) { c.DefaultMachineType = "huge" }, "DefaultMachineType", "key of MachineTypes"},
		{"default machine type needed", func(c *Config) {
			c.MachineTypes = map[string]MachineType{"a": {1, 512}, "b": {2, 1024}}
		}, "DefaultMachineType", "required"},
		{"network and bridge", func(c *Config) { c.Network = "n"; c.Bridge = "br0" }, "Bridge", "must be empty when Network"},
		{"bridge long", func(c *Config) { c.Bridge = strings.Repeat("b", 16) }, "Bridge", "15"},
		{"domain type", func(c *Config) { c.DomainType = "xen" }, "DomainType", `"kvm", "qemu", or empty`},
		{"kernel relative", func(c *Config) { c.Kernel = "vmlinuz" }, "Kernel", "absolute"},
		{"initrd without kernel", func(c *Config) { c.Initrd = "/boot/initrd" }, "Initrd", "requires Kernel"},
		{"cmdline without kernel", func(c *Config) { c.Cmdline = "console=ttyS0" }, "Cmdline", "requires Kernel"},
		{"image key", func(c *Config) { c.Images = map[string]imagecache.Image{"Bad": {URL: "http://x/y"}} }, `Images["Bad"]`, "lowercase"},
		{"image key mismatch", func(c *Config) { c.Images = map[string]imagecache.Image{"a": {Key: "b", URL: "http://x/y"}} }, `Images["a"].Key`, "equal the map key"},
		{"image url", func(c *Config) { c.Images = map[string]imagecache.Image{"a": {URL: "ftp://x/y"}} }, `Images["a"].URL`, "http"},
		{"image digest", func(c *Config) { c.Images = map[string]imagecache.Image{"a": {URL: "http://x/y", SHA256: "abc"}} }, `Images["a"].SHA256`, "64"},
		{"default image needed", func(c *Config) {
			c.Images = map[string]imagecache.Image{"a": {URL: "http://x/a"}, "b": {URL: "http://x/b"}}
		}, "DefaultImage", "required"},
		{"default image unknown", func(c *Config) {
			c.Images = map[string]imagecache.Image{"a": {URL: "http://x/a"}}
			c.DefaultImage = "z"
		}, "DefaultImage", "key of Images"},
		{"console log dir relative", func(c *Config) { c.ConsoleLogDir = "logs" }, "ConsoleLogDir", "absolute"},
		{"transfer budget negative", func(c *Config) { c.TransferBudget = -1 }, "TransferBudget", "negative"},
		{"claim timeout negative", func(c *Config) { c.ClaimTimeout = -1 }, "ClaimTimeout", "zero (the image cache's default, 2m) or at least 10s"},
		{"claim timeout too short", func(c *Config) { c.ClaimTimeout = minClaimTimeout - time.Millisecond }, "ClaimTimeout", "at least 10s"},
		{"call timeout negative", func(c *Config) { c.CallTimeout = -1 }, "CallTimeout", "negative"},
		{"dial timeout negative", func(c *Config) { c.DialTimeout = -1 }, "DialTimeout", "negative"},
		{"keepalive count negative", func(c *Config) { c.KeepaliveCount = -1 }, "KeepaliveCount", "negative"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := validConfig()
			tt.mutate(&c)
			_, err := c.validate(false)
			if err == nil {
				t.Fatal("validate accepted a bad config")
			}
			if errs.Code(err) != errs.Permanent {
				t.Errorf("code = %v, want Permanent", errs.Code(err))
			}
			var fe *errs.FieldError
			if !errors.As(err, &fe) {
				t.Fatalf("no *errs.FieldError in %v", err)
			}
			found := false
			for _, e := range unjoin(err) {
				if errors.As(e, &fe) && fe.Field == tt.field && strings.Contains(fe.Rule, tt.rule) {
					found = true
				}
			}
			if !found {
				t.Errorf("error %q does not name field %s with rule containing %q", err, tt.field, tt.rule)
			}
			// Open rejects it too, before touching anything.
			if p, err := open(context.Background(), c, nil); err == nil {
				p.Close()
				t.Error("Open accepted a bad config")
			}
		})
	}
}

func TestConfigValidOptions(t *testing.T) {
	t.Parallel()
	c := validConfig()
	c.MachineTypes = map[string]MachineType{"a": {1, 512}, "b": {2, 1024}}
	c.DefaultMachineType = "b"
	c.Bridge = "br0"
	c.DomainType = "kvm"
	c.Kernel, c.Initrd, c.Cmdline = "/boot/vmlinuz", "/boot/initrd", "console=ttyS0 root=/dev/vda"
	c.ClaimTimeout = minClaimTimeout
	got, err := c.validate(false)
	if err != nil {
		t.Fatalf("validate: %v", err)
	}
	if got.Network != "" {
		t.Errorf("Network = %q with Bridge set, want empty", got.Network)
	}
	if got.ClaimTimeout != minClaimTimeout {
		t.Errorf("ClaimTimeout = %v, want %v kept", got.ClaimTimeout, minClaimTimeout)
	}
	img := validConfig()
	img.Images = map[string]imagecache.Image{"debian-12": {URL: "https://example.com/d.qcow2"}}
	got, err = img.validate(false)
	if err != nil || got.DefaultImage != "debian-12" || got.Images["debian-12"].Key != "debian-12" {
		t.Errorf("single image: default %q, key %q, err %v", got.DefaultImage, got.Images["debian-12"].Key, err)
	}
	one := validConfig()
	one.MachineTypes = map[string]MachineType{"only": {2, 2048}}
	got, err = one.validate(false)
	if err != nil || got.DefaultMachineType != "only" {
		t.Errorf("single machine type: default %q, err %v", got.DefaultMachineType, err)
	}
}

// unjoin flattens errors.Join trees.
func unjoin(err error) []error {
	var out []error
	var walk func(error)
	walk = func(e error) {
		if j, ok := e.(interface{ Unwrap() []error }); ok {
			for _, x := range j.Unwrap() {
				walk(x)
			}
			return
		}
		out = append(out, e)
		if u := errors.Unwrap(e); u != nil {
			walk(u)
		}
	}
	walk(err)
	return out
}
