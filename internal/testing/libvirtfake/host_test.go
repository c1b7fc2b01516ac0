package libvirtfake_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/internal/basecache"
	"github.com/egressproxy/egressproxy/internal/testing/libvirtfake"
	"go.uber.org/goleak"
	"libvirt.org/go/libvirtxml"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var _ basecache.Libvirt = (*libvirtfake.Session)(nil)

func code(err error) libvirt.ErrorNumber {
	var le libvirt.Error
	if !errors.As(err, &le) {
		return -1
	}
	return libvirt.ErrorNumber(le.Code)
}

func volXML(name string) string {
	x, err := (&libvirtxml.StorageVolume{Name: name, Capacity: &libvirtxml.StorageVolumeSize{Unit: "KiB", Value: 4}}).Marshal()
	if err != nil {
		panic(err)
	}
	return x
}

func newHost(t *testing.T) (*libvirtfake.Host, *libvirtfake.Session) {
	t.Helper()
	h := libvirtfake.New()
	t.Cleanup(func() { _ = h.Close() })
	if err := h.AddPool("p", 1<<20); err != nil {
		t.Fatal(err)
	}
	return h, h.Shared()
}

// The errors are libvirtd's: the codes a classifier looks at.
func TestErrorsAreLibvirts(t *testing.T) {
	h, s := newHost(t)
	_, err := s.StoragePoolLookupByName("nope")
	if code(err) != libvirt.ErrNoStoragePool {
		t.Fatalf("missing pool: %v", err)
	}
	p, _ := s.StoragePoolLookupByName("p")
	if _, err := s.StorageVolLookupByName(p, "nope"); code(err) != libvirt.ErrNoStorageVol {
		t.Fatalf("missing volume: %v", err)
	}
	if _, err := s.StorageVolCreateXML(p, volXML("v"), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := s.StorageVolCreateXML(p, volXML("v"), 0); code(err) != libvirt.ErrStorageVolExist {
		t.Fatalf("duplicate volume: %v", err)
	}
	if _, err := s.StorageVolCreateXML(p, "<volume", 0); code(err) != libvirt.ErrXMLError {
		t.Fatalf("bad XML: %v", err)
	}
	if _, err := s.DomainGetXMLDesc(libvirt.Domain{Name: "d"}, 0); code(err) != libvirt.ErrNoDomain {
		t.Fatalf("missing domain: %v", err)
	}
	if err := h.SetPoolState("p", libvirt.StoragePoolInactive); err != nil {
		t.Fatal(err)
	}
	_, _, err = s.StoragePoolListAllVolumes(p, 1, 0)
	var le libvirt.Error
	if !errors.As(err, &le) || code(err) != libvirt.ErrOperationInvalid || le.Message != "Requested operation is not valid: storage pool 'p' is not active" {
		t.Fatalf("stopped pool: %#v", err)
	}
	if st, _, _, _, err := s.StoragePoolGetInfo(p); err != nil || st != uint8(libvirt.StoragePoolInactive) {
		t.Fatalf("GetInfo of a stopped pool: %d, %v", st, err)
	}
	if active, _ := s.StoragePoolIsActive(p); active != 0 {
		t.Fatal("stopped pool reported active")
	}
	pools, _, _ := s.ConnectListAllStoragePools(1, libvirt.ConnectListStoragePoolsActive)
	if len(pools) != 0 {
		t.Fatalf("active pools: %v", pools)
	}
}

// Volumes: create, info, path, XML, upload, download, delete; the pool's
// sizes follow.
func TestVolumeRoundTrip(t *testing.T) {
	h, s := newHost(t)
	h.SetChunkSize(3)
	p, _ := s.StoragePoolLookupByName("p")
	v, err := s.StorageVolCreateXML(p, volXML("v"), 0)
	if err != nil {
		t.Fatal(err)
	}
	data := []byte("hello, volume")
	if err := s.StorageVolUpload(v, bytes.NewReader(data), 0, 0, 0); err != nil {
		t.Fatal(err)
	}
	_, capacity, phys, err := s.StorageVolGetInfoFlags(v, uint32(libvirt.StorageVolGetPhysical))
	if err != nil || capacity != 4096 || phys != uint64(len(data)) {
		t.Fatalf("info: %d %d %v", capacity, phys, err)
	}
	var out bytes.Buffer
	if err := s.StorageVolDownload(v, &out, 0, 0, 0); err != nil || out.String() != string(data) {
		t.Fatalf("download %q, %v", out.String(), err)
	}
	out.Reset()
	if err := s.StorageVolDownload(v, &out, 7, 6, 0); err != nil || out.String() != "volume" {
		t.Fatalf("ranged download %q, %v", out.String(), err)
	}
	if path, _ := s.StorageVolGetPath(v); path != "/pools/p/v" {
		t.Fatalf("path %q", path)
	}
	x, err := s.StorageVolGetXMLDesc(v, 0)
	var sv libvirtxml.StorageVolume
	if err != nil || sv.Unmarshal(x) != nil || sv.Target.Path != "/pools/p/v" || sv.Allocation.Value != uint64(len(data)) {
		t.Fatalf("XML %s, %v", x, err)
	}
	if _, _, alloc, avail, _ := s.StoragePoolGetInfo(p); alloc != uint64(len(data)) || avail != 1<<20-uint64(len(data)) {
		t.Fatalf("pool allocation %d, available %d", alloc, avail)
	}
	vols, _, _ := s.StoragePoolListAllVolumes(p, 1, 0)
	if len(vols) != 1 || vols[0] != v {
		t.Fatalf("list %v", vols)
	}
	if err := s.StorageVolDelete(v, 0); err != nil {
		t.Fatal(err)
	}
	if got := h.VolumeNames("p"); len(got) != 0 {
		t.Fatalf("left %v", got)
	}
}

// Writing beyond the pool's free space fails as a full disk does.
func TestUploadFillsPool(t *testing.T) {
	h, s := newHost(t)
	_ = h.SetPoolCapacity("p", 10)
	p, _ := s.StoragePoolLookupByName("p")
	v, _ := s.StorageVolCreateXML(p, volXML("v"), 0)
	err := s.StorageVolUpload(v, bytes.NewReader(make([]byte, 11)), 0, 0, 0)
	if code(err) != libvirt.ErrSystemError {
		t.Fatalf("upload into a full pool: %v", err)
	}
}

// Kill ends a stream call stalled by a hook, and calls after it fail.
func TestKillEndsStalledStream(t *testing.T) {
	h, _ := newHost(t)
	h.SetChunkSize(4)
	_ = h.PutVolume("p", libvirtfake.Volume{Name: "v", Data: make([]byte, 64)})
	d, err := h.Dedicated(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	stalled := make(chan struct{})
	var once sync.Once
	h.SetStreamHook("StorageVolDownload", func(c libvirtfake.Call) error {
		if c.Done >= 8 {
			once.Do(func() { close(stalled) })
			return c.Wait(nil)
		}
		return nil
	})
	done := make(chan error, 1)
	var out bytes.Buffer
	go func() { done <- d.StorageVolDownload(libvirt.StorageVol{Pool: "p", Name: "v"}, &out, 0, 0, 0) }()
	<-stalled
	if h.OpenSessions() != 1 {
		t.Fatalf("%d open sessions", h.OpenSessions())
	}
	d.Kill()
	if err := <-done; !errors.Is(err, libvirtfake.ErrKilled) || out.Len() != 8 {
		t.Fatalf("killed download: %v after %d bytes", err, out.Len())
	}
	if _, err := d.StoragePoolLookupByName("p"); !errors.Is(err, libvirtfake.ErrKilled) {
		t.Fatalf("call on a killed session: %v", err)
	}
	if h.OpenSessions() != 0 {
		t.Fatalf("%d open sessions after Kill", h.OpenSessions())
	}
}

// Do returns at once when ctx ends; Close ends the abandoned call and waits.
func TestDoAbandonAndClose(t *testing.T) {
	h := libvirtfake.New()
	_ = h.AddPool("p", 1)
	h.SetHook("StoragePoolLookupByName", libvirtfake.Block(nil))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	err := h.Do(ctx, func(s *libvirtfake.Session) error {
		_, err := s.StoragePoolLookupByName("p")
		return err
	})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Do = %v", err)
	}
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	if err := h.Do(context.Background(), func(*libvirtfake.Session) error { return nil }); !errors.Is(err, libvirtfake.ErrHostClosed) {
		t.Fatalf("Do after Close = %v", err)
	}
	if h.Calls("StoragePoolLookupByName") != 1 {
		t.Fatalf("%d calls", h.Calls("StoragePoolLookupByName"))
	}
}

// Hooks: FailFirst fails the first calls only; an upload source error ends the
// call with it; CutAfter cuts a stream.
func TestHooks(t *testing.T) {
	h, s := newHost(t)
	h.SetChunkSize(2)
	boom := errors.New("boom")
	h.SetHook("StoragePoolRefresh", libvirtfake.FailFirst(1, boom))
	p, _ := s.StoragePoolLookupByName("p")
	if err := s.StoragePoolRefresh(p, 0); err != boom {
		t.Fatalf("first refresh: %v", err)
	}
	if err := s.StoragePoolRefresh(p, 0); err != nil {
		t.Fatalf("second refresh: %v", err)
	}
	v, _ := s.StorageVolCreateXML(p, volXML("v"), 0)
	h.SetStreamHook("StorageVolUpload", libvirtfake.CutAfter(4, boom))
	if err := s.StorageVolUpload(v, bytes.NewReader([]byte("abcdefgh")), 0, 0, 0); err != boom {
		t.Fatalf("cut upload: %v", err)
	}
	if got, _ := h.Volume("p", "v"); string(got.Data) != "abcd" {
		t.Fatalf("stored %q", got.Data)
	}
	h.SetStreamHook("StorageVolUpload", nil)
	src := io.MultiReader(bytes.NewReader([]byte("xy")), iotest{boom})
	if err := s.StorageVolUpload(v, src, 0, 0, 0); err != boom {
		t.Fatalf("failing source: %v", err)
	}
}

type iotest struct{ err error }

func (r iotest) Read([]byte) (int, error) { return 0, r.err }

// Many sessions at once (run with -race).
func TestConcurrentUse(t *testing.T) {
	h, _ := newHost(t)
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			d, err := h.Dedicated(context.Background())
			if err != nil {
				t.Error(err)
				return
			}
			defer d.Close()
			p, _ := d.StoragePoolLookupByName("p")
			name := fmt.Sprintf("v%d", i)
			v, err := d.StorageVolCreateXML(p, volXML(name), 0)
			if err != nil {
				t.Error(err)
				return
			}
			if err := d.StorageVolUpload(v, bytes.NewReader(bytes.Repeat([]byte{byte(i)}, 1000)), 0, 0, 0); err != nil {
				t.Error(err)
			}
			_, _, _ = d.StoragePoolListAllVolumes(p, 1, 0)
			if _, err := d.DomainDefineXML(fmt.Sprintf("<domain type='kvm'><name>d%d</name></domain>", i)); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if n := len(h.VolumeNames("p")); n != 8 {
		t.Fatalf("%d volumes", n)
	}
	doms, _, _ := h.Shared().ConnectListAllDomains(1, 0)
	if len(doms) != 8 {
		t.Fatalf("%d domains", len(doms))
	}
}

func domXML(name string, disks ...libvirtxml.DomainDisk) string {
	d := libvirtxml.Domain{Type: "kvm", Name: name, Devices: &libvirtxml.DomainDeviceList{
		Disks:      disks,
		Interfaces: []libvirtxml.DomainInterface{{Source: &libvirtxml.DomainInterfaceSource{Network: &libvirtxml.DomainInterfaceSourceNetwork{Network: "default"}}}},
	}}
	x, err := d.Marshal()
	if err != nil {
		panic(err)
	}
	return x
}

func volumeDisk(pool, vol string) libvirtxml.DomainDisk {
	return libvirtxml.DomainDisk{Device: "disk",
		Source: &libvirtxml.DomainDiskSource{Volume: &libvirtxml.DomainDiskSourceVolume{Pool: pool, Volume: vol}},
		Target: &libvirtxml.DomainDiskTarget{Dev: "vda"}}
}

// Define fills in the UUID and a MAC, and refuses a second definition of
// the name without its UUID, and another name with it.
func TestDomainDefine(t *testing.T) {
	h, s := newHost(t)
	dom, err := s.DomainDefineXMLFlags(domXML("d", volumeDisk("p", "root")), 0)
	if err != nil {
		t.Fatal(err)
	}
	d, ok := h.Domain("d")
	var dx libvirtxml.Domain
	if !ok || d.Handle() != dom || dom.ID != -1 || d.State != libvirt.DomainShutoff || !d.Persistent ||
		d.MAC == "" || dx.Unmarshal(d.XML) != nil || dx.UUID == "" || dx.Devices.Interfaces[0].MAC.Address != d.MAC {
		t.Fatalf("defined %+v (handle %+v)", d, dom)
	}
	if _, err := s.DomainDefineXMLFlags(domXML("d"), 0); code(err) != libvirt.ErrOperationFailed {
		t.Fatalf("second definition without the UUID: %v", err)
	}
	if _, err := s.DomainDefineXMLFlags(d.XML, 0); err != nil {
		t.Fatalf("definition again with the UUID: %v", err)
	}
	other := strings.Replace(d.XML, "<name>d</name>", "<name>e</name>", 1)
	if _, err := s.DomainDefineXMLFlags(other, 0); code(err) != libvirt.ErrOperationFailed {
		t.Fatalf("definition of another name with the UUID: %v", err)
	}
}

// A start needs the disks' volumes; undefine while running leaves a
// transient domain that destroy removes.
func TestDomainStartStop(t *testing.T) {
	h, s := newHost(t)
	dom, err := s.DomainDefineXMLFlags(domXML("d", volumeDisk("p", "root")), 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.DomainCreate(dom); code(err) != libvirt.ErrNoStorageVol {
		t.Fatalf("start without the disk's volume: %v", err)
	}
	if err := h.PutVolume("p", libvirtfake.Volume{Name: "root"}); err != nil {
		t.Fatal(err)
	}
	if err := s.DomainCreate(dom); err != nil {
		t.Fatal(err)
	}
	if err := s.DomainCreate(dom); code(err) != libvirt.ErrOperationInvalid {
		t.Fatalf("start of a running domain: %v", err)
	}
	if st, reason, err := s.DomainGetState(dom, 0); err != nil || libvirt.DomainState(st) != libvirt.DomainRunning || reason != int32(libvirt.DomainRunningBooted) {
		t.Fatalf("state %d %d %v", st, reason, err)
	}
	if got, err := s.DomainLookupByName("d"); err != nil || got.ID <= 0 {
		t.Fatalf("lookup of a running domain: %+v, %v", got, err)
	}
	if err := s.DomainUndefineFlags(dom, 0); err != nil {
		t.Fatal(err)
	}
	if d, ok := h.Domain("d"); !ok || d.Persistent {
		t.Fatalf("undefined while running: %+v, %v", d, ok)
	}
	if err := s.DomainDestroy(dom); err != nil {
		t.Fatal(err)
	}
	if names := h.DomainNames(); len(names) != 0 {
		t.Fatalf("a transient domain stayed after destroy: %v", names)
	}
	if _, err := s.DomainGetXMLDesc(dom, 0); code(err) != libvirt.ErrNoDomain {
		t.Fatalf("XML of a gone domain: %v", err)
	}
	if err := s.DomainDestroy(dom); code(err) != libvirt.ErrNoDomain {
		t.Fatalf("destroy of a gone domain: %v", err)
	}
}

// Listings filter on the domain's activity; the state stats say it.
func TestDomainListings(t *testing.T) {
	h, s := newHost(t)
	for _, n := range []string{"b", "a"} {
		if _, err := h.DefineDomain(domXML(n)); err != nil {
			t.Fatal(err)
		}
	}
	if err := h.StartDomain("b"); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		flags libvirt.ConnectListAllDomainsFlags
		want  string
	}{
		{0, "[a b]"},
		{libvirt.ConnectListDomainsActive, "[b]"},
		{libvirt.ConnectListDomainsInactive, "[a]"},
		{libvirt.ConnectListDomainsActive | libvirt.ConnectListDomainsInactive, "[a b]"},
	} {
		doms, n, err := s.ConnectListAllDomains(1, tc.flags)
		var names []string
		for _, d := range doms {
			names = append(names, d.Name)
		}
		if err != nil || int(n) != len(names) || fmt.Sprint(names) != tc.want {
			t.Errorf("flags %v: %v (%d), %v; want %s", tc.flags, names, n, err, tc.want)
		}
	}
	stats, err := s.ConnectGetAllDomainStats(nil, uint32(libvirt.DomainStatsState), 0)
	if err != nil || len(stats) != 2 || stats[0].Params[0].Value.I != int32(libvirt.DomainShutoff) || stats[1].Params[0].Value.I != int32(libvirt.DomainRunning) {
		t.Fatalf("stats %+v, %v", stats, err)
	}
}

// A running domain's addresses come from the source asked.
func TestInterfaceAddresses(t *testing.T) {
	h, s := newHost(t)
	d, err := h.DefineDomain(domXML("d"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.DomainInterfaceAddresses(d.Handle(), uint32(libvirt.DomainInterfaceAddressesSrcLease), 0); code(err) != libvirt.ErrOperationInvalid {
		t.Fatalf("addresses of a stopped domain: %v", err)
	}
	if err := h.StartDomain("d"); err != nil {
		t.Fatal(err)
	}
	d, _ = h.Domain("d")
	addrs := func(src libvirt.DomainInterfaceAddressesSource) ([]string, error) {
		ifs, err := s.DomainInterfaceAddresses(d.Handle(), uint32(src), 0)
		var out []string
		for _, i := range ifs {
			for _, a := range i.Addrs {
				out = append(out, i.Hwaddr[0]+"="+a.Addr)
			}
		}
		return out, err
	}
	if _, err := addrs(libvirt.DomainInterfaceAddressesSrcAgent); code(err) != libvirt.ErrAgentUnresponsive {
		t.Fatalf("agent without an answer: %v", err)
	}
	h.UpdateDomain("d", func(d *libvirtfake.Domain) { d.AgentAddress = "192.0.2.1" })
	h.SetLease(d.MAC, "192.0.2.2")
	h.SetARP(d.MAC, "2001:db8::3")
	for src, want := range map[libvirt.DomainInterfaceAddressesSource]string{
		libvirt.DomainInterfaceAddressesSrcAgent: "00:00:00:00:00:00=127.0.0.1 " + d.MAC + "=192.0.2.1",
		libvirt.DomainInterfaceAddressesSrcLease: d.MAC + "=192.0.2.2",
		libvirt.DomainInterfaceAddressesSrcArp:   d.MAC + "=2001:db8::3",
	} {
		if got, err := addrs(src); err != nil || fmt.Sprint(got) != "["+want+"]" {
			t.Errorf("source %v: %v, %v; want %s", src, got, err, want)
		}
	}
}

// The connection's answers; the capabilities' arguments are logged.
func TestConnection(t *testing.T) {
	h, s := newHost(t)
	if name, err := s.ConnectGetHostname(); err != nil || name != libvirtfake.Hostname {
		t.Fatalf("hostname %q, %v", name, err)
	}
	if v, err := s.ConnectGetLibVersion(); err != nil || v != libvirtfake.LibVersion {
		t.Fatalf("version %d, %v", v, err)
	}
	arch := libvirt.OptString{"x86_64"}
	if _, err := s.ConnectGetDomainCapabilities(nil, arch, nil, nil, 0); code(err) != libvirt.ErrNoSupport {
		t.Fatalf("capabilities without a document: %v", err)
	}
	h.SetDomainCapabilities("<domainCapabilities/>")
	if doc, err := s.ConnectGetDomainCapabilities(nil, arch, nil, nil, 0); err != nil || doc != "<domainCapabilities/>" {
		t.Fatalf("capabilities %q, %v", doc, err)
	}
	log := h.Log()
	if c := log[len(log)-1]; c.Method != "ConnectGetDomainCapabilities" || c.Args != `emulator=[] arch=["x86_64"] machine=[] virttype=[] flags=0` {
		t.Fatalf("logged %+v", c)
	}
}

// A reply hook runs after the call took effect; its error is the call's.
func TestReplyHook(t *testing.T) {
	h, s := newHost(t)
	boom := errors.New("boom")
	p, _ := s.StoragePoolLookupByName("p")
	h.ResetCalls()

	// A reply hook fails a call that took effect.
	h.SetReplyHook("StorageVolCreateXML", func(c libvirtfake.Call) error {
		if !c.After || c.Name() != "v" || c.Pool != "p" {
			t.Errorf("reply hook saw %+v", c)
		}
		return boom
	})
	if _, err := s.StorageVolCreateXML(p, volXML("v"), 0); err != boom {
		t.Fatalf("reply lost: %v", err)
	}
	if _, ok := h.Volume("p", "v"); !ok {
		t.Fatal("a call whose reply was lost had no effect")
	}
}

// The catch-all hook sees every libvirt call, not Do, before the method's
// own (here a chain of Named and FailNth); the log keeps them in order.
func TestCatchAllHookAndLog(t *testing.T) {
	h, s := newHost(t)
	boom := errors.New("boom")
	if err := h.PutVolume("p", libvirtfake.Volume{Name: "v"}); err != nil {
		t.Fatal(err)
	}

	var seen []string
	h.SetHook("", func(c libvirtfake.Call) error { seen = append(seen, c.Method+" "+c.Name()); return nil })
	h.SetHook("StorageVolGetPath", libvirtfake.Chain(nil, libvirtfake.Named("w", libvirtfake.Fail(boom)), libvirtfake.FailNth(2, boom)))
	if err := h.Do(context.Background(), func(s *libvirtfake.Session) error {
		_, err := s.StorageVolGetPath(libvirt.StorageVol{Pool: "p", Name: "v"})
		return err
	}); err != nil {
		t.Fatalf("first path: %v", err)
	}
	if _, err := s.StorageVolGetPath(libvirt.StorageVol{Pool: "p", Name: "w"}); err != boom {
		t.Fatalf("path of w: %v", err)
	}
	if _, err := s.StorageVolGetPath(libvirt.StorageVol{Pool: "p", Name: "v"}); err != boom {
		t.Fatalf("second path of v (the hook's second call after w's): %v", err)
	}
	if _, err := s.StorageVolGetPath(libvirt.StorageVol{Pool: "p", Name: "v"}); err != nil {
		t.Fatalf("third path of v: %v", err)
	}
	if want := "[StorageVolGetPath v StorageVolGetPath w StorageVolGetPath v StorageVolGetPath v]"; fmt.Sprint(seen) != want {
		t.Fatalf("the catch-all hook saw %v, want %s", seen, want)
	}
	var logged []string
	for _, c := range h.Log() {
		logged = append(logged, c.Method)
	}
	if fmt.Sprint(logged) != "[StorageVolGetPath StorageVolGetPath StorageVolGetPath StorageVolGetPath]" ||
		h.Calls("") != 4 || h.Calls("StorageVolGetPath") != 4 || h.Calls("Do") != 1 {
		t.Fatalf("log %v, %d calls (%d paths, %d Do)", logged, h.Calls(""), h.Calls("StorageVolGetPath"), h.Calls("Do"))
	}
	h.ClearHooks()
	h.ResetCalls()
	if _, err := s.StorageVolGetPath(libvirt.StorageVol{Pool: "p", Name: "w"}); code(err) != libvirt.ErrNoStorageVol || h.Calls("") != 1 {
		t.Fatalf("after ClearHooks and ResetCalls: %v, %d calls", err, h.Calls(""))
	}
}

// Pause holds the first call only; Kill ends a held call.
func TestPause(t *testing.T) {
	h, s := newHost(t)
	p, _ := s.StoragePoolLookupByName("p")
	pause := libvirtfake.NewPause()
	h.SetHook("StoragePoolRefresh", pause.Hook)
	done := make(chan error, 1)
	go func() { done <- s.StoragePoolRefresh(p, 0) }()
	<-pause.Entered()
	if err := s.StoragePoolRefresh(p, 0); err != nil {
		t.Fatalf("a second call while the first is held: %v", err)
	}
	pause.Release()
	if err := <-done; err != nil {
		t.Fatalf("released call: %v", err)
	}
	pause = libvirtfake.NewPause()
	h.SetHook("StoragePoolRefresh", pause.Hook)
	go func() { done <- s.StoragePoolRefresh(p, 0) }()
	<-pause.Entered()
	s.Kill()
	if err := <-done; !errors.Is(err, libvirtfake.ErrKilled) {
		t.Fatalf("held call of a killed session: %v", err)
	}
}

// A volume's backing store must exist; an overlay takes its capacity; an
// upload range beyond the capacity is refused.
func TestBackingStoreAndUploadRange(t *testing.T) {
	h, s := newHost(t)
	p, _ := s.StoragePoolLookupByName("p")
	overlay := func(backing string) string {
		x, _ := (&libvirtxml.StorageVolume{Name: "o", Target: &libvirtxml.StorageVolumeTarget{Format: &libvirtxml.StorageVolumeTargetFormat{Type: "qcow2"}},
			BackingStore: &libvirtxml.StorageVolumeBackingStore{Path: backing, Format: &libvirtxml.StorageVolumeTargetFormat{Type: "qcow2"}}}).Marshal()
		return x
	}
	if _, err := s.StorageVolCreateXML(p, overlay("/pools/p/base"), 0); code(err) != libvirt.ErrInternalError {
		t.Fatalf("overlay of a missing base: %v", err)
	}
	if err := h.PutVolume("p", libvirtfake.Volume{Name: "base", Capacity: 4096, Format: "qcow2"}); err != nil {
		t.Fatal(err)
	}
	o, err := s.StorageVolCreateXML(p, overlay("/pools/p/base"), 0)
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := h.Volume("p", "o"); v.Capacity != 4096 || v.Format != "qcow2" || v.BackingPath != "/pools/p/base" || v.BackingFormat != "qcow2" || v.Path != "/pools/p/o" {
		t.Fatalf("overlay %+v", v)
	}
	if err := s.StorageVolUpload(o, bytes.NewReader(make([]byte, 10)), 4090, 10, 0); code(err) != libvirt.ErrInvalidArg {
		t.Fatalf("upload beyond the capacity: %v", err)
	}
	if err := s.StorageVolUpload(o, bytes.NewReader(make([]byte, 10)), 4086, 10, 0); err != nil {
		t.Fatalf("upload up to the capacity: %v", err)
	}
	if _, capacity, alloc, err := s.StorageVolGetInfo(o); err != nil || capacity != 4096 || alloc != 4096 {
		t.Fatalf("info %d %d %v", capacity, alloc, err)
	}
}

// A copy inside the host (StorageVolCreateXMLFrom) is byte for byte only
// between raw volumes, as in libvirt's dir pools: a volume whose bytes
// start with the qcow2 magic is converted (other bytes). The name is
// taken atomically, a copy beyond the free space creates nothing, and a
// source in another pool of the Host is found. Pools of two Hosts never
// share a UUID.
func TestCreateXMLFrom(t *testing.T) {
	h, s := newHost(t)
	if err := h.AddPool("q", 1<<20); err != nil {
		t.Fatal(err)
	}
	raw := bytes.Repeat([]byte("raw!"), 4096)
	qcow := append([]byte("QFI\xfb"), raw[4:]...)
	for name, data := range map[string][]byte{"raw": raw, "qcow": qcow} {
		if err := h.PutVolume("p", libvirtfake.Volume{Name: name, Data: data}); err != nil {
			t.Fatal(err)
		}
	}
	q, _ := s.StoragePoolLookupByName("q")
	for _, tc := range []struct {
		from, to string
		same     bool
	}{{"raw", "raw-copy", true}, {"qcow", "qcow-copy", false}} {
		if _, err := s.StorageVolCreateXMLFrom(q, volXML(tc.to), libvirt.StorageVol{Pool: "p", Name: tc.from}, 0); err != nil {
			t.Fatalf("copy of %s: %v", tc.from, err)
		}
		src, _ := h.Volume("p", tc.from)
		got, ok := h.Volume("q", tc.to)
		if !ok || bytes.Equal(got.Data, src.Data) != tc.same {
			t.Fatalf("copy of %s: %d bytes, same bytes %v; want same %v", tc.from, len(got.Data), bytes.Equal(got.Data, src.Data), tc.same)
		}
	}
	if _, err := s.StorageVolCreateXMLFrom(q, volXML("raw-copy"), libvirt.StorageVol{Pool: "p", Name: "raw"}, 0); code(err) != libvirt.ErrStorageVolExist {
		t.Fatalf("copy onto an existing name: %v", err)
	}
	if err := h.SetPoolCapacity("q", 4096); err != nil {
		t.Fatal(err)
	}
	if _, err := s.StorageVolCreateXMLFrom(q, volXML("big"), libvirt.StorageVol{Pool: "p", Name: "raw"}, 0); err == nil || !strings.Contains(err.Error(), "No space left") {
		t.Fatalf("copy beyond the free space: %v", err)
	}
	if _, ok := h.Volume("q", "big"); ok {
		t.Fatal("a copy that did not fit was created")
	}
	_, s2 := newHost(t)
	p1, _ := s.StoragePoolLookupByName("p")
	p2, _ := s2.StoragePoolLookupByName("p")
	if p1.UUID == p2.UUID {
		t.Fatal("two hosts' pools share a UUID")
	}
}
