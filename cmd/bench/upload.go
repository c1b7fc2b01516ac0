package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"time"

	"github.com/egressproxy/egressproxy/internal/testing/benchutil"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
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
	upVsVirsh, wholeVsSSH []float64   // per-round ratios
	prof                  *cpuProfile // of the last library run
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
	if _, err := os.Stat("/usr/bin/time"); err != nil {
		return nil, fmt.Errorf("/usr/bin/time is missing (apt-get install time): %w", err)
	}
	entry := fmt.Sprintf("bench%d", time.Now().Unix()%100000)
	res := &uploadResult{image: img, uri: benchutil.VirshURI(env, wrapper)}
	size := img.Size
	round := 0
	lib := func() error {
		args := []string{"-entry", entry}
		prof := ""
		if round == o.runs-1 {
			prof = filepath.Join(dir, "loopback.cpu.pprof")
			args = append(args, "-cpuprofile", prof)
		}
		run, err := runFetchChild(ctx, srv.URL, img, args...)
		if err != nil {
			return err
		}
		fr, kib := run.results[0], run.rssKiB
		res.rssKiB = append(res.rssKiB, kib)
		res.libUpload = append(res.libUpload, benchutil.MBps(size, fr.Upload.Seconds()))
		res.libVerify = append(res.libVerify, benchutil.MBps(size, fr.Verify.Seconds()))
		res.libWhole = append(res.libWhole, benchutil.MBps(size, fr.Ensure.Seconds()))
		res.libFetchSpan = append(res.libFetchSpan, fr.Fetch.Seconds())
		if prof != "" {
			if res.prof, err = summariseProfile(ctx, prof); err != nil {
				logf("upload: %v", err)
			}
		}
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
	for round = 0; round < o.runs; round++ {
		for j := range steps {
			if err := steps[(round+j)%len(steps)](); err != nil {
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
