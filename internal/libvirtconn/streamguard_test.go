package libvirtconn

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/internal/testing/sshtest"
)

// Shapes of stream traffic libvirtd really sends that deadlock go-libvirt's
// router or corrupt a download without the stream guard.
var guardShapes = []struct {
	name    string
	pkts    []fakePacket
	want    string // bytes the download must deliver
	wantErr string // or the error it must return
}{
	{"reply first", defaultDownload, "0123456789", ""},
	{"data before the reply", []fakePacket{data("01234"), reply(), data("56789"), eof()}, "0123456789", ""},
	{"two data packets before the reply", []fakePacket{data("012"), data("34"), reply(), data("56789"), eof()}, "0123456789", ""},
	{"a packet after end of file", []fakePacket{reply(), data("01234"), data("56789"), eof(), streamOK(), eof()}, "0123456789", ""},
	{"error, then more packets", []fakePacket{reply(), data("01234"), streamErr("disk full"), streamErr("again"), streamOK()}, "", "disk full"},
	{"error reply, then stream packets", []fakePacket{{typ: 1, status: 1, payload: xdrError("no such volume")}, data("x"), eof()}, "", "no such volume"},
}

// download runs one StorageVolDownload of shape pkts on a dedicated
// connection and then one more call on the same connection (a router stuck
// in go-libvirt would block it). It reports what arrived, bounded by bound.
func download(t testing.TB, l *Session, lvd *fakeLibvirtd, pkts []fakePacket, bound time.Duration) (got string, dlErr error, err error) {
	lvd.download.Store(&pkts)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d, err := l.Dedicated(ctx)
	if err != nil {
		return "", nil, err
	}
	defer d.Close()
	type res struct {
		got string
		err error
	}
	done := make(chan res, 1)
	go func() {
		var buf bytes.Buffer
		err := d.L.StorageVolDownload(libvirt.StorageVol{Pool: "p", Name: "v"}, &buf, 0, 0, 0)
		done <- res{buf.String(), err}
	}()
	var r res
	select {
	case r = <-done:
	case <-time.After(bound):
		d.Kill() // ends the call if the connection alone is stuck
		return "", nil, fmt.Errorf("StorageVolDownload did not return in %v", bound)
	}
	hn := make(chan error, 1)
	go func() { _, err := d.L.ConnectGetHostname(); hn <- err }()
	select {
	case err := <-hn:
		if err != nil {
			return r.got, r.err, fmt.Errorf("next call on the connection: %w", err)
		}
	case <-time.After(bound):
		d.Kill()
		return r.got, r.err, fmt.Errorf("next call on the connection did not return in %v (router stuck)", bound)
	}
	return r.got, r.err, nil
}

func TestStreamGuard(t *testing.T) {
	f := sshtest.NewFixture(t)
	lvd := startLibvirtd(t, "h")
	_, l := newSession(t, f, lvd, nil, nil)
	for _, tc := range guardShapes {
		t.Run(tc.name, func(t *testing.T) {
			for range 20 { // the races are timing-dependent without the guard
				got, dlErr, err := download(t, l, lvd, tc.pkts, 5*time.Second)
				if err != nil {
					t.Fatal(err)
				}
				if tc.wantErr != "" {
					if dlErr == nil || !strings.Contains(dlErr.Error(), tc.wantErr) {
						t.Fatalf("download error %v, want %q", dlErr, tc.wantErr)
					}
					continue
				}
				if dlErr != nil || got != tc.want {
					t.Fatalf("download %q, %v; want %q", got, dlErr, tc.want)
				}
			}
		})
	}
}

// TestUpstreamStreamDeadlockReproducer is the reproducer of the go-libvirt
// defect described in docs/upstream.md: the same shapes with go-libvirt on
// the bare channel (no guard), in a child process because the deadlocked
// goroutines never end. Each shape the guard exists for must fail there:
// hang (router stuck) or deliver wrong data. If this test fails, the pinned
// go-libvirt no longer has the defect: update docs/upstream.md.
func TestUpstreamStreamDeadlockReproducer(t *testing.T) {
	if shape := os.Getenv("LIBVIRTCONN_UNGUARDED_SHAPE"); shape != "" {
		unguardedChild(t, shape)
		return
	}
	t.Parallel()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range guardShapes {
		if tc.name == "reply first" {
			continue
		}
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel() // each shape is its own child process
			cmd := exec.Command(exe, "-test.run=^TestUpstreamStreamDeadlockReproducer$", "-test.v")
			cmd.Env = append(os.Environ(), "LIBVIRTCONN_UNGUARDED_SHAPE="+tc.name)
			out, _ := cmd.CombinedOutput()
			var verdict string
			for _, line := range strings.Split(string(out), "\n") {
				if i := strings.Index(line, "UNGUARDED: "); i >= 0 {
					verdict = line[i+len("UNGUARDED: "):]
				}
			}
			t.Logf("without the guard: %s", verdict)
			if verdict == "" {
				t.Fatalf("child printed no verdict:\n%s", out)
			}
			if strings.HasPrefix(verdict, "ok") {
				t.Errorf("go-libvirt handled %q without the guard; update docs/upstream.md", tc.name)
			}
		})
	}
}

// unguardedChild runs one shape up to 50 times without the guard and prints
// the first failure (a hang or wrong result), then exits at once, leaving
// the deadlocked goroutines behind.
func unguardedChild(t *testing.T, shape string) {
	f := sshtest.NewFixture(t)
	lvd := startLibvirtd(t, "h")
	_, l := newSession(t, f, lvd, nil, &Options{bareChannel: true})
	for _, tc := range guardShapes {
		if tc.name != shape {
			continue
		}
		for i := 1; i <= 50; i++ {
			got, dlErr, err := download(t, l, lvd, tc.pkts, time.Second)
			switch {
			case err != nil:
				fmt.Printf("UNGUARDED: try %d: %v\n", i, err)
			case tc.wantErr == "" && (dlErr != nil || got != tc.want):
				fmt.Printf("UNGUARDED: try %d: download returned %q, %v; want %q\n", i, got, dlErr, tc.want)
			default:
				continue
			}
			os.Exit(0)
		}
		fmt.Printf("UNGUARDED: ok in 50 tries\n")
		os.Exit(0)
	}
	fmt.Printf("UNGUARDED: no shape %q\n", shape)
	os.Exit(0)
}
