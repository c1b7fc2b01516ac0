package kvm2

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path"
	"slices"
	"sort"
	"sync"
	"testing"

	libvirt "github.com/digitalocean/go-libvirt"
	"github.com/go-logr/logr/testr"
	"go.opentelemetry.io/otel/trace/noop"
	"libvirt.org/go/libvirtxml"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/basecache"
	"github.com/egressproxy/egressproxy/internal/budget"
	"github.com/egressproxy/egressproxy/sshconn"
)

// An in-memory libvirtd for unit tests: domains, one or more storage pools
// with their volumes, DHCP leases and ARP entries, answering the calls of
// lvAPI with the errors go-libvirt returns (libvirt.Error values with
// libvirt's codes and messages). fault, when set, sees every call before it
// takes effect and, for calls that succeed, once more after: an error it
// returns is the call's (after: the effect stays, as when a reply is lost).

// fakeCall is one call the fake receives.
type fakeCall struct {
	Op    string // method name, e.g. "DomainCreate"
	Name  string // the domain, pool or volume it is about ("" for the connection)
	After bool   // false: before it takes effect; true: after it took effect
}

type fakeDomain struct {
	dom        libvirt.Domain
	xml        string
	mac        string
	state      libvirt.DomainState
	reason     int32
	persistent bool
	agentIP    string // what the guest agent reports; "" means no agent
}

type fakeVol struct {
	name, path    string
	format        string
	capacity      uint64
	backing       string // backing store path
	backingFormat string
	data          []byte
}

type fakePool struct {
	pool                libvirt.StoragePool
	dir                 string
	state               uint8
	capacity, available uint64
	vols                map[string]*fakeVol
}

type fakeLibvirt struct {
	mu       sync.Mutex
	hostname string
	version  uint64
	domcaps  string   // the domain capabilities document
	capsArgs []string // the arguments of each ConnectGetDomainCapabilities
	domains  map[string]*fakeDomain
	pools    map[string]*fakePool
	leases   map[string]string // MAC → IP (the network's DHCP leases)
	arp      map[string]string // MAC → IP (the host's ARP table)
	calls    []fakeCall        // every call, before it took effect
	serial   int
	fault    func(fakeCall) error

	killed chan struct{} // closed when the session closes: blocked calls end
}

func newFakeLibvirt() *fakeLibvirt {
	f := &fakeLibvirt{
		hostname: "hv1.example",
		version:  10_000_000 + 2_000 + 3,
		domcaps:  domcapsKVM,
		domains:  map[string]*fakeDomain{},
		pools:    map[string]*fakePool{},
		leases:   map[string]string{},
		arp:      map[string]string{},
		killed:   make(chan struct{}),
	}
	f.addPool("default")
	return f
}

func (f *fakeLibvirt) addPool(name string) *fakePool {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.serial++
	p := &fakePool{
		pool:  libvirt.StoragePool{Name: name, UUID: fakeUUID(f.serial)},
		dir:   "/var/lib/libvirt/images/" + name,
		state: uint8(libvirt.StoragePoolRunning), capacity: 100 << 30, available: 42 << 30,
		vols: map[string]*fakeVol{},
	}
	f.pools[name] = p
	return p
}

func fakeUUID(n int) libvirt.UUID {
	var u libvirt.UUID
	u[0], u[14], u[15] = 0xfa, byte(n>>8), byte(n)
	return u
}

