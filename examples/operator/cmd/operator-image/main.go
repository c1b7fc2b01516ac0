// Command operator-image builds the operator's container image without a
// container daemon (make operator-image runs it from the module's root):
// the command built statically and reproducibly, on an empty base, written
// as an OCI archive (an OCI image layout in one tar file). It prints the
// image's digest; the same source and toolchain give the same digest.
//
//	go run ./cmd/operator-image -o bin/egressproxy-operator.tar -ref egressproxy-operator:dev
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"

	"github.com/egressproxy/egressproxy/examples/operator/internal/ociimage"
)

func main() {
	out := flag.String("o", "bin/egressproxy-operator.tar", "the OCI archive to write")
	ref := flag.String("ref", "egressproxy-operator:dev", "the image's name and tag in the archive")
	flag.Parse()
	if flag.NArg() > 0 {
		fmt.Fprintln(os.Stderr, "operator-image: flags only; see -h")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	digest, err := build(ctx, *out, *ref)
	if err != nil {
		fmt.Fprintln(os.Stderr, "operator-image:", err)
		os.Exit(1)
	}
	fmt.Printf("%s %s %s\n", *out, *ref, digest)
}

// build builds the binary and the image and writes the archive to out
// (through a temporary file beside it, so out is whole or absent).
func build(ctx context.Context, out, ref string) (string, error) {
	tmp, err := os.MkdirTemp("", "operator-image-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	bin := filepath.Join(tmp, "egressproxy-operator")
	if err := ociimage.BuildBinary(ctx, ".", bin); err != nil {
		return "", err
	}
	binary, err := os.ReadFile(bin)
	if err != nil {
		return "", err
	}
	img, err := ociimage.Image(binary)
	if err != nil {
		return "", err
	}
	digest, err := img.Digest()
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return "", err
	}
	f, err := os.CreateTemp(filepath.Dir(out), ".operator-image-*")
	if err != nil {
		return "", err
	}
	defer os.Remove(f.Name())
	if err := ociimage.WriteArchive(f, img, ref); err != nil {
		f.Close()
		return "", err
	}
	if err := f.Close(); err != nil {
		return "", err
	}
	if err := os.Chmod(f.Name(), 0o644); err != nil {
		return "", err
	}
	return digest.String(), os.Rename(f.Name(), out)
}
