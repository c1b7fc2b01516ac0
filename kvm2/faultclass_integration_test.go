//go:build integration

package kvm2

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// TestIntegrationEntryFaultOneClassEveryOperation: on the real stack, each
// fault of the entry the stack can produce has one class on every
// operation of the client kvm2.Open returns (kvm2's own calls and the
// image cache's), and Check reports it as its health reason.
func TestIntegrationEntryFaultOneClassEveryOperation(t *testing.T) {
	env := teststack.Require(t)
	tests := []struct {
		name   string
		mutate func(t *testing.T, c *Config)
		code   errs.ErrorCode
		reason egressproxy.HealthReason
	}{
		{"missing key file", func(t *testing.T, c *Config) { c.KeyFile = filepath.Join(t.TempDir(), "absent") },
			errs.Permanent, egressproxy.ReasonCredentialsUnavailable},
		{"key refused", func(t *testing.T, c *Config) { c.KeyFile = unknownKeyFile(t) },
			errs.Permanent, egressproxy.ReasonUnauthorized},
		{"unknown host key", func(t *testing.T, c *Config) { c.KnownHostsFile = writeFile(t, "known_hosts", nil) },
			errs.Permanent, egressproxy.ReasonHostKeyUnknown},
		{"changed host key", func(t *testing.T, c *Config) { c.KnownHostsFile = otherHostKeyKnownHosts(t, c.Address) },
			errs.Permanent, egressproxy.ReasonHostKeyMismatch},
		// OpenSSH refuses the socket channel alike when the user may not
		// open it and while libvirtd's socket is absent: Transient.
		{"socket the user cannot open", func(t *testing.T, c *Config) { c.User = env.UnprivUser },
			errs.Transient, egressproxy.ReasonForbidden},
		{"nothing listens", func(t *testing.T, c *Config) { c.Address = "127.0.0.1:1" },
			errs.Transient, egressproxy.ReasonUnreachable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := stackConfig(t)
			// Never fetched: every call fails on the link first.
			cfg.Images = map[string]imagecache.Image{"tiny": {URL: "http://127.0.0.1:1/tiny.qcow2"}}
			tt.mutate(t, &cfg)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			// A client per call: the link backs off before it dials again
			// after a failure, which would make every next call slower.
			client := func() *egressproxy.Client {
				c, err := Open(ctx, cfg, &Options{Logger: testr.New(t)})
				if err != nil {
					t.Fatalf("Open: %v", err)
				}
				t.Cleanup(func() {
					if err := c.Close(); err != nil {
						t.Errorf("Close: %v", err)
					}
				})
				return c
			}
			spec := egressproxy.Spec{Name: "fault-1", UID: "uid-fault-1", ImageKey: "tiny"}
			checkEntryFault(t, ctx, client, spec, tt.code, tt.reason)
		})
	}
}