func formatUUID(u libvirt.UUID) string {
	return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

// setFault installs the fault hook (nil: none).
func (f *fakeLibvirt) setFault(h func(fakeCall) error) {
	f.mu.Lock()
	f.fault = h
	f.mu.Unlock()
}

func (f *fakeLibvirt) hook(c fakeCall) error {
	f.mu.Lock()
	if !c.After {
		f.calls = append(f.calls, c)
	}
	h := f.fault
	f.mu.Unlock()
	if h == nil {
		return nil
	}
	return h(c)
}

func (f *fakeLibvirt) enter(op, name string) error { return f.hook(fakeCall{Op: op, Name: name}) }
func (f *fakeLibvirt) leave(op, name string) error {
	return f.hook(fakeCall{Op: op, Name: name, After: true})
}

// callCount counts the calls of op (any op when op is "").
func (f *fakeLibvirt) callCount(op string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, c := range f.calls {
		if op == "" || c.Op == op {
			n++
		}
	}
	return n
}

func (f *fakeLibvirt) resetCalls() {
	f.mu.Lock()
	f.calls = nil
	f.mu.Unlock()
}

// block returns a hook that blocks the first call matching (op, name)
// before it takes effect, until release is called or the session closes
// (then it fails as go-libvirt does when the connection goes). entered is
// closed when the call blocks.
func (f *fakeLibvirt) block(op, name string) (hook func(fakeCall) error, entered <-chan struct{}, release func()) {
	in, out := make(chan struct{}), make(chan struct{})
	var once, inOnce sync.Once
	hook = func(c fakeCall) error {
		if c.After || c.Op != op || (name != "" && c.Name != name) {
			return nil
		}
		first := false
		inOnce.Do(func() { first = true; close(in) })
		if !first {
			return nil
		}
		select {
		case <-out:
			return nil
		case <-f.killed:
			return libvirt.ErrInterrupted
		}
	}
	return hook, in, func() { once.Do(func() { close(out) }) }
}

// failOn returns a hook failing every call matching (op, name, after) with err.
func failOn(op, name string, after bool, err error) func(fakeCall) error {
	return func(c fakeCall) error {
		if c.Op == op && c.After == after && (name == "" || c.Name == name) {
			return err
		}
		return nil
	}
}

func lvErrorf(code libvirt.ErrorNumber, format string, args ...any) error {
	return libvirt.Error{Code: uint32(code), Message: fmt.Sprintf(format, args...)}
}

func errNoDomainName(name string) error {
	return lvErrorf(libvirt.ErrNoDomain, "Domain not found: no domain with matching name '%s'", name)
}

// domainByHandle finds dom by UUID, as the remote driver does (f.mu held).
func (f *fakeLibvirt) domainByHandle(dom libvirt.Domain) (*fakeDomain, error) {
	for _, d := range f.domains {
		if d.dom.UUID == dom.UUID {
			return d, nil
		}
	}
	return nil, lvErrorf(libvirt.ErrNoDomain, "Domain not found: no domain with matching uuid '%s' (%s)", formatUUID(dom.UUID), dom.Name)
}

func (f *fakeLibvirt) poolByName(name string) (*fakePool, error) {
	p, ok := f.pools[name]
	if !ok {
		return nil, lvErrorf(libvirt.ErrNoStoragePool, "Storage pool not found: no storage pool with matching name '%s'", name)
	}
	return p, nil
}

func (f *fakeLibvirt) activePool(name string) (*fakePool, error) {
	p, err := f.poolByName(name)
	if err != nil {
		return nil, err
	}
	if p.state != uint8(libvirt.StoragePoolRunning) {
		return nil, lvErrorf(libvirt.ErrOperationInvalid, "Requested operation is not valid: storage pool '%s' is not active", name)
	}
	return p, nil
}

func (f *fakeLibvirt) volByHandle(vol libvirt.StorageVol) (*fakePool, *fakeVol, error) {
	p, err := f.activePool(vol.Pool)
	if err != nil {
		return nil, nil, err
	}
	v, ok := p.vols[vol.Name]
	if !ok {
		return nil, nil, lvErrorf(libvirt.ErrNoStorageVol, "Storage volume not found: no storage vol with matching name '%s'", vol.Name)
	}
	return p, v, nil
}

func (f *fakeLibvirt) volByPath(path string) *fakeVol {
	for _, p := range f.pools {
		for _, v := range p.vols {
			if v.path == path {
				return v
			}
		}
	}
	return nil
}

func (f *fakeLibvirt) ConnectGetHostname() (string, error) {
	if err := f.enter("ConnectGetHostname", ""); err != nil {
		return "", err
	}
	f.mu.Lock()
	h := f.hostname
	f.mu.Unlock()
	return h, f.leave("ConnectGetHostname", "")
}

func (f *fakeLibvirt) ConnectGetLibVersion() (uint64, error) {
	if err := f.enter("ConnectGetLibVersion", ""); err != nil {
		return 0, err
	}
	f.mu.Lock()
	v := f.version
	f.mu.Unlock()
	return v, f.leave("ConnectGetLibVersion", "")
}

// ConnectGetDomainCapabilities answers f.domcaps (testdata/domcaps-kvm.xml
// unless a test sets another document), and records the arguments.
func (f *fakeLibvirt) ConnectGetDomainCapabilities(emulatorbin, arch, machine, virttype libvirt.OptString, flags libvirt.ConnectGetDomainCapabilitiesFlags) (string, error) {
	if err := f.enter("ConnectGetDomainCapabilities", ""); err != nil {
		return "", err
	}
	f.mu.Lock()
	doc := f.domcaps
	f.capsArgs = append(f.capsArgs, fmt.Sprintf("emulator=%q arch=%q machine=%q virttype=%q flags=%d", emulatorbin, arch, machine, virttype, flags))
	f.mu.Unlock()
	return doc, f.leave("ConnectGetDomainCapabilities", "")
}

func (f *fakeLibvirt) ConnectListAllDomains(needResults int32, flags libvirt.ConnectListAllDomainsFlags) ([]libvirt.Domain, uint32, error) {
	if err := f.enter("ConnectListAllDomains", ""); err != nil {
		return nil, 0, err
	}
	f.mu.Lock()
	var out []libvirt.Domain
	for _, d := range f.domains {
		active := domainActive(d.state)
		if active && flags&libvirt.ConnectListDomainsActive != 0 || !active && flags&libvirt.ConnectListDomainsInactive != 0 {
			out = append(out, d.dom)
		}
	}
	f.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	if needResults == 0 {
		out = nil
	}
	return out, uint32(len(out)), f.leave("ConnectListAllDomains", "")
}

// ConnectGetAllDomainStats answers the "state" group of every domain (doms
// nil and flags 0, as List asks), sorted by name.
func (f *fakeLibvirt) ConnectGetAllDomainStats(doms []libvirt.Domain, stats uint32, flags uint32) ([]libvirt.DomainStatsRecord, error) {
	if err := f.enter("ConnectGetAllDomainStats", ""); err != nil {
		return nil, err
	}
	if doms != nil || flags != 0 || stats != uint32(libvirt.DomainStatsState) {
		return nil, lvErrorf(libvirt.ErrArgumentUnsupported, "fake: only the state stats of every domain are implemented")
	}
	f.mu.Lock()
	var out []libvirt.DomainStatsRecord
	for _, d := range f.domains {
		out = append(out, libvirt.DomainStatsRecord{Dom: d.dom, Params: []libvirt.TypedParam{
			{Field: "state.state", Value: *libvirt.NewTypedParamValueInt(int32(d.state))},
			{Field: "state.reason", Value: *libvirt.NewTypedParamValueInt(d.reason)},
		}})
	}
	f.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Dom.Name < out[j].Dom.Name })
	return out, f.leave("ConnectGetAllDomainStats", "")
}

