package teststack

import (
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
)

// TinyQCOW2 returns a small qcow2 image (32 MiB virtual, a few hundred KiB
// of bytes) made with qemu-img, for tests that need a base image but no
// guest that boots.
func TinyQCOW2(t testing.TB) []byte {
	t.Helper()
	return EmptyQCOW2(t, "32M")
}

// EmptyQCOW2 returns an empty qcow2 image of the given virtual size (a
// qemu-img size such as "48M"). Images of different sizes have different
// digests: a test that needs a cold fetch from its own mirror while another
// entry of the process holds TinyQCOW2 gives it another size, or the
// process's fan-out copies the base of the same digest from that peer.
func EmptyQCOW2(t testing.TB, size string) []byte {
	t.Helper()
	p := filepath.Join(t.TempDir(), "empty.qcow2")
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", p, size).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img create: %v: %s", err, out)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// ServeTinyImage serves TinyQCOW2 over HTTP on 127.0.0.1 until t ends and
// returns its URL and sha256. kvm2 fetches images in the caller's process
// (imagecache GETs the URL and uploads the bytes over SSH), so a server on
// the caller's loopback serves every host, the lab's included.
func ServeTinyImage(t testing.TB) (url, sum string) {
	t.Helper()
	img := TinyQCOW2(t)
	h := sha256.Sum256(img)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(img)))
		_, _ = w.Write(img)
	}))
	t.Cleanup(srv.Close)
	return srv.URL + "/tiny.qcow2", hex.EncodeToString(h[:])
}
