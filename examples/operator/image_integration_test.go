//go:build integration

package operator_test

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/egressproxy/egressproxy/examples/operator/internal/ociimage"
)

// TestOperatorImage runs make operator-image twice: the same digest and
// the same archive bytes. The archive is an OCI image layout whose blobs
// match their digests; the image's entrypoint is the operator command,
// statically linked and byte for byte the binary the end-to-end test runs
// (ociimage.BuildBinary), and its config runs as a non-root user.
func TestOperatorImage(t *testing.T) {
	if _, err := exec.LookPath("make"); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("make is not on PATH")
		}
		t.Skip("make is not on PATH")
	}
	dir := t.TempDir()
	const ref = "egressproxy-operator:test"
	var digests []string
	var archives [][]byte
	for _, name := range []string{"first.tar", "second.tar"} {
		out := filepath.Join(dir, name)
		cmd := exec.Command("make", "--no-print-directory", "-C", filepath.Join("..", ".."), "operator-image", "OPERATOR_IMAGE_TAR="+out, "OPERATOR_IMAGE="+ref)
		b, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("make operator-image: %v\n%s", err, b)
		}
		lines := strings.Split(strings.TrimSpace(string(b)), "\n")
		f := strings.Fields(lines[len(lines)-1])
		if len(f) != 3 || f[0] != out || f[1] != ref || !strings.HasPrefix(f[2], "sha256:") {
			t.Fatalf("make operator-image printed %q, want its archive, name and digest", lines[len(lines)-1])
		}
		digests = append(digests, f[2])
		data, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		archives = append(archives, data)
		t.Logf("%s: %s, %d bytes", name, f[2], len(data))
	}
	if digests[0] != digests[1] || !bytes.Equal(archives[0], archives[1]) {
		t.Fatalf("two builds differ: %s and %s (archives equal: %v)", digests[0], digests[1], bytes.Equal(archives[0], archives[1]))
	}

	files := untar(t, bytes.NewReader(archives[0]))
	blob := func(h v1.Hash) []byte {
		t.Helper()
		b, ok := files["blobs/"+h.Algorithm+"/"+h.Hex]
		if !ok {
			t.Fatalf("no blob %s", h)
		}
		if sum := sha256.Sum256(b); hex.EncodeToString(sum[:]) != h.Hex {
			t.Fatalf("blob %s holds other bytes", h)
		}
		return b
	}
	if string(files["oci-layout"]) != `{"imageLayoutVersion":"1.0.0"}` {
		t.Errorf("oci-layout: %q", files["oci-layout"])
	}
	var index v1.IndexManifest
	if err := json.Unmarshal(files["index.json"], &index); err != nil {
		t.Fatal(err)
	}
	if len(index.Manifests) != 1 || index.Manifests[0].Digest.String() != digests[0] || index.Manifests[0].Annotations["io.containerd.image.name"] != ref {
		t.Fatalf("index.json: %+v", index)
	}
	var manifest v1.Manifest
	if err := json.Unmarshal(blob(index.Manifests[0].Digest), &manifest); err != nil {
		t.Fatal(err)
	}
	var config v1.ConfigFile
	if err := json.Unmarshal(blob(manifest.Config.Digest), &config); err != nil {
		t.Fatal(err)
	}
	if strings.Join(config.Config.Entrypoint, " ") != ociimage.Entrypoint || config.OS != "linux" {
		t.Errorf("config: entrypoint %q, os %s", config.Config.Entrypoint, config.OS)
	}
	if user, _, _ := strings.Cut(config.Config.User, ":"); user == "" || user == "0" || user == "root" {
		t.Errorf("config: user %q, want a non-root uid", config.Config.User)
	}
	if len(manifest.Layers) != 1 {
		t.Fatalf("%d layers, want 1 (the binary on an empty base)", len(manifest.Layers))
	}
	zr, err := gzip.NewReader(bytes.NewReader(blob(manifest.Layers[0].Digest)))
	if err != nil {
		t.Fatal(err)
	}
	layer := untar(t, zr)
	binary, ok := layer[strings.TrimPrefix(ociimage.Entrypoint, "/")]
	if !ok || len(layer) != 1 {
		t.Fatalf("the layer holds %d files, want only %s", len(layer), ociimage.Entrypoint)
	}
	ef, err := elf.NewFile(bytes.NewReader(binary))
	if err != nil {
		t.Fatalf("the entrypoint is not an ELF file: %v", err)
	}
	for _, p := range ef.Progs {
		if p.Type == elf.PT_INTERP {
			t.Errorf("the entrypoint is dynamically linked: it cannot run on an empty base")
		}
	}
	// The end-to-end test's binary (from the build cache: no new compile).
	bin := filepath.Join(t.TempDir(), "egressproxy-operator")
	if err := ociimage.BuildBinary(context.Background(), ".", bin); err != nil {
		t.Fatal(err)
	}
	if e2e, err := os.ReadFile(bin); err != nil || !bytes.Equal(e2e, binary) {
		t.Errorf("the image's binary is not the one the end-to-end test runs (%v)", err)
	}
}

// untar reads a tar stream into a map of regular files; their modes are
// checked as the image needs them (executable entrypoint, root-owned).
func untar(t *testing.T, r io.Reader) map[string][]byte {
	t.Helper()
	out := map[string][]byte{}
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Typeflag != tar.TypeReg {
			continue
		}
		if h.Uid != 0 || h.Gid != 0 || (h.Name == strings.TrimPrefix(ociimage.Entrypoint, "/") && h.Mode != 0o755) {
			t.Errorf("%s: owner %d:%d mode %o", h.Name, h.Uid, h.Gid, h.Mode)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		out[h.Name] = b
	}
}