func (f *fakeLibvirt) DomainLookupByName(name string) (libvirt.Domain, error) {
	if err := f.enter("DomainLookupByName", name); err != nil {
		return libvirt.Domain{}, err
	}
	f.mu.Lock()
	d, ok := f.domains[name]
	f.mu.Unlock()
	if !ok {
		return libvirt.Domain{}, errNoDomainName(name)
	}
	return d.dom, f.leave("DomainLookupByName", name)
}

func (f *fakeLibvirt) DomainGetXMLDesc(dom libvirt.Domain, flags libvirt.DomainXMLFlags) (string, error) {
	if err := f.enter("DomainGetXMLDesc", dom.Name); err != nil {
		return "", err
	}
	f.mu.Lock()
	d, err := f.domainByHandle(dom)
	x := ""
	if err == nil {
		x = d.xml
	}
	f.mu.Unlock()
	if err != nil {
		return "", err
	}
	return x, f.leave("DomainGetXMLDesc", dom.Name)
}

func (f *fakeLibvirt) DomainGetState(dom libvirt.Domain, flags uint32) (int32, int32, error) {
	if err := f.enter("DomainGetState", dom.Name); err != nil {
		return 0, 0, err
	}
	f.mu.Lock()
	d, err := f.domainByHandle(dom)
	var st, reason int32
	if err == nil {
		st, reason = int32(d.state), d.reason
	}
	f.mu.Unlock()
	if err != nil {
		return 0, 0, err
	}
	return st, reason, f.leave("DomainGetState", dom.Name)
}

// DomainDefineXMLFlags defines a persistent domain as libvirt does: it
// assigns a UUID and a MAC to each NIC without one; a name taken by another
// UUID is refused.
func (f *fakeLibvirt) DomainDefineXMLFlags(x string, flags libvirt.DomainDefineFlags) (libvirt.Domain, error) {
	var dx libvirtxml.Domain
	if err := dx.Unmarshal(x); err != nil {
		return libvirt.Domain{}, lvErrorf(libvirt.ErrXMLError, "XML error: %v", err)
	}
	if err := f.enter("DomainDefineXMLFlags", dx.Name); err != nil {
		return libvirt.Domain{}, err
	}
	d, err := f.define(&dx)
	if err != nil {
		return libvirt.Domain{}, err
	}
	return d.dom, f.leave("DomainDefineXMLFlags", dx.Name)
}

