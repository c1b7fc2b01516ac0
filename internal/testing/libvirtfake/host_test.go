package libvirtfake_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
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
	if err := h.SetPoolActive("p", false); err != nil {
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
	_ = h.PutVolume("p", "v", make([]byte, 64))
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

// Hooks: FailN fails the first calls only; an upload source error ends the
// call with it; CutAfter cuts a stream.
func TestHooks(t *testing.T) {
	h, s := newHost(t)
	h.SetChunkSize(2)
	boom := errors.New("boom")
	h.SetHook("StoragePoolRefresh", libvirtfake.FailN(1, boom))
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
	if got, _ := h.VolumeData("p", "v"); string(got) != "abcd" {
		t.Fatalf("stored %q", got)
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
