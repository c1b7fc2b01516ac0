//go:build integration

package kvm2

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"

	"github.com/egressproxy/egressproxy/provider"
)

// procNames names the libvirt remote procedures kvm2 and imagecache use
// (numbers from libvirt's remote_protocol.x).
var procNames = map[uint32]string{
	1: "ConnectOpen", 2: "ConnectClose", 9: "DomainCreate", 12: "DomainDestroy", 14: "DomainGetXMLDesc",
	23: "DomainLookupByName", 59: "ConnectGetHostname", 60: "ConnectSupportsFeature", 66: "AuthList",
	83: "StoragePoolRefresh", 84: "StoragePoolLookupByName", 87: "StoragePoolGetInfo",
	93: "StorageVolCreateXML", 94: "StorageVolDelete", 95: "StorageVolLookupByName", 98: "StorageVolGetInfo",
	99: "StorageVolGetXMLDesc", 100: "StorageVolGetPath", 157: "ConnectGetLibVersion", 208: "StorageVolUpload",
	209: "StorageVolDownload", 212: "DomainGetState", 231: "DomainUndefineFlags", 273: "ConnectListAllDomains",
	282: "StoragePoolListAllVolumes", 350: "DomainDefineXMLFlags", 353: "DomainInterfaceAddresses",
}

// rpcCounter is a unix socket proxy in front of libvirtd's socket that
// counts the RPC calls (packets of type CALL) clients send through it.
type rpcCounter struct {
	ln    net.Listener
	path  string
	mu    sync.Mutex
	calls []uint32
	wg    sync.WaitGroup
}

func newRPCCounter(t *testing.T, target string) *rpcCounter {
	t.Helper()
	path := filepath.Join(t.TempDir(), "count.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	c := &rpcCounter{ln: ln, path: path}
	var conns []net.Conn
	var cmu sync.Mutex
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		for {
			in, err := ln.Accept()
			if err != nil {
				return
			}
			out, err := net.Dial("unix", target)
			if err != nil {
				in.Close()
				continue
			}
			cmu.Lock()
			conns = append(conns, in, out)
			cmu.Unlock()
			c.wg.Add(2)
			go func() { defer c.wg.Done(); _, _ = io.Copy(in, out); in.Close() }()
			go func() { defer c.wg.Done(); c.scan(in, out); out.Close() }()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		cmu.Lock()
		for _, c := range conns {
			c.Close()
		}
		cmu.Unlock()
		c.wg.Wait()
	})
	return c
}

// scan copies client→server packets and records each CALL's procedure.
func (c *rpcCounter) scan(in io.Reader, out io.Writer) {
	hdr := make([]byte, 28)
	for {
		if _, err := io.ReadFull(in, hdr); err != nil {
			return
		}
		n := binary.BigEndian.Uint32(hdr[0:4])
		proc := binary.BigEndian.Uint32(hdr[12:16])
		typ := binary.BigEndian.Uint32(hdr[16:20])
		if typ == 0 { // VIR_NET_CALL
			c.mu.Lock()
			c.calls = append(c.calls, proc)
			c.mu.Unlock()
		}
		if _, err := out.Write(hdr); err != nil {
			return
		}
		if n > 28 {
			if _, err := io.CopyN(out, in, int64(n-28)); err != nil {
				return
			}
		}
	}
}

// take returns and resets the calls seen so far.
func (c *rpcCounter) take() []uint32 {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := c.calls
	c.calls = nil
	return out
}

func summary(calls []uint32) string {
	count := map[string]int{}
	for _, p := range calls {
		name := procNames[p]
		if name == "" {
			name = fmt.Sprintf("proc-%d", p)
		}
		count[name]++
	}
	var parts []string
	for k, v := range count {
		parts = append(parts, fmt.Sprintf("%s×%d", k, v))
	}
	sort.Strings(parts)
	return strings.Join(parts, " ")
}

// TestIntegrationRPCCounts measures how many libvirt RPCs the operations
// make, by counting CALL packets on a proxy in front of libvirtd's socket,
// and bounds them generously (no timing assertions).
func TestIntegrationRPCCounts(t *testing.T) {
	e := newLifecycleEnv(t)
	cfg := e.cfg
	rc := newRPCCounter(t, cfg.LibvirtSocket)
	cfg.LibvirtSocket = rc.path
	p := openT(t, cfg, testr.New(t))
	ctx := ctxT(t)

	if _, err := p.Check(ctx); err != nil {
		t.Fatal(err)
	}
	checkCalls := rc.take()
	t.Logf("connect + Check: %d RPCs: %s", len(checkCalls), summary(checkCalls))

	cold := provider.Spec{Name: "cold", UID: "uid-cold"}
	start := time.Now()
	if _, err := p.Create(ctx, cold); err != nil {
		t.Fatal(err)
	}
	coldCalls := rc.take()
	t.Logf("cold-cache Create: %d RPCs in %v: %s", len(coldCalls), time.Since(start).Round(time.Millisecond), summary(coldCalls))

	hot := provider.Spec{Name: "hot", UID: "uid-hot"}
	start = time.Now()
	if _, err := p.Create(ctx, hot); err != nil {
		t.Fatal(err)
	}
	createDur := time.Since(start)
	hotCalls := rc.take()
	t.Logf("cache-hit Create→Provisioning: %d RPCs in %v: %s", len(hotCalls), createDur.Round(time.Millisecond), summary(hotCalls))

	start = time.Now()
	inst, err := p.Get(ctx, hot.Ref())
	if err != nil {
		t.Fatal(err)
	}
	getCalls := rc.take()
	t.Logf("Get (%s, no guest OS): %d RPCs in %v: %s", inst.State, len(getCalls), time.Since(start).Round(time.Millisecond), summary(getCalls))

	if _, err := p.List(ctx); err != nil {
		t.Fatal(err)
	}
	listCalls := rc.take()
	t.Logf("List of 2: %d RPCs: %s", len(listCalls), summary(listCalls))

	if err := p.Delete(ctx, hot.Ref()); err != nil {
		t.Fatal(err)
	}
	delCalls := rc.take()
	t.Logf("Delete: %d RPCs: %s", len(delCalls), summary(delCalls))

	// Generous bounds: a regression that multiplies round trips fails here.
	for _, b := range []struct {
		what  string
		calls []uint32
		max   int
	}{
		{"cache-hit Create", hotCalls, 30},
		{"Get", getCalls, 8},
		{"Delete", delCalls, 12},
	} {
		if len(b.calls) == 0 || len(b.calls) > b.max {
			t.Errorf("%s made %d RPCs, want 1..%d", b.what, len(b.calls), b.max)
		}
	}
}
