package benchutil

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/digitalocean/go-libvirt"
	"libvirt.org/go/libvirtxml"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/domainmeta"
	"github.com/egressproxy/egressproxy/internal/libvirtconn"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
	"github.com/egressproxy/egressproxy/kvm2"
	"github.com/egressproxy/egressproxy/sshconn"
)

// KVM is one kvm2 provider entry on the stack for control-path
// measurements: a 32 MiB qcow2 base served over HTTP, an isolated libvirt
// network (no forwarding), and two providers of the same entry: Counted
// reaches libvirtd through an RPCCounter, Plain through its real socket.
type KVM struct {
	Entry   string
	Counted *egressproxy.Client
	Plain   *egressproxy.Client
	Counter *RPCCounter

	env     teststack.Env
	cfg     kvm2.Config // the entry's configuration (Counted's socket)
	network string
	srv     *FileServer
	raw     *libvirtconn.Session
	closers []func()
}

// NewKVM sets up entry (a fresh name; everything of it is removed by
// Close) with scratch files under dir. bridge must be a short unique
// interface name and subnet the first three octets of a /24 nobody uses.
func NewKVM(ctx context.Context, env teststack.Env, dir, entry, bridge, subnet string) (_ *KVM, err error) {
	k := &KVM{Entry: entry, env: env, network: entry + "-net"}
	defer func() {
		if err != nil {
			k.Close()
		}
	}()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	img := filepath.Join(dir, "tiny.qcow2")
	if _, err := os.Stat(img); err != nil {
		if out, err := exec.CommandContext(ctx, "qemu-img", "create", "-q", "-f", "qcow2", img, "32M").CombinedOutput(); err != nil {
			return nil, fmt.Errorf("qemu-img create: %w: %s", err, out)
		}
	}
	sum, _, err := hashFile(img)
	if err != nil {
		return nil, err
	}
	if k.srv, err = ServeFile(img); err != nil {
		return nil, err
	}
	k.closers = append(k.closers, func() { _ = k.srv.Close() })
	raw, _, closeRaw, err := Link(env, "")
	if err != nil {
		return nil, err
	}
	k.raw = raw
	k.closers = append(k.closers, closeRaw)
	nx, err := (&libvirtxml.Network{
		Name:   k.network,
		Bridge: &libvirtxml.NetworkBridge{Name: bridge},
		IPs: []libvirtxml.NetworkIP{{
			Address: subnet + ".1", Netmask: "255.255.255.0",
			DHCP: &libvirtxml.NetworkDHCP{Ranges: []libvirtxml.NetworkDHCPRange{{Start: subnet + ".10", End: subnet + ".250"}}},
		}},
	}).Marshal()
	if err != nil {
		return nil, err
	}
	if err := k.Raw(ctx, func(l *libvirt.Libvirt) error { _, err := l.NetworkCreateXML(nx); return err }); err != nil {
		return nil, fmt.Errorf("create network %s: %w", k.network, err)
	}
	if k.Counter, err = NewRPCCounter(dir, env.LibvirtSocket); err != nil {
		return nil, err
	}
	k.closers = append(k.closers, func() { _ = k.Counter.Close() })
	cfg := kvm2.Config{
		Entry: entry, Owner: "bench",
		Address: env.SSHAddr, User: env.SSHUser, KeyFile: env.SSHKey, KnownHostsFile: env.KnownHosts,
		LibvirtURI: env.LibvirtURI, Pool: env.Pool, Network: k.network,
		Images:       map[string]imagecache.Image{"tiny": {URL: k.srv.URL, SHA256: sum}},
		MachineTypes: map[string]kvm2.MachineType{"tiny": {VCPUs: 1, MemoryMiB: 128}},
		// The test machines offer KVM but KVM guests hang in their firmware
		// (docs/config.md): the benchmarks measure TCG guests.
		DomainType: "qemu",
	}
	for _, x := range []struct {
		p    **egressproxy.Client
		sock string
	}{{&k.Counted, k.Counter.Path()}, {&k.Plain, env.LibvirtSocket}} {
		c := cfg
		c.LibvirtSocket = x.sock
		p, err := kvm2.Open(ctx, c, nil)
		if err != nil {
			return nil, err
		}
		if x.sock == k.Counter.Path() {
			k.cfg = c
		}
		*x.p = p
		k.closers = append(k.closers, func() { _ = p.Close() })
	}
	return k, nil
}

