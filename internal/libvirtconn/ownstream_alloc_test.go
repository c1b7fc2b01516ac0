package libvirtconn

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"io"
	"net"
	"runtime"
	"testing"

	"github.com/digitalocean/go-libvirt"
	"github.com/digitalocean/go-libvirt/socket"
)

// pipeLibvirtd is a minimal libvirtd on the far end of a net.Pipe for the
// allocation tests: it answers AuthList and ConnectOpen (so that go-libvirt
// can connect), a download with a reply, packets data packets of size
// bytes and the end of file, and an upload with a reply, consuming the data
// and confirming the finish. It allocates nothing per packet.
type pipeLibvirtd struct {
	conn          net.Conn
	packets, size int
	uploaded      int64
}

func (p *pipeLibvirtd) serve() {
	r := bufio.NewReaderSize(p.conn, 64<<10)
	body := make([]byte, 64<<10)
	data := make([]byte, headerLen+p.size)
	var hdr [headerLen]byte
	answer := func(typ, status uint32, payload []byte) bool {
		out := make([]byte, headerLen+len(payload))
		copy(out, hdr[:])
		binary.BigEndian.PutUint32(out[0:], uint32(len(out)))
		binary.BigEndian.PutUint32(out[16:], typ)
		binary.BigEndian.PutUint32(out[24:], status)
		copy(out[headerLen:], payload)
		_, err := p.conn.Write(out)
		return err == nil
	}
	for {
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return
		}
		n := int(binary.BigEndian.Uint32(hdr[0:4])) - headerLen
		for n > 0 {
			k, err := r.Read(body[:min(n, len(body))])
			if err != nil {
				return
			}
			n -= k
		}
		proc := binary.BigEndian.Uint32(hdr[12:16])
		typ := binary.BigEndian.Uint32(hdr[16:20])
		status := binary.BigEndian.Uint32(hdr[24:28])
		switch {
		case typ == socket.Call && proc == procAuthList:
			if !answer(socket.Reply, socket.StatusOK, make([]byte, 4)) {
				return
			}
		case typ == socket.Call && proc == procStorageVolDownload:
			if !answer(socket.Reply, socket.StatusOK, nil) {
				return
			}
			copy(data, hdr[:])
			binary.BigEndian.PutUint32(data[0:], uint32(len(data)))
			binary.BigEndian.PutUint32(data[16:], socket.Stream)
			binary.BigEndian.PutUint32(data[24:], socket.StatusContinue)
			for range p.packets {
				if _, err := p.conn.Write(data); err != nil {
					return
				}
			}
			if !answer(socket.Stream, socket.StatusContinue, nil) {
				return
			}
		case typ == socket.Call:
			if !answer(socket.Reply, socket.StatusOK, nil) {
				return
			}
		case typ == socket.Stream && status == socket.StatusContinue:
			p.uploaded += int64(binary.BigEndian.Uint32(hdr[0:4])) - headerLen
		case typ == socket.Stream:
			if !answer(socket.Stream, socket.StatusOK, nil) {
				return
			}
		}
	}
}

// allocated returns the bytes the process allocated while fn ran.
func allocated(fn func()) uint64 {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	fn()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

// streamPair is a guard over one end of a net.Pipe with a pipeLibvirtd on
// the other, a reader loop standing in for go-libvirt's (or go-libvirt
// itself, connected, when withGoLibvirt).
func streamPair(t *testing.T, packets, size int, withGoLibvirt bool) (*streamGuard, *libvirt.Libvirt, *pipeLibvirtd) {
	t.Helper()
	client, server := net.Pipe()
	srv := &pipeLibvirtd{conn: server, packets: packets, size: size}
	done := make(chan struct{})
	go func() { defer close(done); srv.serve() }()
	g := newStreamGuard(client)
	var lv *libvirt.Libvirt
	if withGoLibvirt {
		lv = libvirt.NewWithDialer(&onceDialer{conn: g})
		if err := lv.ConnectToURI(libvirt.ConnectURI("test:///default")); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = lv.Disconnect() })
	} else {
		go func() { _, _ = io.Copy(io.Discard, struct{ io.Reader }{g}) }()
	}
	t.Cleanup(func() { client.Close(); server.Close(); <-done })
	return g, lv, srv
}

// TestOwnStreamAllocations pins what the own stream calls allocate: no
// buffer per packet (a download is hashed out of the guard's read buffer;
// an upload reuses the connection's packet buffer), so the bytes allocated do
// not grow with the bytes moved. go-libvirt's calls on the same pipe are
// measured beside them: they allocate every byte downloaded again, and 4
// MiB per upload call. If go-libvirt no longer does, its half says so.
func TestOwnStreamAllocations(t *testing.T) {
	const packets, size = 64, 256 << 10 // 16 MiB each way
	const mib = packets * size >> 20
	img := bytes.Repeat([]byte("0123456789abcdef"), packets*size/16)
	args := volStreamArgs(testVol, 0, 0, 0)

	t.Run("own", func(t *testing.T) {
		g, _, srv := streamPair(t, packets, size, false)
		h := sha256.New()
		if err := g.ownDownload(procStorageVolDownload, args, h); err != nil { // warm-up
			t.Fatal(err)
		}
		if err := g.ownUpload(procStorageVolUpload, args, bytes.NewReader(img)); err != nil {
			t.Fatal(err)
		}
		h.Reset()
		var err error
		down := allocated(func() { err = g.ownDownload(procStorageVolDownload, args, h) })
		if err != nil {
			t.Fatal(err)
		}
		want := bytes.Repeat([]byte{0}, size)
		wantSum := sha256.New()
		for range packets {
			wantSum.Write(want)
		}
		if !bytes.Equal(h.Sum(nil), wantSum.Sum(nil)) {
			t.Fatal("the download's bytes differ from what the server sent")
		}
		srv.uploaded = 0
		up := allocated(func() { err = g.ownUpload(procStorageVolUpload, args, bytes.NewReader(img)) })
		if err != nil {
			t.Fatal(err)
		}
		if srv.uploaded != int64(len(img)) {
			t.Fatalf("server received %d bytes, want %d", srv.uploaded, len(img))
		}
		t.Logf("own calls: download %d B (%d B/MiB), upload %d B (%d B/MiB) for %d MiB", down, down/mib, up, up/mib, mib)
		// A few small allocations per call (its packet, the events), none
		// per packet.
		if down > 64<<10 {
			t.Errorf("own download of %d MiB allocated %d bytes, want < 64 KiB", mib, down)
		}
		if up > 64<<10 {
			t.Errorf("own upload of %d MiB allocated %d bytes, want < 64 KiB", mib, up)
		}
	})

	t.Run("go-libvirt", func(t *testing.T) {
		_, lv, _ := streamPair(t, packets, size, true)
		var err error
		down := allocated(func() { err = lv.StorageVolDownload(testVol, io.Discard, 0, 0, 0) })
		if err != nil {
			t.Fatal(err)
		}
		up := allocated(func() { err = lv.StorageVolUpload(testVol, bytes.NewReader(img), 0, 0, 0) })
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("go-libvirt: download %d B (%d B/MiB), upload %d B for %d MiB", down, down/mib, up, mib)
		if down < packets*size || up < 4<<20 {
			t.Errorf("go-libvirt allocated %d bytes downloading and %d uploading %d MiB: it no longer allocates a buffer per packet and per upload call; are the own stream calls still needed (ownstream.go)?", down, up, mib)
		}
	})
}
