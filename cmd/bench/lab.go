package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/testing/benchutil"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
	"github.com/egressproxy/egressproxy/kvm2"
)

// labResult holds the lab phase: one labRate per -lab-rates entry.
type labResult struct {
	dir, script string
	hosts       int
	rates       []*labRate
	reused      bool // the lab was up before the bench (EGRESSPROXY_LAB_DIR)
}

// labRate is the figures at one link rate, index i of every slice being
// round i (interleaved).
type labRate struct {
	spec  labRateSpec
	image benchutil.Image
	// host 1's link: MB/s of each path
	libUpload, libVerify, libWhole []float64
	ssh, pipe, pipeUp, pipeDown    []float64
	wholeVsSSH, wholeVsPipe        []float64 // per-round ratios
	upVsSSH                        []float64
	rssKiB                         []float64
	libTx, libRx, sshTx            []float64 // link utilisation (0-1) over each run's wall time
	libSeconds                     []float64
	prof                           *cpuProfile
	// four concurrent cold fetches to four hosts in one process
	multiRSSKiB, multiWallS []float64
	multiHosts              int
	creates                 *createsResult
}

// createsResult: N hosts × per concurrent Creates of one cold image per
// host vs 1 host × per, interleaved.
type createsResult struct {
	hosts, per int
	one, many  []float64 // seconds
	manyVsOne  []float64 // per-round time ratios
	load       string    // load average just before the first run
	// Where the time goes, per run (index as one and many).
	runsOne, runsMany []createsRun
}

// createsRun is one run's figures: the machine's CPU over the run (0-1 of
// all its cores, /proc/stat: busy, and waiting for I/O), the bench
// process's own CPU seconds (the library: SSH cipher, hashing, libvirt
// RPC), and per host the seconds until its first Create returned (its cold
// fetch done, plus a few calls) and until its last did (its 5 guests
// started). A library that serialised hosts would finish them a fetch's
// time apart; independent hosts finish together.
type createsRun struct {
	busy, iowait, cpu float64
	first, last       []float64
}

// cpuSample is the machine's CPU time (/proc/stat, all cores: busy,
// waiting for I/O and total jiffies) and this process's (user + system
// seconds).
type cpuSample struct {
	busy, iowait, total uint64
	self                float64
}

func sampleCPU() cpuSample {
	var s cpuSample
	if b, err := os.ReadFile("/proc/stat"); err == nil {
		line, _, _ := strings.Cut(string(b), "\n")
		f := strings.Fields(line) // cpu user nice system idle iowait irq softirq steal ...
		for i, x := range f[1:] {
			var v uint64
			fmt.Sscan(x, &v)
			s.total += v
			switch i {
			case 3: // idle
			case 4:
				s.iowait += v
			default:
				s.busy += v
			}
		}
	}
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) == nil {
		s.self = time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
	}
	return s
}

// since returns the run's figures between s0 and s: the machine's busy
// and I/O-wait fractions and this process's CPU seconds.
func (s cpuSample) since(s0 cpuSample) createsRun {
	r := createsRun{cpu: s.self - s0.self}
	if t := float64(s.total - s0.total); t > 0 {
		r.busy = float64(s.busy-s0.busy) / t
		r.iowait = float64(s.iowait-s0.iowait) / t
	}
	return r
}

// lab drives scripts/lab.
type lab struct {
	script, dir string
}

func (l lab) run(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, l.script, args...)
	cmd.Env = append(os.Environ(), "EGRESSPROXY_LAB_DIR="+l.dir)
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("scripts/lab %s: %w: %s", strings.Join(args, " "), err, lastLines(errb.String(), 20))
	}
	return out.String(), nil
}

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, "\n")
}

// up (re)starts the lab with hosts at rate and returns its hosts.
func (l lab) up(ctx context.Context, hosts int, rate string) ([]labHost, error) {
	t0 := time.Now()
	if _, err := l.run(ctx, "up", "--hosts", fmt.Sprint(hosts), "--rate", rate, "--rtt", "0"); err != nil {
		return nil, err
	}
	out, err := l.run(ctx, "env")
	if err != nil {
		return nil, err
	}
	logf("lab: %d hosts at %s in %.0fs", hosts, rate, time.Since(t0).Seconds())
	return parseLabEnv(out, filepath.Join(l.dir, "bench"))
}

