// Package ociimage builds the operator's container image without a
// container daemon: the statically linked command on an empty base, as an
// OCI image layout in one tar file (an "OCI archive"), the same bytes for
// the same source and toolchain.
package ociimage

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

const (
	// Entrypoint is the operator command's path in the image, and the
	// image's entrypoint.
	Entrypoint = "/egressproxy-operator"
	// User is the user and group the image runs as: not root (the
	// distroless images' "nonroot").
	User = "65532:65532"
	// Package is the operator command, relative to the module's root.
	Package = "./cmd/egressproxy-operator"
)

// epoch is every time stamp of the image: the layer's file, the config's
// creation time, the archive's entries. A time taken from the build would
// make every build a new image.
var epoch = time.Unix(0, 0).UTC()

// BuildBinary builds the operator command of the module in moduleDir into
// out: statically linked (CGO_ENABLED=0, so it runs on an empty base),
// without file system paths, VCS stamp or build ID in it (-trimpath,
// -buildvcs=false, -ldflags "-s -w -buildid="), for linux on this
// machine's architecture. The same source and toolchain give the same
// bytes. The end-to-end test runs the binary this builds.
func BuildBinary(ctx context.Context, moduleDir, out string) error {
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-buildvcs=false", "-ldflags=-s -w -buildid=", "-o", out, Package)
	cmd.Dir = moduleDir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+runtime.GOARCH)
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build %s: %v\n%s", Package, err, b)
	}
	return nil
}

// Image is the image of binary: one layer holding it at Entrypoint
// (mode 0755, owned by root, time stamp 1970), the entrypoint, the
// non-root User, OCI media types, linux on this machine's architecture.
func Image(binary []byte) (v1.Image, error) {
	var layerTar bytes.Buffer
	tw := tar.NewWriter(&layerTar)
	if err := tw.WriteHeader(&tar.Header{Name: strings.TrimPrefix(Entrypoint, "/"), Typeflag: tar.TypeReg, Mode: 0o755, Size: int64(len(binary)), ModTime: epoch, Format: tar.FormatUSTAR}); err != nil {
		return nil, err
	}
	if _, err := tw.Write(binary); err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	data := layerTar.Bytes()
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil },
		tarball.WithMediaType(types.OCILayer), tarball.WithCompressedCaching)
	if err != nil {
		return nil, err
	}
	base := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	img, err := mutate.Append(base, mutate.Addendum{Layer: layer, MediaType: types.OCILayer})
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", runtime.GOARCH
	cf.Created = v1.Time{Time: epoch}
	cf.Config.Entrypoint = []string{Entrypoint}
	cf.Config.User = User
	cf.Config.WorkingDir = "/"
	return mutate.ConfigFile(img, cf)
}

// WriteArchive writes img as an OCI image layout in one tar file (what
// skopeo calls oci-archive; docker load, podman load and
// kind load image-archive read it), named ref (name:tag): the layout's
// oci-layout and index.json, and the blobs of the manifest, the config and
// the layer. Entries are in a fixed order, with fixed owners, modes and
// times.
func WriteArchive(w io.Writer, img v1.Image, ref string) error {
	manifest, err := img.RawManifest()
	if err != nil {
		return err
	}
	digest, err := img.Digest()
	if err != nil {
		return err
	}
	config, err := img.RawConfigFile()
	if err != nil {
		return err
	}
	cfgName, err := img.ConfigName()
	if err != nil {
		return err
	}
	layers, err := img.Layers()
	if err != nil {
		return err
	}
	_, tag, _ := strings.Cut(ref[strings.LastIndex(ref, "/")+1:], ":")
	index, err := json.Marshal(v1.IndexManifest{
		SchemaVersion: 2,
		MediaType:     types.OCIImageIndex,
		Manifests: []v1.Descriptor{{
			MediaType: types.OCIManifestSchema1, Size: int64(len(manifest)), Digest: digest,
			Annotations: map[string]string{"org.opencontainers.image.ref.name": tag, "io.containerd.image.name": ref},
		}},
	})
	if err != nil {
		return err
	}
	tw := tar.NewWriter(w)
	dir := func(name string) error {
		return tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeDir, Mode: 0o755, ModTime: epoch, Format: tar.FormatUSTAR})
	}
	file := func(name string, size int64, body io.Reader) error {
		if err := tw.WriteHeader(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Size: size, ModTime: epoch, Format: tar.FormatUSTAR}); err != nil {
			return err
		}
		_, err := io.Copy(tw, body)
		return err
	}
	blob := func(h v1.Hash) string { return "blobs/" + h.Algorithm + "/" + h.Hex }
	if err := file("oci-layout", int64(len(`{"imageLayoutVersion":"1.0.0"}`)), strings.NewReader(`{"imageLayoutVersion":"1.0.0"}`)); err != nil {
		return err
	}
	if err := dir("blobs/"); err != nil {
		return err
	}
	if err := dir("blobs/sha256/"); err != nil {
		return err
	}
	for _, l := range layers {
		h, err := l.Digest()
		if err != nil {
			return err
		}
		size, err := l.Size()
		if err != nil {
			return err
		}
		rc, err := l.Compressed()
		if err != nil {
			return err
		}
		err = file(blob(h), size, rc)
		rc.Close()
		if err != nil {
			return err
		}
	}
	if err := file(blob(cfgName), int64(len(config)), bytes.NewReader(config)); err != nil {
		return err
	}
	if err := file(blob(digest), int64(len(manifest)), bytes.NewReader(manifest)); err != nil {
		return err
	}
	if err := file("index.json", int64(len(index)), bytes.NewReader(index)); err != nil {
		return err
	}
	return tw.Close()
}
