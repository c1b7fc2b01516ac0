package libvirtconn

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/internal/testing/sshtest"
)

var testVol = libvirt.StorageVol{Pool: "pool-a", Name: "base-x.qcow2", Key: "/pool/a/base-x.qcow2"}

func dedicated(t *testing.T, l *Session) *Dedicated {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d, err := l.Dedicated(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	return d
}

// TestOwnStreamCallsMatchGoLibvirt: the own calls put on the wire the
// same CALL as go-libvirt (program, version, procedure, type, status and
// XDR arguments; only the serial differs).
func TestOwnStreamCallsMatchGoLibvirt(t *testing.T) {
	f := sshtest.NewFixture(t)
	lvd := startLibvirtd(t, "h")
	_, l := newSession(t, f, lvd, nil, nil)
	d := dedicated(t, l)
	for _, tc := range []struct {
		name       string
		proc       uint32
		goLibvirt  func() error
		own        func() error
		offset, ln uint64
	}{
		{"upload", procStorageVolUpload,
			func() error { return d.L.StorageVolUpload(testVol, strings.NewReader("abc"), 1<<33+5, 7, 0) },
			func() error { return d.StorageVolUpload(testVol, strings.NewReader("abc"), 1<<33+5, 7, 0) }, 0, 0},
		{"download", procStorageVolDownload,
			func() error { return d.L.StorageVolDownload(testVol, io.Discard, 3, 1<<32+9, 0) },
			func() error { return d.StorageVolDownload(testVol, io.Discard, 3, 1<<32+9, 0) }, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.goLibvirt(); err != nil {
				t.Fatalf("go-libvirt: %v", err)
			}
			want := lvd.lastCall(tc.proc)
			if err := tc.own(); err != nil {
				t.Fatalf("own: %v", err)
			}
			got := lvd.lastCall(tc.proc)
			if int32(binary.BigEndian.Uint32(got[20:24])) < ownSerialBase {
				t.Errorf("own call has serial %d, want ≥ %d", int32(binary.BigEndian.Uint32(got[20:24])), ownSerialBase)
			}
			copy(got[20:24], want[20:24]) // the serial differs
			if !bytes.Equal(got, want) {
				t.Errorf("own CALL\n%x\ngo-libvirt's\n%x", got, want)
			}
		})
	}
}

// TestOwnDownloadShapes: the own download handles every packet order
// libvirtd sends that the stream guard exists for (data before the reply,
// packets after the end, errors), and the connection serves go-libvirt's
// calls afterwards.
func TestOwnDownloadShapes(t *testing.T) {
	f := sshtest.NewFixture(t)
	lvd := startLibvirtd(t, "h")
	_, l := newSession(t, f, lvd, nil, nil)
	for _, tc := range guardShapes {
		t.Run(tc.name, func(t *testing.T) {
			lvd.download.Store(&tc.pkts)
			d := dedicated(t, l)
			for range 10 {
				var buf bytes.Buffer
				err := d.StorageVolDownload(testVol, &buf, 0, 0, 0)
				if tc.wantErr != "" {
					var le libvirt.Error
					if !errors.As(err, &le) || !strings.Contains(err.Error(), tc.wantErr) {
						t.Fatalf("download error %v, want a libvirt.Error %q", err, tc.wantErr)
					}
				} else if err != nil || buf.String() != tc.want {
					t.Fatalf("download %q, %v; want %q", buf.String(), err, tc.want)
				}
				if h, err := d.L.ConnectGetHostname(); err != nil || h != "h" {
					t.Fatalf("go-libvirt call after the download: %q, %v", h, err)
				}
			}
		})
	}
}

// gatedReader serves data, then blocks at gate bytes until released (or
// closed), then serves the rest.
type gatedReader struct {
	r       io.Reader
	left    int64 // bytes before the gate
	reached chan struct{}
	release chan struct{}
	once    sync.Once
	err     error // returned at the gate instead of blocking, if set
}