func (f *fakeLibvirt) define(dx *libvirtxml.Domain) (*fakeDomain, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if old, ok := f.domains[dx.Name]; ok && (dx.UUID == "" || dx.UUID != formatUUID(old.dom.UUID)) {
		return nil, lvErrorf(libvirt.ErrOperationFailed, "operation failed: domain '%s' already exists with uuid %s", dx.Name, formatUUID(old.dom.UUID))
	}
	f.serial++
	u := fakeUUID(f.serial)
	dx.UUID = formatUUID(u)
	mac := ""
	if dx.Devices != nil {
		for i := range dx.Devices.Interfaces {
			ifc := &dx.Devices.Interfaces[i]
			if ifc.MAC == nil {
				ifc.MAC = &libvirtxml.DomainInterfaceMAC{Address: fmt.Sprintf("52:54:00:00:%02x:%02x", f.serial>>8&0xff, f.serial&0xff)}
			}
			if i == 0 {
				mac = ifc.MAC.Address
			}
		}
	}
	out, err := dx.Marshal()
	if err != nil {
		return nil, lvErrorf(libvirt.ErrXMLError, "XML error: %v", err)
	}
	d := &fakeDomain{
		dom: libvirt.Domain{Name: dx.Name, UUID: u, ID: -1}, xml: out, mac: mac,
		state: libvirt.DomainShutoff, reason: int32(libvirt.DomainShutoffUnknown), persistent: true,
	}
	f.domains[dx.Name] = d
	return d, nil
}

// DomainCreate starts a defined domain; its volume disks must exist.
func (f *fakeLibvirt) DomainCreate(dom libvirt.Domain) error {
	if err := f.enter("DomainCreate", dom.Name); err != nil {
		return err
	}
	if err := f.start(dom); err != nil {
		return err
	}
	return f.leave("DomainCreate", dom.Name)
}

func (f *fakeLibvirt) start(dom libvirt.Domain) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	d, err := f.domainByHandle(dom)
	if err != nil {
		return err
	}
	if domainActive(d.state) {
		return lvErrorf(libvirt.ErrOperationInvalid, "Requested operation is not valid: domain is already running")
	}
	var dx libvirtxml.Domain
	if err := dx.Unmarshal(d.xml); err != nil {
		return lvErrorf(libvirt.ErrXMLError, "XML error: %v", err)
	}
	if dx.Devices != nil {
		for _, disk := range dx.Devices.Disks {
			if disk.Source == nil || disk.Source.Volume == nil {
				continue
			}
			p, err := f.activePool(disk.Source.Volume.Pool)
			if err != nil {
				return err
			}
			if _, ok := p.vols[disk.Source.Volume.Volume]; !ok {
				return lvErrorf(libvirt.ErrNoStorageVol, "Storage volume not found: no storage vol with matching name '%s'", disk.Source.Volume.Volume)
			}
		}
	}
	f.serial++
	d.state, d.reason, d.dom.ID = libvirt.DomainRunning, int32(libvirt.DomainRunningBooted), int32(f.serial)
	return nil
}

func (f *fakeLibvirt) DomainDestroy(dom libvirt.Domain) error {
	if err := f.enter("DomainDestroy", dom.Name); err != nil {
		return err
	}
	f.mu.Lock()
	d, err := f.domainByHandle(dom)
	if err == nil && !domainActive(d.state) {
		err = lvErrorf(libvirt.ErrOperationInvalid, "Requested operation is not valid: domain is not running")
	}
	if err == nil {
		d.state, d.reason, d.dom.ID = libvirt.DomainShutoff, int32(libvirt.DomainShutoffDestroyed), -1
		if !d.persistent {
			delete(f.domains, d.dom.Name)
		}
	}
	f.mu.Unlock()
	if err != nil {
		return err
	}
	return f.leave("DomainDestroy", dom.Name)
}

func (f *fakeLibvirt) DomainUndefineFlags(dom libvirt.Domain, flags libvirt.DomainUndefineFlagsValues) error {
	if err := f.enter("DomainUndefineFlags", dom.Name); err != nil {
		return err
	}
	f.mu.Lock()
	d, err := f.domainByHandle(dom)
	if err == nil {
		if domainActive(d.state) {
			d.persistent = false // transient until it stops
		} else {
			delete(f.domains, d.dom.Name)
		}
	}
	f.mu.Unlock()
	if err != nil {
		return err
	}
	return f.leave("DomainUndefineFlags", dom.Name)
}

