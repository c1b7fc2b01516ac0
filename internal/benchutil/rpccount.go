package benchutil

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
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
	383: "StorageVolGetInfoFlags",
}

// RPCCounter is a unix socket proxy in front of libvirtd's socket that
// counts the RPC calls (packets of type CALL) its clients send. Point a
// client's libvirt socket path at Path (sshd runs on the same machine, so
// a remote client reaches it through its SSH channel).
type RPCCounter struct {
	ln   net.Listener
	path string
	dir  string

	mu    sync.Mutex
	calls []uint32
	conns []net.Conn
	wg    sync.WaitGroup
}

// NewRPCCounter listens on a fresh socket in a new directory under dir and
// forwards every connection to target.
func NewRPCCounter(dir, target string) (*RPCCounter, error) {
	d, err := os.MkdirTemp(dir, "rpccount-")
	if err != nil {
		return nil, err
	}
	path := filepath.Join(d, "count.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		os.RemoveAll(d)
		return nil, err
	}
	c := &RPCCounter{ln: ln, path: path, dir: d}
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
			c.mu.Lock()
			c.conns = append(c.conns, in, out)
			c.mu.Unlock()
			c.wg.Add(2)
			go func() { defer c.wg.Done(); _, _ = io.Copy(in, out); in.Close() }()
			go func() { defer c.wg.Done(); c.scan(in, out); out.Close() }()
		}
	}()
	return c, nil
}

// Path is the socket to connect to instead of libvirtd's.
func (c *RPCCounter) Path() string { return c.path }

// scan copies client→server packets and records each CALL's procedure.
func (c *RPCCounter) scan(in io.Reader, out io.Writer) {
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

// Take returns and resets the calls seen so far.
func (c *RPCCounter) Take() []uint32 {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := c.calls
	c.calls = nil
	return out
}

// Close stops the proxy, closes its connections and waits for its
// goroutines.
func (c *RPCCounter) Close() error {
	err := c.ln.Close()
	c.mu.Lock()
	for _, x := range c.conns {
		x.Close()
	}
	c.mu.Unlock()
	c.wg.Wait()
	os.RemoveAll(c.dir)
	return err
}

// Summary renders calls as "Name×count" sorted by name.
func Summary(calls []uint32) string {
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
