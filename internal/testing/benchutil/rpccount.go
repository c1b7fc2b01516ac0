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
	"time"
)

// procNames names the libvirt remote procedures kvm2 and imagecache use
// (numbers from libvirt's remote_protocol.x).
var procNames = map[uint32]string{
	1: "ConnectOpen", 2: "ConnectClose", 9: "DomainCreate", 12: "DomainDestroy", 14: "DomainGetXMLDesc",
	23: "DomainLookupByName", 59: "ConnectGetHostname", 60: "ConnectSupportsFeature", 66: "AuthList",
	83: "StoragePoolRefresh", 84: "StoragePoolLookupByName", 87: "StoragePoolGetInfo",
	93: "StorageVolCreateXML", 94: "StorageVolDelete", 95: "StorageVolLookupByName", 98: "StorageVolGetInfo",
	99: "StorageVolGetXMLDesc", 100: "StorageVolGetPath", 157: "ConnectGetLibVersion", 208: "StorageVolUpload", 378: "StorageVolGetInfoFlags",
	209: "StorageVolDownload", 212: "DomainGetState", 231: "DomainUndefineFlags", 273: "ConnectListAllDomains",
	282: "StoragePoolListAllVolumes", 344: "ConnectGetAllDomainStats", 350: "DomainDefineXMLFlags", 353: "DomainInterfaceAddresses",
	383: "StorageVolGetInfoFlags",
}

// RPCCounter is a unix socket proxy in front of libvirtd's socket that
// counts the RPC calls (packets of type CALL) its clients send. Point a
// client's libvirt socket path at Path (sshd runs on the same machine, so
// a remote client reaches it through its SSH channel). Arm makes it act at
// one RPC boundary, to interrupt a client there.
type RPCCounter struct {
	ln   net.Listener
	path string
	dir  string

	mu    sync.Mutex
	calls []uint32
	sent  []Event // each CALL and each client stream finish, when it passed (Rounds, Timeline)
	conns []net.Conn
	wg    sync.WaitGroup

	armed *Interrupt // acts on a call seen from now on; nil: none
	seen  int        // CALL packets seen since Arm
}

// Interrupt makes the proxy act at one RPC boundary: just before a call
// reaches libvirtd, or just after libvirtd answered it and before the
// answer reaches the client. Tests use it to interrupt an operation (cancel
// its context, close its client, kill its link) at every RPC boundary.
type Interrupt struct {
	// Call is the 1-based index, among the CALL packets the proxy sees
	// after Arm (on any of its connections), of the call to act at.
	Call int
	// AfterReply false: act before the call is forwarded (it reaches
	// libvirtd only after Act returned, if it is not cut). True: forward
	// the call, hold libvirtd's first answer to it (REPLY or STREAM packet
	// with its serial) and act before passing that answer on.
	AfterReply bool
	// Act runs in the proxy at that moment; the held packet and all the
	// traffic behind it in that direction wait for it. cut true: the
	// proxy closes both sides of that connection and drops the held
	// packet instead of passing it on.
	Act func(proc uint32) (cut bool)
}

// Arm sets the interrupt (replacing any earlier one) and restarts the call
// count from zero. It acts once.
func (c *RPCCounter) Arm(in Interrupt) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.armed = &in
	c.seen = 0
}

// Disarm removes an interrupt that has not acted yet.
func (c *RPCCounter) Disarm() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.armed = nil
}

// proxied is one client connection and its libvirtd connection.
type proxied struct {
	in, out net.Conn
	mu      sync.Mutex
	held    map[uint32]*Interrupt // serial → interrupt acting on its answer
}

func (x *proxied) cut() { x.in.Close(); x.out.Close() }

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
			x := &proxied{in: in, out: out, held: map[uint32]*Interrupt{}}
			c.wg.Add(2)
			go func() { defer c.wg.Done(); c.answers(x); in.Close() }()
			go func() { defer c.wg.Done(); c.scan(x); out.Close() }()
		}
	}()
	return c, nil
}

// Path is the socket to connect to instead of libvirtd's.
func (c *RPCCounter) Path() string { return c.path }

// header is the fixed part of every libvirt RPC packet: length, program,
// version, procedure, type, serial, status (7 big-endian uint32).
const header = 28

// Packet types (virNetMessageType).
const (
	typeCall   = 0
	typeReply  = 1
	typeStream = 3
)