// runLab brings up its own lab of -lab-hosts hosts (under the stack dir,
// or the one EGRESSPROXY_LAB_DIR names if it is up), and at each rate of
// -lab-rates measures on host 1's link: the library's cold fetch, cat |
// ssh and the virsh pipeline, interleaved; then cold fetches to all hosts
// at once in one process; and, at -creates-rate, concurrent Creates on all
// hosts vs one. It stops the lab at the end unless -keep-lab or it was up
// before.
func runLab(ctx context.Context, env teststack.Env, o options) (*labResult, error) {
	specs, err := parseLabRates(o.labRates)
	if err != nil {
		return nil, err
	}
	if o.labHosts < 1 {
		return nil, errors.New("-lab-hosts must be ≥ 1")
	}
	l := lab{script: filepath.Join(filepath.Dir(env.Script), "lab"), dir: filepath.Join(env.Dir, "lab")}
	res := &labResult{hosts: o.labHosts, script: l.script}
	if d := os.Getenv("EGRESSPROXY_LAB_DIR"); d != "" {
		l.dir, res.reused = d, true
	}
	res.dir = l.dir
	if !o.keepLab && !res.reused {
		defer func() {
			if _, err := l.run(context.WithoutCancel(ctx), "down"); err != nil {
				logf("lab: %v", err)
			}
		}()
	}
	benchDir := filepath.Join(env.Dir, "bench")
	for _, sp := range specs {
		hosts, err := l.up(ctx, o.labHosts, sp.rate)
		if err != nil {
			return nil, err
		}
		lr, err := measureRate(ctx, o, sp, hosts, benchDir)
		if err != nil {
			return nil, fmt.Errorf("at %s: %w", sp.rate, err)
		}
		res.rates = append(res.rates, lr)
	}
	return res, nil
}

