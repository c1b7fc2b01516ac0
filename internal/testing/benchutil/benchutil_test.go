package benchutil

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestMedian(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   []float64
		want float64
	}{
		{"none", nil, 0},
		{"one", []float64{3}, 3},
		{"odd unsorted", []float64{5, 1, 3}, 3},
		{"even", []float64{4, 1, 3, 2}, 2.5},
		{"outlier", []float64{1, 1, 1, 1, 100}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := append([]float64(nil), tc.in...)
			if got := Median(tc.in); got != tc.want {
				t.Errorf("Median(%v) = %v, want %v", tc.in, got, tc.want)
			}
			for i := range in {
				if in[i] != tc.in[i] {
					t.Fatalf("Median reordered its input: %v", tc.in)
				}
			}
		})
	}
}

func TestRatios(t *testing.T) {
	for _, tc := range []struct {
		name string
		a, b []float64
		want []float64
	}{
		{"paired", []float64{2, 6}, []float64{1, 3}, []float64{2, 2}},
		{"zero skipped", []float64{2, 6}, []float64{0, 3}, []float64{2}},
		{"shorter b", []float64{2, 6, 9}, []float64{1}, []float64{2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := Ratios(tc.a, tc.b)
			if len(got) != len(tc.want) {
				t.Fatalf("Ratios = %v, want %v", got, tc.want)
			}
			for i := range got {
				if got[i] != tc.want[i] {
					t.Fatalf("Ratios = %v, want %v", got, tc.want)
				}
			}
		})
	}
}

func TestMBps(t *testing.T) {
	if got := MBps(3e6, 1.5); got != 2 {
		t.Errorf("MBps = %v, want 2", got)
	}
	if got := MBps(1, 0); got != 0 {
		t.Errorf("MBps with no time = %v, want 0", got)
	}
}

// TestRPCCounter sends two CALL packets and one REPLY-typed packet through
// the counter to an echo server and checks what it counted and forwarded.
func TestRPCCounter(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "target.sock")
	ln, err := net.Listen("unix", target)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		_, _ = io.Copy(c, c)
		c.Close()
	}()
	t.Cleanup(func() { ln.Close(); <-done })
	rc, err := NewRPCCounter(dir, target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rc.Close() })
	c, err := net.Dial("unix", rc.Path())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	packet := func(proc, typ uint32, body int) []byte {
		b := make([]byte, 28+body)
		binary.BigEndian.PutUint32(b[0:4], uint32(len(b)))
		binary.BigEndian.PutUint32(b[12:16], proc)
		binary.BigEndian.PutUint32(b[16:20], typ)
		return b
	}
	var sent []byte
	for _, p := range [][]byte{packet(23, 0, 5), packet(14, 0, 0), packet(99, 1, 3)} {
		sent = append(sent, p...)
	}
	if _, err := c.Write(sent); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	back := make([]byte, len(sent))
	if _, err := io.ReadFull(c, back); err != nil {
		t.Fatalf("echo through the counter: %v", err)
	}
	calls := rc.Take()
	if got, want := Summary(calls), "DomainGetXMLDesc×1 DomainLookupByName×1"; got != want {
		t.Errorf("counted %q, want %q", got, want)
	}
	if again := rc.Take(); len(again) != 0 {
		t.Errorf("Take did not reset: %v", again)
	}
}

func TestServeFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "img.qcow2")
	if err := os.WriteFile(p, []byte("0123456789"), 0o644); err != nil {
		t.Fatal(err)
	}
	s, err := ServeFile(p)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for _, tc := range []struct {
		name, url string
		status    int
		length    int64
	}{
		{"the file", s.URL, 200, 10},
		{"another path", s.URL + "x", 404, -2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := &http.Transport{}
			defer tr.CloseIdleConnections()
			req, _ := http.NewRequestWithContext(context.Background(), http.MethodGet, tc.url, nil)
			resp, err := tr.RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			_, _ = io.Copy(io.Discard, resp.Body)
			if resp.StatusCode != tc.status || (tc.length >= 0 && resp.ContentLength != tc.length) {
				t.Errorf("GET %s: %d, length %d; want %d, %d", tc.url, resp.StatusCode, resp.ContentLength, tc.status, tc.length)
			}
		})
	}
}