// scan copies client→server packets, records each CALL's procedure and
// applies an armed Interrupt.
func (c *RPCCounter) scan(x *proxied) {
	hdr := make([]byte, header)
	for {
		if _, err := io.ReadFull(x.in, hdr); err != nil {
			return
		}
		n := binary.BigEndian.Uint32(hdr[0:4])
		proc := binary.BigEndian.Uint32(hdr[12:16])
		typ := binary.BigEndian.Uint32(hdr[16:20])
		serial := binary.BigEndian.Uint32(hdr[20:24])
		var fire *Interrupt
		if typ == typeStream && n == header && binary.BigEndian.Uint32(hdr[24:28]) == 0 {
			// The client's end of an upload stream: it waits for
			// libvirtd's answer, a round trip like a call's.
			c.mu.Lock()
			c.sent = append(c.sent, Event{At: time.Now(), Name: procName(proc) + " end"})
			c.mu.Unlock()
		}
		if typ == typeCall {
			c.mu.Lock()
			c.calls = append(c.calls, proc)
			c.sent = append(c.sent, Event{At: time.Now(), Name: procName(proc)})
			if c.armed != nil {
				c.seen++
				if c.seen == c.armed.Call {
					fire, c.armed = c.armed, nil
				}
			}
			c.mu.Unlock()
		}
		if fire != nil && !fire.AfterReply {
			if fire.Act(proc) {
				x.cut()
				return
			}
		}
		if fire != nil && fire.AfterReply {
			x.mu.Lock()
			x.held[serial] = fire
			x.mu.Unlock()
		}
		if _, err := x.out.Write(hdr); err != nil {
			return
		}
		if n > header {
			if _, err := io.CopyN(x.out, x.in, int64(n-header)); err != nil {
				return
			}
		}
	}
}

// answers copies server→client packets, holding an answer an Interrupt
// waits for until it acted.
func (c *RPCCounter) answers(x *proxied) {
	hdr := make([]byte, header)
	for {
		if _, err := io.ReadFull(x.out, hdr); err != nil {
			return
		}
		n := binary.BigEndian.Uint32(hdr[0:4])
		proc := binary.BigEndian.Uint32(hdr[12:16])
		typ := binary.BigEndian.Uint32(hdr[16:20])
		serial := binary.BigEndian.Uint32(hdr[20:24])
		if typ == typeReply || typ == typeStream {
			x.mu.Lock()
			fire := x.held[serial]
			delete(x.held, serial)
			x.mu.Unlock()
			if fire != nil && fire.Act(proc) {
				x.cut()
				return
			}
		}
		if _, err := x.in.Write(hdr); err != nil {
			return
		}
		if n > header {
			if _, err := io.CopyN(x.in, x.out, int64(n-header)); err != nil {
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
	c.calls, c.sent = nil, nil
	return out
}

// Rounds returns the round trips on the critical path of the calls seen
// since the last Take, for a client whose link adds a round-trip time well
// above gap (e.g. through a delay proxy, with gap half its RTT): the calls
// (and upload stream ends) that passed more than gap after the one before.
// Calls issued together (concurrently) pass within microseconds of each
// other and count once; each call that had to wait for an answer counts.
func (c *RPCCounter) Rounds(gap time.Duration) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for i, e := range c.sent {
		if i == 0 || e.At.Sub(c.sent[i-1].At) > gap {
			n++
		}
	}
	return n
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

// Event is a call (or the client's end of an upload stream, Name with
// " end") that passed the counter, and when.
type Event struct {
	At   time.Time
	Name string
}

// Timeline returns the calls and upload stream ends seen since the last
// Take, in the order they passed, with a mark before each that starts a
// new round trip by Rounds' rule (more than gap after the one before):
// "+12ms Name" starts a round, "  +0ms Name" was issued together with the
// one before. For logs: it shows which calls are on the critical path.
func (c *RPCCounter) Timeline(gap time.Duration) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var b strings.Builder
	for i, e := range c.sent {
		d, mark := time.Duration(0), "*"
		if i > 0 {
			d = e.At.Sub(c.sent[i-1].At)
			if d <= gap {
				mark = " "
			}
		}
		fmt.Fprintf(&b, "%s+%dms %s; ", mark, d.Milliseconds(), e.Name)
	}
	return strings.TrimSuffix(b.String(), "; ")
}

func procName(p uint32) string {
	if name := procNames[p]; name != "" {
		return name
	}
	return fmt.Sprintf("proc-%d", p)
}

// Summary renders calls as "Name×count" sorted by name.
func Summary(calls []uint32) string {
	count := map[string]int{}
	for _, p := range calls {
		count[procName(p)]++
	}
	var parts []string
	for k, v := range count {
		parts = append(parts, fmt.Sprintf("%s×%d", k, v))
	}
	sort.Strings(parts)
	return strings.Join(parts, " ")
}