// OpenVia opens one more provider of the entry (counted, like Counted)
// whose SSH connection goes to addr instead of the stack's sshd, e.g. a
// delay proxy relaying to it: the stack's host key is pinned at addr. The
// provider is closed by Close.
func (k *KVM) OpenVia(ctx context.Context, addr string) (*egressproxy.Client, error) {
	known, err := os.ReadFile(k.env.KnownHosts)
	if err != nil {
		return nil, err
	}
	c := k.cfg
	c.Address = addr
	c.KnownHostsFile = ""
	c.KnownHosts = []byte(RepinKnownHosts(string(known), k.env.SSHAddr, addr))
	p, err := kvm2.Open(ctx, c, nil)
	if err != nil {
		return nil, err
	}
	k.closers = append(k.closers, func() { _ = p.Close() })
	return p, nil
}

// RepinKnownHosts rewrites known_hosts lines for from ("host:port") so they
// pin the same keys at to (a relay on another port of the same host).
func RepinKnownHosts(known, from, to string) string {
	host, port, _ := net.SplitHostPort(from)
	thost, tport, _ := net.SplitHostPort(to)
	return strings.ReplaceAll(known, "["+host+"]:"+port, "["+thost+"]:"+tport)
}

// Raw runs fn on a libvirt connection of its own (not counted).
func (k *KVM) Raw(ctx context.Context, fn func(*libvirt.Libvirt) error) error {
	return k.raw.Do(ctx, fn)
}

// DomainName is the domain kvm2 makes for instance name.
func (k *KVM) DomainName(name string) string { return "ep-" + k.Entry + "--" + name }

// Spec is the spec of instance i of this entry.
func (k *KVM) Spec(prefix string, i int) egressproxy.Spec {
	return egressproxy.Spec{Name: fmt.Sprintf("%s%03d", prefix, i), UID: fmt.Sprintf("uid-%s%03d", prefix, i)}
}

// Stop destroys (powers off) the instance's domain, leaving it defined.
func (k *KVM) Stop(ctx context.Context, name string) error {
	return k.Raw(ctx, func(l *libvirt.Libvirt) error {
		d, err := l.DomainLookupByName(k.DomainName(name))
		if err != nil {
			return err
		}
		return l.DomainDestroy(d)
	})
}

// Op is one measured operation.
type Op struct {
	Wall time.Duration
	RPCs int
	// Calls summarises the RPCs ("Name×n ...").
	Calls string
}

// Measure runs fn on the Counted provider and returns its wall time and
// the RPCs it made.
func (k *KVM) Measure(fn func(p *egressproxy.Client) error) (Op, error) {
	k.Counter.Take()
	start := time.Now()
	err := fn(k.Counted)
	d := time.Since(start)
	calls := k.Counter.Take()
	return Op{Wall: d, RPCs: len(calls), Calls: Summary(calls)}, err
}

// ConcurrentGets runs n Gets of refs (round robin) at once on p's pooled
// connection and returns the wall time of all.
func ConcurrentGets(ctx context.Context, p *egressproxy.Client, refs []egressproxy.Ref, n int) (time.Duration, error) {
	return concurrently(n, func(i int) error {
		_, err := p.Get(ctx, refs[i%len(refs)])
		return err
	})
}