func (f *fakeLibvirt) DomainInterfaceAddresses(dom libvirt.Domain, source uint32, flags uint32) ([]libvirt.DomainInterface, error) {
	if err := f.enter("DomainInterfaceAddresses", dom.Name); err != nil {
		return nil, err
	}
	f.mu.Lock()
	d, err := f.domainByHandle(dom)
	var out []libvirt.DomainInterface
	if err == nil && !domainActive(d.state) {
		err = lvErrorf(libvirt.ErrOperationInvalid, "Requested operation is not valid: domain is not running")
	}
	if err == nil {
		nic := func(name, mac, ip string) libvirt.DomainInterface {
			return libvirt.DomainInterface{Name: name, Hwaddr: libvirt.OptString{mac}, Addrs: []libvirt.DomainIPAddr{{Type: 0, Addr: ip, Prefix: 24}}}
		}
		switch libvirt.DomainInterfaceAddressesSource(source) {
		case libvirt.DomainInterfaceAddressesSrcAgent:
			if d.agentIP == "" {
				err = lvErrorf(libvirt.ErrAgentUnresponsive, "Guest agent is not responding: QEMU guest agent is not connected")
				break
			}
			out = []libvirt.DomainInterface{nic("lo", "00:00:00:00:00:00", "127.0.0.1"), nic("eth0", d.mac, d.agentIP)}
		case libvirt.DomainInterfaceAddressesSrcLease:
			if ip, ok := f.leases[d.mac]; ok {
				out = []libvirt.DomainInterface{nic("vnet0", d.mac, ip)}
			}
		case libvirt.DomainInterfaceAddressesSrcArp:
			if ip, ok := f.arp[d.mac]; ok {
				out = []libvirt.DomainInterface{nic("vnet0", d.mac, ip)}
			}
		default:
			err = lvErrorf(libvirt.ErrInvalidArg, "invalid argument: Unknown IP address data source %d", source)
		}
	}
	f.mu.Unlock()
	if err != nil {
		return nil, err
	}
	return out, f.leave("DomainInterfaceAddresses", dom.Name)
}

func (f *fakeLibvirt) StoragePoolLookupByName(name string) (libvirt.StoragePool, error) {
	if err := f.enter("StoragePoolLookupByName", name); err != nil {
		return libvirt.StoragePool{}, err
	}
	f.mu.Lock()
	p, err := f.poolByName(name)
	f.mu.Unlock()
	if err != nil {
		return libvirt.StoragePool{}, err
	}
	return p.pool, f.leave("StoragePoolLookupByName", name)
}

func (f *fakeLibvirt) StoragePoolRefresh(pool libvirt.StoragePool, flags uint32) error {
	if err := f.enter("StoragePoolRefresh", pool.Name); err != nil {
		return err
	}
	f.mu.Lock()
	_, err := f.activePool(pool.Name)
	f.mu.Unlock()
	if err != nil {
		return err
	}
	return f.leave("StoragePoolRefresh", pool.Name)
}

func (f *fakeLibvirt) StoragePoolGetInfo(pool libvirt.StoragePool) (uint8, uint64, uint64, uint64, error) {
	if err := f.enter("StoragePoolGetInfo", pool.Name); err != nil {
		return 0, 0, 0, 0, err
	}
	f.mu.Lock()
	p, err := f.poolByName(pool.Name)
	var st uint8
	var capacity, avail uint64
	if err == nil {
		st, capacity, avail = p.state, p.capacity, p.available
	}
	f.mu.Unlock()
	if err != nil {
		return 0, 0, 0, 0, err
	}
	return st, capacity, capacity - avail, avail, f.leave("StoragePoolGetInfo", pool.Name)
}

func volHandle(p *fakePool, v *fakeVol) libvirt.StorageVol {
	return libvirt.StorageVol{Pool: p.pool.Name, Name: v.name, Key: v.path}
}

func (f *fakeLibvirt) StorageVolLookupByName(pool libvirt.StoragePool, name string) (libvirt.StorageVol, error) {
	if err := f.enter("StorageVolLookupByName", name); err != nil {
		return libvirt.StorageVol{}, err
	}
	f.mu.Lock()
	p, v, err := f.volByHandle(libvirt.StorageVol{Pool: pool.Name, Name: name})
	var h libvirt.StorageVol
	if err == nil {
		h = volHandle(p, v)
	}
	f.mu.Unlock()
	if err != nil {
		return libvirt.StorageVol{}, err
	}
	return h, f.leave("StorageVolLookupByName", name)
}

// StorageVolCreateXML creates a volume; an overlay's backing store must be
// a volume (its capacity is the backing store's when 0).
func (f *fakeLibvirt) StorageVolCreateXML(pool libvirt.StoragePool, x string, flags libvirt.StorageVolCreateFlags) (libvirt.StorageVol, error) {
	var vx libvirtxml.StorageVolume
	if err := vx.Unmarshal(x); err != nil {
		return libvirt.StorageVol{}, lvErrorf(libvirt.ErrXMLError, "XML error: %v", err)
	}
	if err := f.enter("StorageVolCreateXML", vx.Name); err != nil {
		return libvirt.StorageVol{}, err
	}
	h, err := f.createVol(pool.Name, &vx)
	if err != nil {
		return libvirt.StorageVol{}, err
	}
	return h, f.leave("StorageVolCreateXML", vx.Name)
}

