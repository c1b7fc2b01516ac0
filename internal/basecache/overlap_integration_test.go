//go:build integration

package basecache

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/digitalocean/go-libvirt"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/libvirtconn"
	"github.com/egressproxy/egressproxy/internal/testing/eventually"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// slowReader hands out its bytes 64 KiB at a time, pausing between reads,
// so a stream fed by it stays open long enough for another to overlap it;
// reading records that it has started.
type slowReader struct {
	r       *bytes.Reader
	started atomic.Bool
	done    atomic.Bool
}

func (s *slowReader) Read(p []byte) (int, error) {
	s.started.Store(true)
	time.Sleep(10 * time.Millisecond)
	n, err := s.r.Read(p[:min(len(p), 64<<10)])
	if errors.Is(err, io.EOF) {
		s.done.Store(true)
	}
	return n, err
}

// What overlapped verification rests on, on the real libvirtd: an upload
// of segment k+1 (StorageVolUpload at an offset) runs while another
// connection reads segment k back (StorageVolDownload at an offset with a
// length); the bytes read back are the bytes uploaded, the file on the
// host ends up exactly the image (an upload at an offset does not
// truncate), and what was read back equals what the host's file holds.
func TestStackSegmentsReadBackDuringUpload(t *testing.T) {
	env, lv, entry := stackEntry(t)
	c := newTestCache(t, SSH(lv), entry, env.Pool, nil)
	name := BaseName(entry, "seg", "raw")
	ctx := ctxT(t, 2*time.Minute)
	if err := c.createEmpty(ctx, name); err != nil {
		t.Fatal(err)
	}
	const seg = 8 << 20
	data := randBytes(3 * seg)
	up, err := lv.Dedicated(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer up.Close()
	down, err := lv.Dedicated(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer down.Close()
	vu, err := lookupVol(up.L, env.Pool, name)
	if err != nil {
		t.Fatal(err)
	}
	vd, err := lookupVol(down.L, env.Pool, name)
	if err != nil {
		t.Fatal(err)
	}
	if err := up.L.StorageVolUpload(vu, bytes.NewReader(data[:seg]), 0, 0, 0); err != nil {
		t.Fatalf("upload of segment 0: %v", err)
	}
	readBack := sha256.New()
	for k := 1; k <= 3; k++ {
		var src *slowReader
		upErr := make(chan error, 1)
		if k < 3 {
			src = &slowReader{r: bytes.NewReader(data[k*seg : (k+1)*seg])}
			go func() { upErr <- up.L.StorageVolUpload(vu, src, uint64(k*seg), 0, 0) }()
			eventually.True(t, 10*time.Second, src.started.Load, "the upload of segment %d reads", k)
		}
		var got bytes.Buffer
		if err := down.L.StorageVolDownload(vd, &got, uint64((k-1)*seg), seg, 0); err != nil {
			t.Fatalf("download of segment %d: %v", k-1, err)
		}
		if src != nil && src.done.Load() {
			t.Errorf("segment %d was uploaded before segment %d was read back: no overlap", k, k-1)
		}
		if !bytes.Equal(got.Bytes(), data[(k-1)*seg:k*seg]) {
			t.Fatalf("segment %d read back differs from what was uploaded (%d bytes)", k-1, got.Len())
		}
		readBack.Write(got.Bytes())
		if src != nil {
			if err := <-upErr; err != nil {
				t.Fatalf("upload of segment %d: %v", k, err)
			}
		}
	}
	want := sha256.Sum256(data)
	if got := readBack.Sum(nil); !bytes.Equal(got, want[:]) {
		t.Fatalf("read-back sha256 %x, uploaded %x", got, want)
	}
	var path string
	if err := lv.Do(ctx, func(l *libvirt.Libvirt) error {
		v, err := lookupVol(l, env.Pool, name)
		if err == nil {
			path, err = l.StorageVolGetPath(v)
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	onDisk := hashFile(t, path)
	if onDisk.size != int64(len(data)) || onDisk.sha256 != hex.EncodeToString(want[:]) {
		t.Fatalf("host file %s: %d bytes, sha256 %s; uploaded %d bytes, sha256 %x", path, onDisk.size, onDisk.sha256, len(data), want)
	}
	// A read past the end of the file returns what is there, no error.
	var tail bytes.Buffer
	if err := down.L.StorageVolDownload(vd, &tail, uint64(2*seg+seg/2), seg, 0); err != nil || tail.Len() != seg/2 {
		t.Fatalf("download past the end: %d bytes, %v; want %d, nil", tail.Len(), err, seg/2)
	}
	// An upload at an offset does not truncate what lies beyond it.
	if err := up.L.StorageVolUpload(vu, bytes.NewReader(data[:4096]), 0, 0, 0); err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(path); err != nil || st.Size() != int64(len(data)) {
		t.Fatalf("after a rewrite of the first 4 KiB the file is %v bytes (%v), want %d", st.Size(), err, len(data))
	}
}

// libvirt refuses to set up an upload while any stream on the volume is
// being set up (storageVolUpload checks in_use, which storageVolDownload
// holds during its setup): started at the same instant over and over, an
// upload sometimes fails with "still in use" (VIR_ERR_OPERATION_INVALID).
// The cache therefore starts a read-back only once the next upload has
// begun to stream, and retries an upload refused so before any byte.
// This test reports how often the race shows; it fails only on any other
// error.
func TestStackUploadSetupRacesDownloadSetup(t *testing.T) {
	env, lv, entry := stackEntry(t)
	c := newTestCache(t, SSH(lv), entry, env.Pool, nil)
	name := BaseName(entry, "race", "raw")
	ctx := ctxT(t, 2*time.Minute)
	if err := c.createEmpty(ctx, name); err != nil {
		t.Fatal(err)
	}
	data := randBytes(64 << 10)
	conns := make([]*libvirtconn.Dedicated, 2)
	vols := make([]libvirt.StorageVol, 2)
	for i := range conns {
		d, err := lv.Dedicated(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		conns[i] = d
		if vols[i], err = lookupVol(d.L, env.Pool, name); err != nil {
			t.Fatal(err)
		}
	}
	if err := conns[0].L.StorageVolUpload(vols[0], bytes.NewReader(data), 0, 0, 0); err != nil {
		t.Fatal(err)
	}
	inUse := 0
	rounds := 200
	if testing.Short() {
		rounds = 20 // the stress runs repeat it under load; the figure needs the full count
	}
	for range rounds {
		start := make(chan struct{})
		upErr := make(chan error, 1)
		go func() {
			<-start
			upErr <- conns[0].L.StorageVolUpload(vols[0], bytes.NewReader(data), uint64(len(data)), 0, 0)
		}()
		close(start)
		if err := conns[1].L.StorageVolDownload(vols[1], io.Discard, 0, uint64(len(data)), 0); err != nil {
			t.Fatalf("download: %v", err)
		}
		err := <-upErr
		switch {
		case err == nil:
		case isLibvirtErr(err, libvirt.ErrOperationInvalid) && strings.Contains(err.Error(), "in use"):
			inUse++
		default:
			t.Fatalf("upload: %v", err)
		}
	}
	t.Logf("%d of %d uploads started together with a download were refused as in use", inUse, rounds)
}

// A cold fetch in 16 MiB segments on the real stack: it succeeds with the
// image's digest; and when a byte of a middle segment changes in the
// host's file after libvirt wrote it (before that segment is committed for
// the read-back), the fetch fails Transient and leaves nothing behind.
func TestStackSegmentedFetchCatchesHostCorruption(t *testing.T) {
	env := teststack.Require(t)
	lv := link(t, env)
	img := makeQcow2(t, t.TempDir(), 64)
	srv := newImageServer(t, serveFile(img))
	const seg = 16 << 20
	t.Run("intact", func(t *testing.T) {
		entry := testEntry()
		cleanupEntry(t, lv, env.Pool, entry)
		c := newTestCache(t, SSH(lv), entry, env.Pool, nil)
		c.segment = seg
		b, err := c.Ensure(ctxT(t, 2*time.Minute), imagecache.Image{Key: "img", URL: srv.URL + "/i", SHA256: img.sha256})
		if err != nil || b.Digest != img.sha256 {
			t.Fatalf("Ensure = %+v, %v", b, err)
		}
		if got := hashFile(t, filepath.Join(env.PoolPath, b.Volume)); got.sha256 != img.sha256 || got.size != img.size {
			t.Fatalf("host file: %d bytes, sha256 %s; image %d bytes, %s", got.size, got.sha256, img.size, img.sha256)
		}
	})
	t.Run("byte changed on the host", func(t *testing.T) {
		entry := testEntry()
		cleanupEntry(t, lv, env.Pool, entry)
		im := imagecache.Image{Key: "img", URL: srv.URL + "/i", SHA256: img.sha256}
		path := filepath.Join(env.PoolPath, BaseName(entry, im.Key, "qcow2"))
		const at = seg + 100 // inside segment 1
		var once sync.Once
		var corrupted atomic.Bool
		var prev int64
		c := newTestCache(t, SSH(lv), entry, env.Pool, func(cfg *Config) {
			cfg.ProgressInterval = time.Millisecond
			cfg.Progress = func(p imagecache.Progress) {
				// Bytes up to prev were handed to libvirt by earlier reads
				// of segment 1; this read is still segment 1's, so the
				// segment is not committed for the read-back yet.
				sent := prev
				prev = p.Bytes
				if sent <= at || p.Bytes > 2*seg {
					return
				}
				once.Do(func() {
					eventually.Poll(context.Background(), 10*time.Second, func() bool {
						st, err := os.Stat(path)
						return err == nil && st.Size() > at
					})
					f, err := os.OpenFile(path, os.O_RDWR, 0)
					if err != nil {
						t.Errorf("open the staged volume: %v", err)
						return
					}
					defer f.Close()
					b := make([]byte, 1)
					if _, err := f.ReadAt(b, at); err != nil {
						t.Errorf("read: %v", err)
						return
					}
					b[0] ^= 0x40
					if _, err := f.WriteAt(b, at); err != nil {
						t.Errorf("write: %v", err)
						return
					}
					corrupted.Store(true)
				})
			}
		})
		c.segment = seg
		_, err := c.Ensure(ctxT(t, 2*time.Minute), im)
		if !corrupted.Load() {
			t.Fatalf("the byte was not changed; Ensure: %v", err)
		}
		wantCode(t, err, errs.Transient)
		if !strings.Contains(err.Error(), "the host stores") || !strings.Contains(err.Error(), "sha256 "+img.sha256+" were sent") {
			t.Fatalf("error %q does not say the stored bytes differ", err)
		}
		assertClean(t, lv, env.Pool, entry)
	})
}

// verifyStored checks that the volume's physical size is n and that the
// bytes libvirt reads back from the host hash to digest: the checks of a
// fetch, on a volume that is already there
// (TestStackVerifyStoredCatchesShortAndWrongBytes).
func (c *Cache) verifyStored(ctx context.Context, name string, n int64, digest string) (err error) {
	ctx, span := c.start(ctx, "imagecache.Verify", name)
	defer func() { endSpan(span, err) }()
	var back readResult
	back.n, back.digest, back.err = c.readBack(ctx, name)
	if errors.Is(back.err, errStalled) && ctx.Err() == nil {
		c.log.Info("the read-back stream made no progress; reading back once more on a fresh connection", "volume", name, "err", back.err.Error())
		back.n, back.digest, back.err = c.readBack(ctx, name)
	}
	return c.judgeStored(ctx, name, n, digest, func() (uint64, error) { return c.physicalHandle(ctx, name, nil) }, back)
}
