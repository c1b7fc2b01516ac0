package benchutil

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
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