func (f *fakeLibvirt) createVol(pool string, vx *libvirtxml.StorageVolume) (libvirt.StorageVol, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	p, err := f.activePool(pool)
	if err != nil {
		return libvirt.StorageVol{}, err
	}
	if _, ok := p.vols[vx.Name]; ok {
		return libvirt.StorageVol{}, lvErrorf(libvirt.ErrStorageVolExist, "storage volume '%s' exists already", vx.Name)
	}
	v := &fakeVol{name: vx.Name, path: path.Join(p.dir, vx.Name), format: "raw"}
	if vx.Capacity != nil {
		v.capacity = vx.Capacity.Value
	}
	if vx.Target != nil && vx.Target.Format != nil {
		v.format = vx.Target.Format.Type
	}
	if bs := vx.BackingStore; bs != nil {
		b := f.volByPath(bs.Path)
		if b == nil {
			return libvirt.StorageVol{}, lvErrorf(libvirt.ErrInternalError, "internal error: Child process (qemu-img create) unexpected exit status 1: Could not open backing file '%s': No such file or directory", bs.Path)
		}
		v.backing = bs.Path
		if bs.Format != nil {
			v.backingFormat = bs.Format.Type
		}
		if v.capacity == 0 {
			v.capacity = b.capacity
		}
	}
	p.vols[v.name] = v
	return volHandle(p, v), nil
}

func (f *fakeLibvirt) StorageVolGetXMLDesc(vol libvirt.StorageVol, flags uint32) (string, error) {
	if err := f.enter("StorageVolGetXMLDesc", vol.Name); err != nil {
		return "", err
	}
	f.mu.Lock()
	_, v, err := f.volByHandle(vol)
	var vx libvirtxml.StorageVolume
	if err == nil {
		vx = libvirtxml.StorageVolume{
			Type: "file", Name: v.name, Key: v.path,
			Capacity:   &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: v.capacity},
			Allocation: &libvirtxml.StorageVolumeSize{Unit: "bytes", Value: uint64(len(v.data))},
			Target:     &libvirtxml.StorageVolumeTarget{Path: v.path, Format: &libvirtxml.StorageVolumeTargetFormat{Type: v.format}},
		}
		if v.backing != "" {
			vx.BackingStore = &libvirtxml.StorageVolumeBackingStore{Path: v.backing, Format: &libvirtxml.StorageVolumeTargetFormat{Type: v.backingFormat}}
		}
	}
	f.mu.Unlock()
	if err != nil {
		return "", err
	}
	x, err := vx.Marshal()
	if err != nil {
		return "", lvErrorf(libvirt.ErrXMLError, "XML error: %v", err)
	}
	return x, f.leave("StorageVolGetXMLDesc", vol.Name)
}

func (f *fakeLibvirt) StorageVolGetInfo(vol libvirt.StorageVol) (int8, uint64, uint64, error) {
	if err := f.enter("StorageVolGetInfo", vol.Name); err != nil {
		return 0, 0, 0, err
	}
	f.mu.Lock()
	_, v, err := f.volByHandle(vol)
	var capacity, alloc uint64
	if err == nil {
		capacity, alloc = v.capacity, uint64(len(v.data))
	}
	f.mu.Unlock()
	if err != nil {
		return 0, 0, 0, err
	}
	return 0, capacity, alloc, f.leave("StorageVolGetInfo", vol.Name)
}

// StorageVolUpload writes length bytes of outStream at offset, within the
// volume's capacity (libvirt refuses a range beyond it).
func (f *fakeLibvirt) StorageVolUpload(vol libvirt.StorageVol, outStream io.Reader, offset, length uint64, flags libvirt.StorageVolUploadFlags) error {
	if err := f.enter("StorageVolUpload", vol.Name); err != nil {
		return err
	}
	f.mu.Lock()
	_, v, err := f.volByHandle(vol)
	if err == nil && offset+length > v.capacity {
		err = lvErrorf(libvirt.ErrInvalidArg, "invalid argument: range to upload exceeds volume size")
	}
	f.mu.Unlock()
	if err != nil {
		return err
	}
	data, err := io.ReadAll(io.LimitReader(outStream, int64(length)))
	if err != nil {
		return err
	}
	f.mu.Lock()
	buf := make([]byte, offset+uint64(len(data)))
	copy(buf, v.data)
	copy(buf[offset:], data)
	v.data = buf
	f.mu.Unlock()
	return f.leave("StorageVolUpload", vol.Name)
}

