package benchutil

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// Image is a qcow2 file on local disk with its size and digest.
type Image struct {
	Path   string
	Size   int64
	SHA256 string
}

// EnsureImage returns a qcow2 image of about mib MiB in dir, generating it
// once (a raw file of pseudo-random bytes from a fixed ChaCha8 seed, so it
// does not compress, converted with `qemu-img convert -O qcow2`) and reusing
// it afterwards (its digest is cached next to it).
func EnsureImage(ctx context.Context, dir string, mib int) (Image, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return Image{}, err
	}
	path := filepath.Join(dir, fmt.Sprintf("bench-%dm.qcow2", mib))
	sumFile := path + ".sha256"
	if b, err := os.ReadFile(sumFile); err == nil {
		if fi, err := os.Stat(path); err == nil {
			return Image{Path: path, Size: fi.Size(), SHA256: strings.TrimSpace(string(b))}, nil
		}
	}
	raw := path + ".raw"
	defer os.Remove(raw)
	f, err := os.Create(raw)
	if err != nil {
		return Image{}, err
	}
	w := bufio.NewWriterSize(f, 1<<20)
	var seed [32]byte
	copy(seed[:], "egressproxy benchmark image seed")
	if _, err := io.CopyN(w, rand.NewChaCha8(seed), int64(mib)<<20); err != nil {
		f.Close()
		return Image{}, err
	}
	if err := w.Flush(); err != nil {
		f.Close()
		return Image{}, err
	}
	if err := f.Close(); err != nil {
		return Image{}, err
	}
	tmp := path + ".tmp"
	if out, err := exec.CommandContext(ctx, "qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", raw, tmp).CombinedOutput(); err != nil {
		return Image{}, fmt.Errorf("qemu-img convert: %w: %s", err, out)
	}
	sum, size, err := hashFile(tmp)
	if err != nil {
		return Image{}, err
	}
	if err := os.Rename(tmp, path); err != nil {
		return Image{}, err
	}
	if err := os.WriteFile(sumFile, []byte(sum+"\n"), 0o644); err != nil {
		return Image{}, err
	}
	return Image{Path: path, Size: size, SHA256: sum}, nil
}

func hashFile(path string) (string, int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return "", 0, err
	}
	return hex.EncodeToString(h.Sum(nil)), n, nil
}

// FileServer serves one file over HTTP on loopback (with Content-Length).
type FileServer struct {
	URL string
	srv *http.Server
	ln  net.Listener
	end chan struct{}
}

// ServeFile starts a FileServer for path at URL http://127.0.0.1:PORT/<base name>.
func ServeFile(path string) (*FileServer, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	name := "/" + filepath.Base(path)
	mux := http.NewServeMux()
	mux.HandleFunc(name, func(w http.ResponseWriter, r *http.Request) { http.ServeFile(w, r, path) })
	s := &FileServer{URL: "http://" + ln.Addr().String() + name, srv: &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}, ln: ln, end: make(chan struct{})}
	go func() {
		defer close(s.end)
		_ = s.srv.Serve(ln)
	}()
	return s, nil
}

// Close stops the server and waits for it.
func (s *FileServer) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := s.srv.Shutdown(ctx)
	if err != nil {
		_ = s.srv.Close()
	}
	<-s.end
	return err
}