func measureRate(ctx context.Context, o options, sp labRateSpec, hosts []labHost, dir string) (*labRate, error) {
	img, err := benchutil.EnsureImage(ctx, dir, sp.imageMiB)
	if err != nil {
		return nil, err
	}
	srv, err := benchutil.ServeFile(img.Path)
	if err != nil {
		return nil, err
	}
	defer srv.Close()
	h := hosts[0]
	if err := os.MkdirAll(h.env.Dir, 0o755); err != nil {
		return nil, err
	}
	hw, err := benchutil.SSHWrapper(h.env, h.env.Dir)
	if err != nil {
		return nil, err
	}
	uri := benchutil.VirshURI(h.env, hw)
	lr := &labRate{spec: sp, image: img}
	size := img.Size
	util := func(bytes int64, s float64) float64 { return float64(bytes) * 8 / s / sp.bits }
	one, err := json.Marshal([]target{{Env: h.env, Entry: "benchlab1"}})
	if err != nil {
		return nil, err
	}
	round := 0
	lib := func() error {
		args := []string{"-targets", string(one)}
		prof := ""
		if round == o.labRuns-1 {
			prof = filepath.Join(dir, "lab-"+sp.rate+".cpu.pprof")
			args = append(args, "-cpuprofile", prof)
		}
		tx0, rx0 := linkBytes(h.link)
		run, err := runFetchChild(ctx, srv.URL, img, args...)
		if err != nil {
			return err
		}
		tx1, rx1 := linkBytes(h.link)
		fr := run.results[0]
		s := fr.Ensure.Seconds()
		lr.libUpload = append(lr.libUpload, benchutil.MBps(size, fr.Upload.Seconds()))
		lr.libVerify = append(lr.libVerify, benchutil.MBps(size, fr.Verify.Seconds()))
		lr.libWhole = append(lr.libWhole, benchutil.MBps(size, s))
		lr.libSeconds = append(lr.libSeconds, s)
		lr.rssKiB = append(lr.rssKiB, run.rssKiB)
		lr.libTx = append(lr.libTx, util(tx1-tx0, s))
		lr.libRx = append(lr.libRx, util(rx1-rx0, s))
		if prof != "" {
			if lr.prof, err = summariseProfile(ctx, prof); err != nil {
				logf("lab: %v", err)
			}
		}
		logf("lab %s: library ensure %.2fs (upload %.2fs, verify %.2fs), RSS %.0f KiB, link up %.0f%% down %.0f%%", sp.rate, s, fr.Upload.Seconds(), fr.Verify.Seconds(), run.rssKiB, 100*lr.libTx[len(lr.libTx)-1], 100*lr.libRx[len(lr.libRx)-1])
		return nil
	}
	raw := func() error {
		tx0, _ := linkBytes(h.link)
		d, err := benchutil.SSHCat(ctx, h.env, img.Path, filepath.Join(h.env.PoolPath, "..", "ssh-cat.out"))
		if err != nil {
			return err
		}
		tx1, _ := linkBytes(h.link)
		lr.ssh = append(lr.ssh, benchutil.MBps(size, d.Seconds()))
		lr.sshTx = append(lr.sshTx, util(tx1-tx0, d.Seconds()))
		logf("lab %s: cat | ssh %.2fs", sp.rate, d.Seconds())
		return nil
	}
	pipe := func() error {
		p, err := benchutil.VirshPipeline(ctx, uri, h.env.Pool, img.Path, "bench-virsh-pipe", img.SHA256)
		if err != nil {
			return err
		}
		lr.pipe = append(lr.pipe, benchutil.MBps(size, p.Whole().Seconds()))
		lr.pipeUp = append(lr.pipeUp, benchutil.MBps(size, p.Upload.Seconds()))
		lr.pipeDown = append(lr.pipeDown, benchutil.MBps(size, p.Download.Seconds()))
		logf("lab %s: virsh pipeline %.2fs (upload %.2fs, download+sha256 %.2fs)", sp.rate, p.Whole().Seconds(), p.Upload.Seconds(), p.Download.Seconds())
		return nil
	}
	steps := []func() error{lib, raw, pipe}
	var all []target
	for _, x := range hosts {
		if err := os.MkdirAll(x.env.Dir, 0o755); err != nil {
			return nil, err
		}
		all = append(all, target{Env: x.env, Entry: fmt.Sprintf("benchlabm%d", x.n)})
	}
	multi, err := json.Marshal(all)
	if err != nil {
		return nil, err
	}
	lr.multiHosts = len(all)
	rounds := o.labRuns
	if o.createsOnly {
		rounds = 0
	}
	for round = 0; round < rounds; round++ {
		for j := range steps {
			if err := steps[(round+j)%len(steps)](); err != nil {
				return nil, err
			}
			if err := benchutil.Sync(ctx); err != nil {
				return nil, err
			}
		}
		if len(all) > 1 {
			t0 := time.Now()
			run, err := runFetchChild(ctx, srv.URL, img, "-targets", string(multi))
			if err != nil {
				return nil, fmt.Errorf("%d concurrent fetches: %w", len(all), err)
			}
			lr.multiWallS = append(lr.multiWallS, time.Since(t0).Seconds())
			lr.multiRSSKiB = append(lr.multiRSSKiB, run.rssKiB)
			logf("lab %s: %d concurrent cold fetches in %.2fs, RSS %.0f KiB", sp.rate, len(all), time.Since(t0).Seconds(), run.rssKiB)
			if err := benchutil.Sync(ctx); err != nil {
				return nil, err
			}
		}
	}
	lr.wholeVsSSH = benchutil.Ratios(lr.libWhole, lr.ssh)
	lr.wholeVsPipe = benchutil.Ratios(lr.libWhole, lr.pipe)
	lr.upVsSSH = benchutil.Ratios(lr.libUpload, lr.ssh)
	if o.createsRate != "" && strings.EqualFold(o.createsRate, sp.rate) && len(hosts) > 1 {
		if lr.creates, err = measureCreates(ctx, o, hosts, srv.URL, img); err != nil {
			return nil, fmt.Errorf("concurrent Creates: %w", err)
		}
	}
	return lr, nil
}

const createsPer = 5