func (f *fakeLibvirt) StorageVolDelete(vol libvirt.StorageVol, flags libvirt.StorageVolDeleteFlags) error {
	if err := f.enter("StorageVolDelete", vol.Name); err != nil {
		return err
	}
	f.mu.Lock()
	p, v, err := f.volByHandle(vol)
	if err == nil {
		delete(p.vols, v.name)
	}
	f.mu.Unlock()
	if err != nil {
		return err
	}
	return f.leave("StorageVolDelete", vol.Name)
}

// Helpers reading and changing the fake's state directly (no calls counted).

func (f *fakeLibvirt) domain(name string) (fakeDomain, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	d, ok := f.domains[name]
	if !ok {
		return fakeDomain{}, false
	}
	return *d, true
}

func (f *fakeLibvirt) setDomain(name string, fn func(*fakeDomain)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f.domains[name])
}

func (f *fakeLibvirt) vol(pool, name string) (fakeVol, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	p, ok := f.pools[pool]
	if !ok {
		return fakeVol{}, false
	}
	v, ok := p.vols[name]
	if !ok {
		return fakeVol{}, false
	}
	return *v, true
}

func (f *fakeLibvirt) volNames(pool string) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for n := range f.pools[pool].vols {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

func (f *fakeLibvirt) domainNames() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for n := range f.domains {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

func (f *fakeLibvirt) removeVol(pool, name string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.pools[pool].vols, name)
}

func (f *fakeLibvirt) putVol(pool string, v fakeVol) {
	f.mu.Lock()
	defer f.mu.Unlock()
	p := f.pools[pool]
	if v.path == "" {
		v.path = path.Join(p.dir, v.name)
	}
	p.vols[v.name] = &v
}

// defineXML defines a domain from x directly (as another tool would).
func (f *fakeLibvirt) defineXML(t *testing.T, x string) {
	t.Helper()
	var dx libvirtxml.Domain
	if err := dx.Unmarshal(x); err != nil {
		t.Error(err) // may run on a call's goroutine: no Fatal
		return
	}
	if _, err := f.define(&dx); err != nil {
		t.Error(err)
	}
}

func (f *fakeLibvirt) setLease(mac, ip string) {
	f.mu.Lock()
	f.leases[mac] = ip
	f.mu.Unlock()
}

func (f *fakeLibvirt) setARP(mac, ip string) {
	f.mu.Lock()
	f.arp[mac] = ip
	f.mu.Unlock()
}

// fakeSession is the lvSession over a fakeLibvirt, with libvirtconn.Session's
// Do contract: fn runs on its own goroutine; a Do whose ctx ends returns at
// once (fn is abandoned and completes later); Close ends every Do and waits
// for their goroutines; after Close, Do fails with KindClosed. A call that
// fails with go-libvirt's ErrInterrupted (the connection went) is returned
// as KindUnreachable. dial, when set, runs before each call: its error is
// the call's (a failed connect).
type fakeSession struct {
	lv *fakeLibvirt

	mu      sync.Mutex
	closed  bool
	closing chan struct{}
	dial    func() error
	wg      sync.WaitGroup
	closes  int
}

func newFakeSession(lv *fakeLibvirt) *fakeSession {
	return &fakeSession{lv: lv, closing: make(chan struct{})}
}

const fakeAddr = "hv1.example:22"

func (s *fakeSession) closedError() error {
	return &sshconn.Error{Kind: sshconn.KindClosed, Address: fakeAddr, Op: "libvirt call", Err: errors.New("libvirt session closed")}
}

func fakeCtxError(err error) error {
	k := sshconn.KindUnknown
	if errors.Is(err, context.DeadlineExceeded) || errors.As(err, new(*budget.TimeoutError)) {
		k = sshconn.KindUnreachable
	}
	return &sshconn.Error{Kind: k, Address: fakeAddr, Op: "libvirt call", Err: err}
}

func (s *fakeSession) setDial(d func() error) {
	s.mu.Lock()
	s.dial = d
	s.mu.Unlock()
}

func (s *fakeSession) Do(ctx context.Context, fn func(lvAPI) error) error {
	if err := budget.Err(ctx); err != nil {
		return fakeCtxError(err)
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return s.closedError()
	}
	dial := s.dial
	s.wg.Add(1)
	s.mu.Unlock()
	if dial != nil {
		if err := dial(); err != nil {
			s.wg.Done()
			return err
		}
	}
	done := make(chan error, 1)
	go func() {
		defer s.wg.Done()
		done <- fn(s.lv)
	}()
	select {
	case err := <-done:
		if errors.Is(err, libvirt.ErrInterrupted) {
			return &sshconn.Error{Kind: sshconn.KindUnreachable, Address: fakeAddr, Op: "libvirt call", Err: err}
		}
		return err
	case <-ctx.Done():
		return fakeCtxError(budget.Err(ctx))
	case <-s.closing:
		return s.closedError()
	}
}

// wait waits until no fn runs (abandoned calls included).
func (s *fakeSession) wait() { s.wg.Wait() }

func (s *fakeSession) Close() error {
	s.mu.Lock()
	s.closes++
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	close(s.closing)
	close(s.lv.killed)
	s.mu.Unlock()
	s.wg.Wait()
	return nil
}

// fakeImages is the imageCache: Ensure puts the base volume into the
// fake's pool (as a fetch would) and returns it, or fails with err.
type fakeImages struct {
	lv    *fakeLibvirt
	entry string
	pool  string

	mu      sync.Mutex
	err     error
	ensured []string
	pools   []libvirt.StoragePool // given by UsePool
	closed  int
	block   chan struct{} // when set, Ensure waits for it or ctx
	entered chan struct{} // when set, closed by the first Ensure
	once    sync.Once
}

func (c *fakeImages) setErr(err error) {
	c.mu.Lock()
	c.err = err
	c.mu.Unlock()
}

func (c *fakeImages) Ensure(ctx context.Context, img imagecache.Image) (basecache.Base, error) {
	c.mu.Lock()
	c.ensured = append(c.ensured, img.Key)
	err, block := c.err, c.block
	c.mu.Unlock()
	if c.entered != nil {
		c.once.Do(func() { close(c.entered) })
	}
	if block != nil {
		select {
		case <-block:
		case <-ctx.Done():
			return basecache.Base{}, ctx.Err()
		}
	}
	if err != nil {
		return basecache.Base{}, err
	}
	format := img.Format
	if format == "" {
		format = "qcow2"
	}
	name := basecache.BaseName(c.entry, img.Key, format)
	if _, ok := c.lv.vol(c.pool, name); !ok {
		c.lv.putVol(c.pool, fakeVol{name: name, format: format, capacity: 1 << 30, data: []byte("base")})
	}
	v, _ := c.lv.vol(c.pool, name)
	return basecache.Base{Volume: name, Path: v.path, Digest: "0123456789abcdef", Format: format}, nil
}

func (c *fakeImages) UsePool(p libvirt.StoragePool) {
	c.mu.Lock()
	c.pools = append(c.pools, p)
	c.mu.Unlock()
}

func (c *fakeImages) usedPools() []libvirt.StoragePool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.pools)
}

