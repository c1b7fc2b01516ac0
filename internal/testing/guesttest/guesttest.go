package guesttest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
	"libvirt.org/go/libvirtxml"

	"github.com/egressproxy/egressproxy/internal/libvirtconn"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
	"github.com/egressproxy/egressproxy/sshconn"
)

// SquidUserData is cloud-config that makes the guest's Squid listen on port
// and allow CONNECT from subnet only (written before Squid's first start,
// see docs/e2e.md).
func SquidUserData(hostname string, port int, subnet string) string {
	return fmt.Sprintf(`#cloud-config
write_files:
  - path: /etc/squid/squid.conf
    content: |
      http_port %d
      visible_hostname %s
      acl natnet src %s
      acl CONNECT method CONNECT
      http_access allow CONNECT natnet
      http_access deny all
      cache deny all
      pinger_enable off
      shutdown_lifetime 1 second
      coredump_dir /var/spool/squid
`, port, hostname, subnet)
}

// Netns returns the name of the private network namespace this process is
// in: EGRESSPROXY_NETNS (exported by scripts/netns) must be set (unset:
// ok false) and name the namespace of this process (the nsfs inode of
// /run/netns/NAME, made by `ip netns add`, is that of /proc/self/ns/net);
// a mismatch is an error.
func Netns() (name, id string, ok bool, err error) {
	name = os.Getenv("EGRESSPROXY_NETNS")
	if name == "" {
		return "", "", false, nil
	}
	self, err1 := nsID("/proc/self/ns/net")
	named, err2 := nsID(filepath.Join("/run/netns", name))
	if err := errors.Join(err1, err2); err != nil {
		return name, "", true, fmt.Errorf("EGRESSPROXY_NETNS=%s: cannot identify the network namespace: %w", name, err)
	}
	if self != named {
		return name, self, true, fmt.Errorf("EGRESSPROXY_NETNS=%s is set but this process is not in that network namespace (%s, not %s)", name, self, named)
	}
	return name, self, true, nil
}

// nsID identifies a namespace file by device and inode.
func nsID(path string) (string, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return "", err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return "", fmt.Errorf("%s: no stat_t", path)
	}
	return fmt.Sprintf("net:[%d:%d]", st.Dev, st.Ino), nil
}