// measureCreates times createsPer concurrent Creates on host 1 alone vs on
// every host at once, each host's entry fresh (so its base is cold: one
// cold fetch of the image per host), interleaved over -lab-runs rounds.
func measureCreates(ctx context.Context, o options, hosts []labHost, url string, img benchutil.Image) (*createsResult, error) {
	res := &createsResult{hosts: len(hosts), per: createsPer, load: loadavg()}
	for i := range o.labRuns {
		order := []bool{false, true}
		if i%2 == 1 {
			order = []bool{true, false}
		}
		for _, many := range order {
			hs := hosts[:1]
			if many {
				hs = hosts
			}
			c0 := sampleCPU()
			d, first, last, err := createsOnce(ctx, hs, url, img, i, nil)
			if err != nil {
				return nil, err
			}
			run := sampleCPU().since(c0)
			run.first, run.last = first, last
			if many {
				res.many = append(res.many, d.Seconds())
				res.runsMany = append(res.runsMany, run)
			} else {
				res.one = append(res.one, d.Seconds())
				res.runsOne = append(res.runsOne, run)
			}
			logf("lab: %d host(s) × %d concurrent cold Creates in %.2fs (per host, first Create returned at %s s, last at %s s), machine CPU %.0f%% busy and %.0f%% waiting for I/O, this process %.1f CPU s",
				len(hs), createsPer, d.Seconds(), list(first, "%.1f"), list(last, "%.1f"), 100*run.busy, 100*run.iowait, run.cpu)
			if err := benchutil.Sync(ctx); err != nil {
				return nil, err
			}
		}
	}
	res.manyVsOne = benchutil.Ratios(res.many, res.one)
	return res, nil
}

// createsOnce opens a fresh entry on each host (cold base; kvm2 options
// opts, nil for none), starts createsPer Creates per host at once and
// returns the time until the last returned, and for each host the seconds
// until its first and its last returned; then deletes the instances and
// the entry's base (untimed).
func createsOnce(ctx context.Context, hosts []labHost, url string, img benchutil.Image, round int, opts *kvm2.Options) (time.Duration, []float64, []float64, error) {
	type entry struct {
		p     *egressproxy.Client
		name  string
		h     labHost
		specs []egressproxy.Spec
	}
	var es []*entry
	defer func() {
		for _, e := range es {
			cleanupEntry(context.WithoutCancel(ctx), e.h, e.p, e.name, e.specs)
		}
	}()
	for _, h := range hosts {
		name := fmt.Sprintf("bk%d%d%04x", h.n, round, rand.IntN(1<<16))
		p, err := kvm2.Open(ctx, kvm2.Config{
			Entry: name, Owner: "bench",
			Address: h.env.SSHAddr, User: h.env.SSHUser, KeyFile: h.env.SSHKey, KnownHostsFile: h.env.KnownHosts,
			LibvirtURI: h.env.LibvirtURI, LibvirtSocket: h.env.LibvirtSocket, Pool: h.env.Pool, Network: h.network,
			Images:       map[string]imagecache.Image{"big": {URL: url, SHA256: img.SHA256}},
			MachineTypes: map[string]kvm2.MachineType{"tiny": {VCPUs: 1, MemoryMiB: 64}},
			DomainType:   "qemu",
		}, opts)
		if err != nil {
			return 0, nil, nil, fmt.Errorf("open entry on host %d: %w", h.n, err)
		}
		e := &entry{p: p, name: name, h: h}
		for i := range createsPer {
			e.specs = append(e.specs, egressproxy.Spec{Name: fmt.Sprintf("c%d", i), UID: fmt.Sprintf("uid-%s-c%d", name, i)})
		}
		es = append(es, e)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var errs []error
	first, last := make([]float64, len(es)), make([]float64, len(es))
	start := time.Now()
	for i, e := range es {
		for _, s := range e.specs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, err := e.p.Create(ctx, s)
				mu.Lock()
				defer mu.Unlock()
				at := time.Since(start).Seconds()
				if first[i] == 0 {
					first[i] = at
				}
				last[i] = max(last[i], at)
				if err != nil {
					errs = append(errs, fmt.Errorf("host %d Create %s: %w", e.h.n, s.Name, err))
				}
			}()
		}
	}
	wg.Wait()
	return time.Since(start), first, last, errors.Join(errs...)
}

// cleanupEntry deletes the entry's instances, closes its provider and
// removes every volume of the entry (its base) from the host's pool.
func cleanupEntry(ctx context.Context, h labHost, p *egressproxy.Client, name string, specs []egressproxy.Spec) {
	var wg sync.WaitGroup
	for _, s := range specs {
		wg.Add(1)
		go func() { defer wg.Done(); _ = p.Delete(ctx, s.Ref()) }()
	}
	wg.Wait()
	_ = p.Close()
	lv, _, closeLink, err := benchutil.Link(h.env, "")
	if err != nil {
		return
	}
	defer closeLink()
	_ = lv.Do(ctx, func(l *libvirt.Libvirt) error {
		return benchutil.DeleteVolumes(l, h.env.Pool, func(v string) bool { return strings.Contains(v, name) })
	})
}