func (c *fakeImages) Close() error {
	c.mu.Lock()
	c.closed++
	c.mu.Unlock()
	return nil
}

// fakeEnv is a Provider on the fakes.
type fakeEnv struct {
	t      *testing.T
	cfg    Config
	lv     *fakeLibvirt
	sess   *fakeSession
	images *fakeImages
	p      *provider
}

// newFakeEnv builds a Provider of validConfig with image "tiny" (and mod
// applied before validation) on fresh fakes; it is closed when t ends.
func newFakeEnv(t *testing.T, mod ...func(*Config)) *fakeEnv {
	t.Helper()
	c := validConfig()
	c.Images = map[string]imagecache.Image{"tiny": {URL: "http://127.0.0.1:1/tiny.qcow2"}}
	for _, m := range mod {
		m(&c)
	}
	cfg, err := c.validate(false)
	if err != nil {
		t.Fatal(err)
	}
	lv := newFakeLibvirt()
	e := &fakeEnv{t: t, cfg: cfg, lv: lv, sess: newFakeSession(lv), images: &fakeImages{lv: lv, entry: cfg.Entry, pool: cfg.Pool}}
	e.p = newProvider(cfg, testr.NewWithOptions(t, testr.Options{Verbosity: 1}), noop.NewTracerProvider().Tracer(tracerName), e.sess, e.images)
	t.Cleanup(func() {
		if err := e.p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return e
}

func (e *fakeEnv) dom(name string) string { return domainName(e.cfg.Entry, name) }

// failNth returns a hook failing the n-th call (from 1) of op, before it
// takes effect, with err.
func failNth(op string, n int, err error) func(fakeCall) error {
	var mu sync.Mutex
	seen := 0
	return func(c fakeCall) error {
		if c.Op != op || c.After {
			return nil
		}
		mu.Lock()
		defer mu.Unlock()
		seen++
		if seen == n {
			return err
		}
		return nil
	}
}

// faults runs hooks in order; the first error wins.
func faults(hooks ...func(fakeCall) error) func(fakeCall) error {
	return func(c fakeCall) error {
		for _, h := range hooks {
			if err := h(c); err != nil {
				return err
			}
		}
		return nil
	}
}

// callsSince returns the calls after the first n.
func (f *fakeLibvirt) callsSince(n int) []fakeCall {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]fakeCall(nil), f.calls[n:]...)
}