// DirectGets makes the RPCs of n Gets of the domains (lookup, XML, state,
// in kvm2's order; what kvm2.Get makes for a domain that is not running)
// at once with go-libvirt on one connection of its own over one SSH unix
// channel, and returns the wall time of all (connection setup excluded).
// With decode, each call also decodes the domain XML the way kvm2 does for
// a domain that is not running (see decodeLikeKVM2), to tell connection
// overhead from decoding cost.
func DirectGets(ctx context.Context, env teststack.Env, domains []string, n int, decode bool) (time.Duration, error) {
	pool, err := sshconn.New(sshconn.Config{Address: env.SSHAddr, User: env.SSHUser, KeyFile: env.SSHKey, KnownHostsFile: env.KnownHosts}, nil)
	if err != nil {
		return 0, err
	}
	defer pool.Close()
	client, err := pool.Client(ctx)
	if err != nil {
		return 0, err
	}
	conn, err := pool.DialUnix(ctx, client, env.LibvirtSocket)
	if err != nil {
		return 0, err
	}
	l := libvirt.NewWithDialer(&oneConn{c: conn})
	if err := l.ConnectToURI(libvirt.ConnectURI(env.LibvirtURI)); err != nil {
		conn.Close()
		return 0, err
	}
	defer func() { _ = l.Disconnect() }()
	return concurrently(n, func(i int) error {
		d, err := l.DomainLookupByName(domains[i%len(domains)])
		if err != nil {
			return err
		}
		x, err := l.DomainGetXMLDesc(d, 0)
		if err != nil {
			return err
		}
		if _, _, err := l.DomainGetState(d, 0); err != nil {
			return err
		}
		if decode {
			return decodeLikeKVM2(x)
		}
		return nil
	})
}

// decodeLikeKVM2 decodes a domain XML as kvm2's readDomain does for a
// domain that is not running (kvm2/domain.go parseDomainXML without the
// MAC, which kvm2 reads only for active domains): a token scan up to its
// metadata element, decoded and checked by kvm2's own decoding
// (internal/domainmeta); the rest of the document is not read. kvm2's
// tests check its single pass against this scan.
func decodeLikeKVM2(doc string) error {
	_, err := domainmeta.Parse(doc)
	return err
}

type oneConn struct{ c net.Conn }

func (o *oneConn) Dial() (net.Conn, error) {
	if o.c == nil {
		return nil, errors.New("benchutil: connection already used")
	}
	c := o.c
	o.c = nil
	return c, nil
}

func concurrently(n int, fn func(i int) error) (time.Duration, error) {
	var wg sync.WaitGroup
	errs := make([]error, n)
	start := make(chan struct{})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			errs[i] = fn(i)
		}()
	}
	t0 := time.Now()
	close(start)
	wg.Wait()
	d := time.Since(t0)
	return d, errors.Join(errs...)
}

// Close removes every domain and volume of the entry and its network, and
// closes the providers, the counter and the server.
func (k *KVM) Close() {
	if k.raw != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		_ = k.Raw(ctx, func(l *libvirt.Libvirt) error {
			doms, _, err := l.ConnectListAllDomains(1, libvirt.ConnectListDomainsActive|libvirt.ConnectListDomainsInactive)
			if err != nil {
				return err
			}
			for _, d := range doms {
				if strings.HasPrefix(d.Name, "ep-"+k.Entry+"--") || strings.HasPrefix(d.Name, k.ForeignPrefix()) {
					_ = l.DomainDestroy(d)
					_ = l.DomainUndefineFlags(d, libvirt.DomainUndefineManagedSave|libvirt.DomainUndefineSnapshotsMetadata|libvirt.DomainUndefineNvram)
				}
			}
			_ = DeleteVolumes(l, k.env.Pool, func(v string) bool { return strings.Contains(v, k.Entry) })
			if n, err := l.NetworkLookupByName(k.network); err == nil {
				_ = l.NetworkDestroy(n)
			}
			return nil
		})
	}
	for i := len(k.closers) - 1; i >= 0; i-- {
		k.closers[i]()
	}
	k.closers = nil
}
