package libvirtconn

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"io"
	"net"
	"runtime"
	"testing"

	"github.com/digitalocean/go-libvirt/socket"
)

// guardPacket frames one libvirt packet of the download procedure.
func guardPacket(typ, serial, status uint32, body []byte) []byte {
	p := make([]byte, headerLen+len(body))
	binary.BigEndian.PutUint32(p[0:], uint32(len(p)))
	binary.BigEndian.PutUint32(p[4:], remoteProgram)
	binary.BigEndian.PutUint32(p[8:], 1)
	binary.BigEndian.PutUint32(p[12:], procStorageVolDownload)
	binary.BigEndian.PutUint32(p[16:], typ)
	binary.BigEndian.PutUint32(p[20:], serial)
	binary.BigEndian.PutUint32(p[24:], status)
	copy(p[headerLen:], body)
	return p
}

// TestStreamGuardPassesDataWithoutBuffering: the data packets of a
// download whose reply has been passed on go from the channel to
// go-libvirt's reader without a buffer per packet (a 1 GiB read-back used
// to allocate 1 GiB, 256 KiB a packet, for the guard alone), and arrive
// byte for byte, framing included.
func TestStreamGuardPassesDataWithoutBuffering(t *testing.T) {
	const packets, size = 64, 256 << 10 // 16 MiB of data
	body := bytes.Repeat([]byte("0123456789abcdef"), size/16)
	dataPkt := guardPacket(socket.Stream, 7, socket.StatusContinue, body)
	var want bytes.Buffer
	want.Write(guardPacket(socket.Reply, 7, socket.StatusOK, nil))
	for range packets {
		want.Write(dataPkt)
	}
	want.Write(guardPacket(socket.Stream, 7, socket.StatusContinue, nil)) // end of file
	wantSum := sha256.Sum256(want.Bytes())

	client, server := net.Pipe()
	defer client.Close()
	go func() {
		defer server.Close()
		server.Write(want.Bytes())
	}()
	g := newStreamGuard(client)
	h := sha256.New()
	buf := make([]byte, 64<<10)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	n, err := io.CopyBuffer(h, struct{ io.Reader }{g}, buf)
	runtime.ReadMemStats(&after)
	if err != nil && err != io.ErrUnexpectedEOF && err != io.EOF {
		t.Fatalf("read through the guard: %v", err)
	}
	if n != int64(want.Len()) || !bytes.Equal(h.Sum(nil), wantSum[:]) {
		t.Fatalf("read %d bytes (digest %x), want %d (%x)", n, h.Sum(nil), want.Len(), wantSum)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 1<<20 {
		t.Errorf("the guard allocated %d bytes passing %d MiB of data packets, want < 1 MiB", alloc, packets*size>>20)
	}
	if g.heldPackets.Load() != 0 || g.droppedPackets.Load() != 0 {
		t.Errorf("held %d, dropped %d packets, want none", g.heldPackets.Load(), g.droppedPackets.Load())
	}
}