// RandHex returns n random bytes as hex.
func RandHex(t testing.TB, n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// Libvirt is a libvirt connection of the test's own (same stack, same SSH
// path as kvm2), to set up networks and to check and clean the host.
type Libvirt struct {
	pool *sshconn.Pool
	lv   *libvirtconn.Session
}

// NewLibvirt connects to the stack's libvirtd; t.Cleanup closes it.
func NewLibvirt(t testing.TB, env teststack.Env) *Libvirt {
	t.Helper()
	return Dial(t, sshconn.Config{Address: env.SSHAddr, User: env.SSHUser, KeyFile: env.SSHKey, KnownHostsFile: env.KnownHosts},
		libvirtconn.Config{Socket: env.LibvirtSocket, URI: env.LibvirtURI})
}

// Dial connects to the libvirtd behind ssh and lv (a lab host's, say);
// t.Cleanup closes it.
func Dial(t testing.TB, ssh sshconn.Config, lv libvirtconn.Config) *Libvirt {
	t.Helper()
	pool, err := sshconn.New(ssh, nil)
	if err != nil {
		t.Fatal(err)
	}
	r := &Libvirt{pool: pool, lv: libvirtconn.New(pool, lv, nil)}
	t.Cleanup(func() {
		_ = r.lv.Close()
		_ = r.pool.Close()
	})
	return r
}

// Do runs fn on the connection, bounded by a minute.
func (r *Libvirt) Do(fn func(*libvirt.Libvirt) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	return r.lv.Do(ctx, fn)
}

// Objects returns the names of the domains and the volumes of pool whose
// name contains entry.
func (r *Libvirt) Objects(pool, entry string) (domains, volumes map[string]bool, err error) {
	domains, volumes = map[string]bool{}, map[string]bool{}
	err = r.Do(func(l *libvirt.Libvirt) error {
		doms, _, err := l.ConnectListAllDomains(1, libvirt.ConnectListDomainsActive|libvirt.ConnectListDomainsInactive)
		if err != nil {
			return err
		}
		for _, d := range doms {
			if strings.Contains(d.Name, entry) {
				domains[d.Name] = true
			}
		}
		sp, err := l.StoragePoolLookupByName(pool)
		if err != nil {
			return err
		}
		if err := l.StoragePoolRefresh(sp, 0); err != nil {
			return err
		}
		vols, _, err := l.StoragePoolListAllVolumes(sp, 1, 0)
		if err != nil {
			return err
		}
		for _, v := range vols {
			if strings.Contains(v.Name, entry) {
				volumes[v.Name] = true
			}
		}
		return nil
	})
	return domains, volumes, err
}

// RemoveEntry destroys and undefines every domain and deletes every volume
// of pool whose name contains entry (a test's random entry name, so nothing
// else).
func (r *Libvirt) RemoveEntry(pool, entry string) error {
	return r.Do(func(l *libvirt.Libvirt) error {
		var errs []error
		doms, _, err := l.ConnectListAllDomains(1, libvirt.ConnectListDomainsActive|libvirt.ConnectListDomainsInactive)
		if err != nil {
			return err
		}
		for _, d := range doms {
			if strings.Contains(d.Name, entry) {
				_ = l.DomainDestroy(d)
				if err := l.DomainUndefineFlags(d, libvirt.DomainUndefineManagedSave|libvirt.DomainUndefineSnapshotsMetadata|libvirt.DomainUndefineNvram); err != nil {
					errs = append(errs, fmt.Errorf("undefine %s: %w", d.Name, err))
				}
			}
		}
		sp, err := l.StoragePoolLookupByName(pool)
		if err != nil {
			return errors.Join(append(errs, err)...)
		}
		_ = l.StoragePoolRefresh(sp, 0)
		vols, _, err := l.StoragePoolListAllVolumes(sp, 1, 0)
		if err != nil {
			return errors.Join(append(errs, err)...)
		}
		for _, v := range vols {
			if strings.Contains(v.Name, entry) {
				if err := l.StorageVolDelete(v, 0); err != nil {
					errs = append(errs, fmt.Errorf("delete volume %s: %w", v.Name, err))
				}
			}
		}
		return errors.Join(errs...)
	})
}

// CreateNATNetwork defines a transient NAT network name on bridge with
// gateway prefix.1/24 and DHCP prefix.100–199 (prefix like "10.77.0"), and
// destroys it in t.Cleanup.
func (r *Libvirt) CreateNATNetwork(t testing.TB, name, bridge, prefix string) {
	t.Helper()
	nx, err := (&libvirtxml.Network{
		Name:    name,
		Forward: &libvirtxml.NetworkForward{Mode: "nat"},
		Bridge:  &libvirtxml.NetworkBridge{Name: bridge, STP: "off", Delay: "0"},
		IPs: []libvirtxml.NetworkIP{{
			Address: prefix + ".1", Netmask: "255.255.255.0",
			DHCP: &libvirtxml.NetworkDHCP{Ranges: []libvirtxml.NetworkDHCPRange{{Start: prefix + ".100", End: prefix + ".199"}}},
		}},
	}).Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Do(func(l *libvirt.Libvirt) error { _, err := l.NetworkCreateXML(nx); return err }); err != nil {
		t.Fatalf("create NAT network %s: %v", name, err)
	}
	t.Cleanup(func() {
		err := r.Do(func(l *libvirt.Libvirt) error {
			n, err := l.NetworkLookupByName(name)
			if err != nil {
				return err
			}
			return l.NetworkDestroy(n)
		})
		if err != nil {
			t.Errorf("cleanup: destroy network %s: %v", name, err)
		}
	})
}
