//go:build integration

package lab

import (
	"context"
	"fmt"
	"net"
	"os"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/kvm2"
)

// hostConfig is a kvm2 Config for lab host h reached at addr (its veth
// address or its delay proxy; the known_hosts file pins both).
func hostConfig(h Host, addr string) kvm2.Config {
	return kvm2.Config{
		Entry:          fmt.Sprintf("lab%d", h.N),
		Owner:          "lab-tests",
		Address:        addr,
		User:           h.SSHUser,
		KeyFile:        h.SSHKey,
		KnownHostsFile: h.KnownHosts,
		LibvirtSocket:  h.LibvirtSocket,
		LibvirtURI:     h.LibvirtURI,
		Pool:           h.Pool,
		Network:        h.Network,
		DialTimeout:    10 * time.Second,
		// The lab hosts offer KVM that hangs in firmware (docs/config.md).
		DomainType: "qemu",
	}
}

func checkVia(t *testing.T, cfg kvm2.Config) (egressproxy.Health, time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p, err := kvm2.Open(ctx, cfg, &kvm2.Options{Logger: testr.New(t)})
	if err != nil {
		t.Fatalf("Open %s: %v", cfg.Address, err)
	}
	defer func() {
		if err := p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	}()
	if _, err := p.Check(ctx); err != nil { // the first one pays the dial
		t.Fatalf("Check via %s: %v", cfg.Address, err)
	}
	start := time.Now()
	h, err := p.Check(ctx)
	if err != nil {
		t.Fatalf("Check via %s: %v", cfg.Address, err)
	}
	return h, time.Since(start)
}

// TestLabHostsCheck opens one kvm2 provider per lab host, over its shaped
// link and through its delay proxy, and checks each: every host is
// reachable with its pool running, and the proxy adds its round-trip time.
func TestLabHostsCheck(t *testing.T) {
	env := Require(t)
	if len(env.Hosts) < 2 {
		t.Fatalf("lab has %d hosts, want at least 2", len(env.Hosts))
	}
	for _, h := range env.Hosts {
		t.Run(fmt.Sprintf("host%d", h.N), func(t *testing.T) {
			// The libvirt socket lives in the host's own mount namespace:
			// nothing but the host's sshd can reach it from here.
			if _, err := os.Stat(h.LibvirtSocket); err == nil {
				t.Errorf("host %d's libvirt socket %s is visible in the caller's namespace", h.N, h.LibvirtSocket)
			}
			if host, _, err := net.SplitHostPort(h.SSHAddr); err != nil || host != h.Addr {
				t.Errorf("SSH_ADDR %q is not on the host's veth address %q", h.SSHAddr, h.Addr)
			}
			direct, directTime := checkVia(t, hostConfig(h, h.SSHAddr))
			if !direct.Reachable || direct.Details["poolState"] != "running" {
				t.Fatalf("Check over the link: %+v", direct)
			}
			delayed, delayedTime := checkVia(t, hostConfig(h, h.DelayAddr))
			if !delayed.Reachable {
				t.Fatalf("Check through the delay proxy: %+v", delayed)
			}
			// Check makes several sequential calls, each at least one round
			// trip through the proxy.
			if delayedTime < env.RTT {
				t.Errorf("Check through a +%v proxy took %v, want >= %v", env.RTT, delayedTime, env.RTT)
			}
			t.Logf("host %d: Check %v over the link, %v through the +%v proxy", h.N, directTime, delayedTime, env.RTT)
		})
	}
}