func (g *gatedReader) Read(p []byte) (int, error) {
	if g.left == 0 {
		g.once.Do(func() { close(g.reached) })
		if g.err != nil {
			return 0, g.err
		}
		<-g.release
		g.left = -1
	}
	if g.left > 0 && int64(len(p)) > g.left {
		p = p[:g.left]
	}
	n, err := g.r.Read(p)
	if g.left > 0 {
		g.left -= int64(n)
	}
	return n, err
}

func randomBytes(n int) []byte {
	b := make([]byte, n)
	r := rand.NewChaCha8([32]byte{1})
	_, _ = r.Read(b)
	return b
}

// TestOwnUpload: what arrives is what was sent, even while go-libvirt
// calls run on the same connection (their frames and the upload's never
// interleave), and each way an upload ends is reported as go-libvirt's
// StorageVolUpload reports it.
func TestOwnUpload(t *testing.T) {
	f := sshtest.NewFixture(t)
	lvd := startLibvirtd(t, "h")
	_, l := newSession(t, f, lvd, nil, nil)
	img := randomBytes(3<<20 + 12345)
	u := uploadEnv{l: l, lvd: lvd, img: img, sum: sha256.Sum256(img)}
	for _, tc := range []struct {
		name string
		run  func(*testing.T, uploadEnv)
	}{
		{"ok beside go-libvirt calls", uploadBesideCalls},
		{"call refused", uploadCallRefused},
		{"stream fails while the source blocks", uploadStreamFails},
		{"source fails", uploadSourceFails},
		{"finish fails", uploadFinishFails},
		{"link killed while the source blocks", uploadLinkKilled},
		{"download after kill", downloadAfterKill},
	} {
		t.Run(tc.name, func(t *testing.T) { tc.run(t, u) })
	}
}

// uploadEnv is TestOwnUpload's session, fake libvirtd and image.
type uploadEnv struct {
	l   *Session
	lvd *fakeLibvirtd
	img []byte
	sum [sha256.Size]byte
}

// uploadBesideCalls: an upload arrives whole while go-libvirt calls run beside it.
func uploadBesideCalls(t *testing.T, u uploadEnv) {
	u.lvd.upload.Store(nil)
	d := dedicated(t, u.l)
	stop := make(chan struct{})
	var calls atomic.Int64
	var wg sync.WaitGroup
	for range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if h, err := d.L.ConnectGetHostname(); err != nil || h != "h" {
					t.Errorf("go-libvirt call during the upload: %q, %v", h, err)
					return
				}
				calls.Add(1)
			}
		}()
	}
	before := len(u.lvd.uploads())
	// A reader that returns little at a time, so that many packets
	// go out between go-libvirt's calls.
	err := d.StorageVolUpload(testVol, io.LimitReader(&smallReads{r: bytes.NewReader(u.img)}, int64(len(u.img))), 0, 0, 0)
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatal(err)
	}
	ups := u.lvd.uploads()[before:]
	if len(ups) != 1 || ups[0].n != int64(len(u.img)) || ups[0].sum != u.sum || ups[0].aborted {
		t.Fatalf("libvirtd saw %+v, want one upload of %d bytes with the image's digest", ups, len(u.img))
	}
	if calls.Load() == 0 {
		t.Error("no go-libvirt call ran during the upload")
	}
}

// uploadCallRefused: a refused call is libvirtd's error, and the source is not read.
func uploadCallRefused(t *testing.T, u uploadEnv) {
	u.lvd.upload.Store(&uploadScript{callErr: "volume 'x' is still in use"})
	d := dedicated(t, u.l)
	read := false
	err := d.StorageVolUpload(testVol, readFunc(func([]byte) (int, error) { read = true; return 0, io.EOF }), 0, 0, 0)
	var le libvirt.Error
	if !errors.As(err, &le) || !strings.Contains(le.Message, "still in use") {
		t.Fatalf("error %v, want the libvirt.Error of the refusal", err)
	}
	if read {
		t.Error("the source was read although the call was refused")
	}
}