// replyServer answers every CALL packet with a REPLY of the same procedure
// and serial, and records the serials it received.
func replyServer(t *testing.T, path string) (received func() []uint32) {
	t.Helper()
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu   sync.Mutex
		got  []uint32
		done = make(chan struct{})
	)
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		hdr := make([]byte, 28)
		for {
			if _, err := io.ReadFull(c, hdr); err != nil {
				return
			}
			mu.Lock()
			got = append(got, binary.BigEndian.Uint32(hdr[20:24]))
			mu.Unlock()
			binary.BigEndian.PutUint32(hdr[16:20], 1) // REPLY
			if _, err := c.Write(hdr); err != nil {
				return
			}
		}
	}()
	t.Cleanup(func() { ln.Close(); <-done })
	return func() []uint32 {
		mu.Lock()
		defer mu.Unlock()
		return append([]uint32(nil), got...)
	}
}

func callPacket(proc, serial uint32) []byte {
	b := make([]byte, 28)
	binary.BigEndian.PutUint32(b[0:4], 28)
	binary.BigEndian.PutUint32(b[12:16], proc)
	binary.BigEndian.PutUint32(b[20:24], serial)
	return b
}

// TestRPCCounterInterrupt: an armed Interrupt acts once, at the call it
// names, before the call is forwarded or after its answer arrived and
// before the answer is passed on; a cut closes the connection and drops the
// held packet.
func TestRPCCounterInterrupt(t *testing.T) {
	for _, tc := range []struct {
		name         string
		after, cut   bool
		wantReceived []uint32 // serials libvirtd got
		wantReplies  int      // answers the client got
	}{
		{"before", false, false, []uint32{1, 2, 3}, 3},
		{"before cut", false, true, []uint32{1}, 1},
		{"after", true, false, []uint32{1, 2, 3}, 3},
		{"after cut", true, true, []uint32{1, 2}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			target := filepath.Join(dir, "target.sock")
			received := replyServer(t, target)
			rc, err := NewRPCCounter(dir, target)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { rc.Close() })
			c, err := net.Dial("unix", rc.Path())
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(20 * time.Second))
			hdr := make([]byte, 28)

			// One call before arming does not count.
			if _, err := c.Write(callPacket(23, 1)); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(c, hdr); err != nil {
				t.Fatal(err)
			}
			acted := make(chan uint32, 2)
			release := make(chan struct{})
			rc.Arm(Interrupt{Call: 1, AfterReply: tc.after, Act: func(proc uint32) bool {
				acted <- proc
				<-release
				return tc.cut
			}})
			if _, err := c.Write(callPacket(14, 2)); err != nil {
				t.Fatal(err)
			}
			if p := <-acted; p != 14 {
				t.Errorf("acted at procedure %d, want 14", p)
			}
			// While Act runs, the held packet has not moved on.
			if tc.after {
				if got := received(); len(got) != 2 {
					t.Errorf("libvirtd got serials %v while the answer is held, want [1 2]", got)
				}
			} else if got := received(); len(got) != 1 {
				t.Errorf("libvirtd got serials %v before the call was released, want [1]", got)
			}
			close(release)
			replies := 1
			if _, err := io.ReadFull(c, hdr); err == nil {
				replies++
				if s := binary.BigEndian.Uint32(hdr[20:24]); s != 2 {
					t.Errorf("answer serial %d, want 2", s)
				}
				// The interrupt acts once: a third call passes.
				if _, err := c.Write(callPacket(212, 3)); err != nil {
					t.Fatal(err)
				}
				if _, err := io.ReadFull(c, hdr); err != nil {
					t.Fatal(err)
				}
				replies++
			}
			if replies != tc.wantReplies {
				t.Errorf("client got %d answers, want %d", replies, tc.wantReplies)
			}
			if len(acted) != 0 {
				t.Error("the interrupt acted twice")
			}
			rc.Close()
			if got := received(); !slices.Equal(got, tc.wantReceived) {
				t.Errorf("libvirtd got serials %v, want %v", got, tc.wantReceived)
			}
		})
	}
}
