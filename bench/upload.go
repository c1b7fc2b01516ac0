package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"time"

	"github.com/egressproxy/egressproxy/internal/benchutil"
	"github.com/egressproxy/egressproxy/internal/teststack"
)

// uploadResult holds the per-run figures of the upload phase, index i of
// every slice being round i.
type uploadResult struct {
	image                 benchutil.Image
	uri                   string
	libUpload, libVerify  []float64 // MB/s of the phases
	libWhole              []float64 // MB/s of the whole Ensure
	libFetchSpan          []float64 // seconds of imagecache.Fetch
	virsh, ssh            []float64 // MB/s
	rssKiB                []float64
	upVsVirsh, wholeVsSSH []float64 // per-round ratios
}

var maxRSS = regexp.MustCompile(`Maximum resident set size \(kbytes\): (\d+)`)

func runUpload(ctx context.Context, env teststack.Env, o options) (*uploadResult, error) {
	dir := filepath.Join(env.Dir, "bench")
	logf("upload: preparing the %d MiB image (cached in %s)", o.imageMiB, dir)
	img, err := benchutil.EnsureImage(ctx, dir, o.imageMiB)
	if err != nil {
		return nil, err
	}
	srv, err := benchutil.ServeFile(img.Path)
	if err != nil {
		return nil, err
	}
	defer srv.Close()
	wrapper, err := benchutil.SSHWrapper(env, dir)
	if err != nil {
		return nil, err
	}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat("/usr/bin/time"); err != nil {
		return nil, fmt.Errorf("/usr/bin/time is missing (apt-get install time): %w", err)
	}
	entry := fmt.Sprintf("bench%d", time.Now().Unix()%100000)
	res := &uploadResult{image: img, uri: benchutil.VirshURI(env, wrapper)}
	size := img.Size
	lib := func() error {
		cmd := exec.CommandContext(ctx, "/usr/bin/time", "-v", self, "-fetch-child", "-url", srv.URL, "-sha256", img.SHA256, "-entry", entry)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("library cold fetch: %w: %s", err, stderr.String())
		}
		var fr benchutil.FetchResult
		if err := json.Unmarshal(stdout.Bytes(), &fr); err != nil {
			return fmt.Errorf("library cold fetch output %q: %w", stdout.String(), err)
		}
		if fr.Bytes != size {
			return fmt.Errorf("library uploaded %d bytes, image has %d", fr.Bytes, size)
		}
		m := maxRSS.FindStringSubmatch(stderr.String())
		if m == nil {
			return fmt.Errorf("no maximum RSS in /usr/bin/time output: %s", stderr.String())
		}
		kib, _ := strconv.ParseFloat(m[1], 64)
		res.rssKiB = append(res.rssKiB, kib)
		res.libUpload = append(res.libUpload, benchutil.MBps(size, fr.Upload.Seconds()))
		res.libVerify = append(res.libVerify, benchutil.MBps(size, fr.Verify.Seconds()))
		res.libWhole = append(res.libWhole, benchutil.MBps(size, fr.Ensure.Seconds()))
		res.libFetchSpan = append(res.libFetchSpan, fr.Fetch.Seconds())
		logf("upload: library ensure %.2fs (upload %.2fs, verify %.2fs), max RSS %.0f KiB", fr.Ensure.Seconds(), fr.Upload.Seconds(), fr.Verify.Seconds(), kib)
		return nil
	}
	virsh := func() error {
		d, err := benchutil.VirshUpload(ctx, env, wrapper, img.Path, "bench-virsh-upload")
		if err != nil {
			return err
		}
		res.virsh = append(res.virsh, benchutil.MBps(size, d.Seconds()))
		logf("upload: virsh vol-upload %.2fs", d.Seconds())
		return nil
	}
	raw := func() error {
		d, err := benchutil.SSHCat(ctx, env, img.Path, filepath.Join(dir, "ssh-cat.out"))
		if err != nil {
			return err
		}
		res.ssh = append(res.ssh, benchutil.MBps(size, d.Seconds()))
		logf("upload: cat | ssh %.2fs", d.Seconds())
		return nil
	}
	steps := []func() error{lib, virsh, raw}
	for i := range o.runs {
		for j := range steps {
			if err := steps[(i+j)%len(steps)](); err != nil {
				return nil, err
			}
			if err := benchutil.Sync(ctx); err != nil {
				return nil, err
			}
		}
	}
	res.upVsVirsh = benchutil.Ratios(res.libUpload, res.virsh)
	res.wholeVsSSH = benchutil.Ratios(res.libWhole, res.ssh)
	return res, nil
}