// uploadStreamFails: libvirtd failing the stream ends the call while the source blocks.
func uploadStreamFails(t *testing.T, u uploadEnv) {
	u.lvd.upload.Store(&uploadScript{failAfter: 1 << 20, failMsg: "cannot write: No space left on device"})
	d := dedicated(t, u.l)
	// The source blocks once it gave the 1 MiB after which the
	// stream fails.
	src := &gatedReader{r: bytes.NewReader(u.img), left: 1 << 20, reached: make(chan struct{}), release: make(chan struct{})}
	done := make(chan error, 1)
	go func() { done <- d.StorageVolUpload(testVol, src, 0, 0, 0) }()
	var err error
	select {
	case err = <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the upload did not return when libvirtd failed the stream")
	}
	if !strings.Contains(errString(err), "No space left") {
		t.Fatalf("error %v, want libvirtd's", err)
	}
	// The sender may still be in the source's Read; Close waits for
	// it once the source is released.
	close(src.release)
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
}

// uploadSourceFails: a failing source aborts the stream and is the call's error.
func uploadSourceFails(t *testing.T, u uploadEnv) {
	u.lvd.upload.Store(nil)
	d := dedicated(t, u.l)
	boom := errors.New("body ended early")
	src := &gatedReader{r: bytes.NewReader(u.img), left: 1 << 20, reached: make(chan struct{}), err: boom}
	before := len(u.lvd.uploads())
	err := d.StorageVolUpload(testVol, src, 0, 0, 0)
	if !errors.Is(err, boom) {
		t.Fatalf("error %v, want the source's", err)
	}
	ups := u.lvd.uploads()[before:]
	if len(ups) != 1 || !ups[0].aborted || ups[0].n != 1<<20 {
		t.Fatalf("libvirtd saw %+v, want an aborted upload of 1 MiB", ups)
	}
}

// uploadFinishFails: a refused finish is the call's error; the connection stays usable.
func uploadFinishFails(t *testing.T, u uploadEnv) {
	u.lvd.upload.Store(&uploadScript{finishErr: "unable to close: No space left on device"})
	d := dedicated(t, u.l)
	err := d.StorageVolUpload(testVol, bytes.NewReader(u.img), 0, 0, 0)
	if !strings.Contains(errString(err), "unable to close") {
		t.Fatalf("error %v, want the finish's", err)
	}
	if _, err := d.L.ConnectGetHostname(); err != nil {
		t.Fatalf("go-libvirt call after the upload: %v", err)
	}
}

// uploadLinkKilled: Kill ends an upload whose source blocks.
func uploadLinkKilled(t *testing.T, u uploadEnv) {
	u.lvd.upload.Store(nil)
	d := dedicated(t, u.l)
	src := &gatedReader{r: bytes.NewReader(u.img), left: 1 << 20, reached: make(chan struct{}), release: make(chan struct{})}
	done := make(chan error, 1)
	go func() { done <- d.StorageVolUpload(testVol, src, 0, 0, 0) }()
	<-src.reached
	d.Kill()
	select {
	case err := <-done:
		if !errors.Is(err, libvirt.ErrInterrupted) {
			t.Fatalf("error %v, want libvirt.ErrInterrupted", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the upload did not return when its link was killed")
	}
	close(src.release)
	_ = d.Close()
}

// downloadAfterKill: a download on a killed connection fails.
func downloadAfterKill(t *testing.T, u uploadEnv) {
	d := dedicated(t, u.l)
	d.Kill()
	err := d.StorageVolDownload(testVol, io.Discard, 0, 0, 0)
	if err == nil {
		t.Fatal("download on a killed connection succeeded")
	}
}

type readFunc func([]byte) (int, error)

func (f readFunc) Read(p []byte) (int, error) { return f(p) }

// smallReads returns at most 4000 bytes per Read.
type smallReads struct{ r io.Reader }

func (s *smallReads) Read(p []byte) (int, error) {
	if len(p) > 4000 {
		p = p[:4000]
	}
	return s.r.Read(p)
}

func errString(err error) string {
	if err == nil {
		return "<nil>"
	}
	return err.Error()
}
