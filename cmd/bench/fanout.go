package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/basecache"
	"github.com/egressproxy/egressproxy/internal/testing/benchutil"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

// The fanout phase: the lab's mirror (scripts/lab
// mirror) in a namespace of its own behind a -fanout-mirror-rate link,
// -fanout-hosts hosts behind -fanout-rate links (plus one more, the late
// joiner), one cold image of -fanout-mib MiB. Each round, interleaved:
// one host's cold fetch from the mirror alone; the same image needed by
// every host at once in one process sharing a basecache.Fanout; then,
// in a fresh process, one more host going cold while the others hold
// the image (the peer path). The first round also measures today's
// behaviour: every host downloading on its own (no Fanout). Bytes served
// come from the mirror's own count (labmirror's /.stats), cross-checked
// with the mirror link's byte counter; peak RSS from /usr/bin/time.

// Targets of the fanout phase (the issue's).
const (
	targetFanoutBytes = 1.05 // mirror bytes / image, N hosts at once
	targetFanoutWall  = 1.2  // wall of N hosts / one host's cold fetch
	targetFanoutRSS   = 64.0 // MiB, the N-host fan-out process
)

// fanoutResult is the fanout phase's figures; index i of each slice is
// round i.
type fanoutResult struct {
	hosts, mib            int
	rate, mirrorRate      string
	image                 benchutil.Image
	one, many, late       []float64 // seconds: one host alone, all hosts at once, the late joiner
	oneBytes, manyBytes   []float64 // bytes served by the mirror
	lateBytes             []float64
	manyLinkBytes         []float64 // bytes the mirror's link carried to the caller
	manyRSSKiB, oneRSSKiB []float64
	manyHeapMiB           []float64 // largest heap allocated, sampled
	manyLiveMiB           []float64 // largest live heap a GC left
	lateRSSKiB            []float64
	manyVsOne             []float64 // per-round wall ratios
	manySources           []string  // of the last round, sorted
	lateSource            []string  // per round
	today                 *fanoutRun
	todayWallVsOne        float64
	load                  string
	grow                  *growResult // nil when not measured
}

// fanoutTarget is one cache of a -fanout-child: host env, entry.
type fanoutTarget struct {
	Env   teststack.Env
	Entry string
}

// fanoutOutcome is one target's Ensure in a -fanout-child.
type fanoutOutcome struct {
	Entry   string
	Source  string
	EnsureS float64
	Err     string `json:",omitempty"`
}

// fanoutChildOut is what a -fanout-child prints.
type fanoutChildOut struct {
	Results []fanoutOutcome
	WallS   float64 // from the common start to the last Ensure's end
	// Sampled every 50 ms during the Ensures (runtime.MemStats): the
	// largest heap allocated, and the largest live heap the last GC left
	// (NextGC / 2 at GOGC 100) — what peak RSS is made of.
	MaxHeapMiB, MaxLiveMiB float64
}

// fanoutRun is one -fanout-child run seen by the parent.
type fanoutRun struct {
	out         fanoutChildOut
	rssKiB      float64
	mirrorBytes int64 // body bytes the mirror served meanwhile
	mirrorReqs  int64
	linkBytes   int64 // bytes the mirror's link carried to the caller
}

// fanoutChild opens one imagecache per target (each on its own SSH
// connection; without -targets one on the stack, entry -entry), all
// sharing one Fanout unless -no-fanout, runs Ensure of the image on every
// one at once and prints a fanoutChildOut. Bases already published are
// hits (source pool).
func fanoutChild(ctx context.Context, env teststack.Env, o options) error {
	var ts []fanoutTarget
	if o.targets == "" {
		// One cache on the stack, entry -entry (the single-host A/B of
		// a fetch with and without a Fanout).
		ts = []fanoutTarget{{Env: env, Entry: o.entry}}
	} else if err := json.Unmarshal([]byte(o.targets), &ts); err != nil {
		return fmt.Errorf("-targets: %w", err)
	}
	out, err := fanoutEnsure(ctx, ts, o.url, o.sum, !o.noFanout)
	if err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(out)
}

// fanoutEnsure opens one imagecache per target, sharing one Fanout when
// fanout is set, and runs Ensure of the image (url, sum) on all of them at
// once; it closes them before it returns.
func fanoutEnsure(ctx context.Context, ts []fanoutTarget, url, sum string, fanout bool) (fanoutChildOut, error) {
	var f *basecache.Fanout
	if fanout {
		f = basecache.NewFanout(basecache.FanoutOptions{})
	}
	caches := make([]*basecache.Cache, len(ts))
	for i, t := range ts {
		lv, _, closeLink, err := benchutil.Link(t.Env, "")
		if err != nil {
			return fanoutChildOut{}, err
		}
		defer closeLink()
		c, err := basecache.New(basecache.SSH(lv), basecache.Config{Entry: t.Entry, Pool: t.Env.Pool, TransferBudget: 10 * time.Minute, Fanout: f})
		if err != nil {
			return fanoutChildOut{}, err
		}
		defer func() { _ = c.Close() }()
		caches[i] = c
	}
	img := imagecache.Image{Key: "fan", URL: url, SHA256: sum}
	out := fanoutChildOut{Results: make([]fanoutOutcome, len(ts))}
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		t := time.NewTicker(50 * time.Millisecond)
		defer t.Stop()
		for {
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			out.MaxHeapMiB = max(out.MaxHeapMiB, float64(ms.HeapAlloc)/(1<<20))
			out.MaxLiveMiB = max(out.MaxLiveMiB, float64(ms.NextGC)/2/(1<<20))
			select {
			case <-stop:
				return
			case <-t.C:
			}
		}
	}()
	start := time.Now()
	var wg sync.WaitGroup
	for i, c := range caches {
		wg.Go(func() {
			b, err := c.Ensure(ctx, img)
			r := fanoutOutcome{Entry: ts[i].Entry, Source: b.Source, EnsureS: time.Since(start).Seconds()}
			if err != nil {
				r.Err = err.Error()
			}
			out.Results[i] = r
		})
	}
	wg.Wait()
	out.WallS = time.Since(start).Seconds()
	close(stop)
	<-sampled
	var errs []error
	for _, r := range out.Results {
		if r.Err != "" {
			errs = append(errs, fmt.Errorf("%s: %s", r.Entry, r.Err))
		}
	}
	return out, errors.Join(errs...)
}

// mirrorStats reads labmirror's counters.
func mirrorStats(ctx context.Context, base string) (requests, bytes int64, err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/.stats", nil)
	if err != nil {
		return 0, 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	var st struct{ Requests, Bytes int64 }
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		return 0, 0, fmt.Errorf("mirror stats: %w", err)
	}
	return st.Requests, st.Bytes, nil
}

// runFanoutChild runs `bench -fanout-child` on targets under /usr/bin/time
// and returns its outcome, its peak RSS and what the mirror served
// meanwhile.
func runFanoutChild(ctx context.Context, mirror, url string, img benchutil.Image, ts []fanoutTarget, fanout bool) (*fanoutRun, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	tj, err := json.Marshal(ts)
	if err != nil {
		return nil, err
	}
	args := []string{"-v", self, "-fanout-child", "-url", url, "-sha256", img.SHA256, "-targets", string(tj)}
	if !fanout {
		args = append(args, "-no-fanout")
	}
	r0, b0, err := mirrorStats(ctx, mirror)
	if err != nil {
		return nil, err
	}
	_, l0 := linkBytes(mirrorLink)
	cmd := exec.CommandContext(ctx, "/usr/bin/time", args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("fan-out child: %w: %s", err, lastLines(stderr.String(), 20))
	}
	_, l1 := linkBytes(mirrorLink)
	r1, b1, err := mirrorStats(ctx, mirror)
	if err != nil {
		return nil, err
	}
	run := &fanoutRun{mirrorBytes: b1 - b0, mirrorReqs: r1 - r0, linkBytes: l1 - l0}
	if err := json.Unmarshal(bytes.TrimSpace(stdout.Bytes()), &run.out); err != nil {
		return nil, fmt.Errorf("fan-out child output %q: %w", stdout.String(), err)
	}
	m := maxRSS.FindStringSubmatch(stderr.String())
	if m == nil {
		return nil, fmt.Errorf("no maximum RSS in /usr/bin/time output: %s", stderr.String())
	}
	run.rssKiB, _ = strconv.ParseFloat(m[1], 64)
	return run, nil
}

// mirrorLink is the caller's end of the mirror's link (scripts/lab).
const mirrorLink = "egplabm"

func (r *fanoutRun) times() string {
	var s []string
	for _, x := range r.out.Results {
		s = append(s, fmt.Sprintf("%.2fs", x.EnsureS))
	}
	return strings.Join(s, " ")
}

func (r *fanoutRun) sources() []string {
	var s []string
	for _, x := range r.out.Results {
		s = append(s, x.Source)
	}
	return s
}

// runFanout runs the fanout phase on a lab of -fanout-hosts + 1 hosts and
// the lab's mirror, both brought up (and stopped at the end, unless
// -keep-lab or the lab was up before) through scripts/lab.
func runFanout(ctx context.Context, env teststack.Env, o options) (*fanoutResult, error) {
	if o.fanoutHosts < 2 {
		return nil, errors.New("-fanout-hosts must be ≥ 2")
	}
	l := lab{script: filepath.Join(filepath.Dir(env.Script), "lab"), dir: filepath.Join(env.Dir, "lab")}
	reused := false
	if d := os.Getenv("EGRESSPROXY_LAB_DIR"); d != "" {
		l.dir, reused = d, true
	}
	if !o.keepLab && !reused {
		defer func() {
			if _, err := l.run(context.WithoutCancel(ctx), "down"); err != nil {
				logf("fanout: %v", err)
			}
		}()
	} else {
		defer func() {
			if _, err := l.run(context.WithoutCancel(ctx), "mirror", "down"); err != nil {
				logf("fanout: %v", err)
			}
		}()
	}
	hosts, err := l.up(ctx, o.fanoutHosts+1, o.fanoutRate)
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(env.Dir, "bench")
	img, err := benchutil.EnsureImage(ctx, dir, o.fanoutMiB)
	if err != nil {
		return nil, err
	}
	mirror, err := l.mirrorUp(ctx, o.fanoutMirrorRate, dir)
	if err != nil {
		return nil, err
	}
	url := mirror + "/" + filepath.Base(img.Path)
	res := &fanoutResult{hosts: o.fanoutHosts, mib: o.fanoutMiB, rate: o.fanoutRate, mirrorRate: o.fanoutMirrorRate, image: img, load: loadavg()}
	many := hosts[:o.fanoutHosts]
	late := hosts[o.fanoutHosts]
	rounds := o.fanoutRuns
	if o.fanoutGrowOnly {
		rounds = 0
	}
	for round := range rounds {
		tag := fmt.Sprintf("%d%04x", round, rand.IntN(1<<16))
		one := []fanoutTarget{{Env: many[0].env, Entry: "fo1o" + tag}}
		var all []fanoutTarget
		for _, h := range many {
			all = append(all, fanoutTarget{Env: h.env, Entry: fmt.Sprintf("fo%dx%s", h.n, tag)})
		}
		lateT := fanoutTarget{Env: late.env, Entry: fmt.Sprintf("fo%dx%s", late.n, tag)}
		// Each step starts from pools without the image (a base left
		// published would be copied as a peer's) and removes what it
		// published.
		oneStep := func() error {
			defer cleanupFanout(ctx, one)
			r, err := runFanoutChild(ctx, mirror, url, img, one, true)
			if err != nil {
				return fmt.Errorf("one host: %w", err)
			}
			res.one = append(res.one, r.out.WallS)
			res.oneBytes = append(res.oneBytes, float64(r.mirrorBytes))
			res.oneRSSKiB = append(res.oneRSSKiB, r.rssKiB)
			logf("fanout: 1 host cold fetch %.2fs, mirror served %d bytes in %d requests, RSS %.0f KiB", r.out.WallS, r.mirrorBytes, r.mirrorReqs, r.rssKiB)
			return nil
		}
		manyStep := func() error {
			defer cleanupFanout(ctx, append(append([]fanoutTarget{}, all...), lateT))
			r, err := runFanoutChild(ctx, mirror, url, img, all, true)
			if err != nil {
				return fmt.Errorf("%d hosts: %w", len(all), err)
			}
			res.many = append(res.many, r.out.WallS)
			res.manyBytes = append(res.manyBytes, float64(r.mirrorBytes))
			res.manyLinkBytes = append(res.manyLinkBytes, float64(r.linkBytes))
			res.manyRSSKiB = append(res.manyRSSKiB, r.rssKiB)
			res.manyHeapMiB = append(res.manyHeapMiB, r.out.MaxHeapMiB)
			res.manyLiveMiB = append(res.manyLiveMiB, r.out.MaxLiveMiB)
			res.manySources = r.sources()
			logf("fanout: %d hosts at once %.2fs (each: %s), mirror served %d bytes in %d requests (link %d), RSS %.0f KiB (heap ≤ %.1f MiB, live ≤ %.1f MiB), sources %v", len(all), r.out.WallS, r.times(), r.mirrorBytes, r.mirrorReqs, r.linkBytes, r.rssKiB, r.out.MaxHeapMiB, r.out.MaxLiveMiB, r.sources())
			if err := benchutil.Sync(ctx); err != nil {
				return err
			}
			// The late joiner: a fresh process with every host's cache,
			// the others holding the image.
			r, err = runFanoutChild(ctx, mirror, url, img, append(append([]fanoutTarget{}, all...), lateT), true)
			if err != nil {
				return fmt.Errorf("late joiner: %w", err)
			}
			last := r.out.Results[len(r.out.Results)-1]
			res.late = append(res.late, last.EnsureS)
			res.lateBytes = append(res.lateBytes, float64(r.mirrorBytes))
			res.lateRSSKiB = append(res.lateRSSKiB, r.rssKiB)
			res.lateSource = append(res.lateSource, last.Source)
			logf("fanout: late joiner (host %d) %.2fs from %s, mirror served %d bytes, RSS %.0f KiB", late.n, last.EnsureS, last.Source, r.mirrorBytes, r.rssKiB)
			return nil
		}
		steps := []func() error{oneStep, manyStep}
		if round%2 == 1 {
			steps[0], steps[1] = steps[1], steps[0]
		}
		for _, step := range steps {
			if err := step(); err != nil {
				return nil, err
			}
			if err := benchutil.Sync(ctx); err != nil {
				return nil, err
			}
		}
		if round == 0 {
			// Today: every host downloads on its own.
			var own []fanoutTarget
			for _, h := range many {
				own = append(own, fanoutTarget{Env: h.env, Entry: fmt.Sprintf("fo%dn%s", h.n, tag)})
			}
			r, err := runFanoutChild(ctx, mirror, url, img, own, false)
			cleanupFanout(ctx, own)
			if err != nil {
				return nil, fmt.Errorf("%d hosts without fan-out: %w", len(own), err)
			}
			res.today = r
			logf("fanout: %d hosts without fan-out %.2fs (each: %s), mirror served %d bytes in %d requests, RSS %.0f KiB", len(own), r.out.WallS, r.times(), r.mirrorBytes, r.mirrorReqs, r.rssKiB)
			if err := benchutil.Sync(ctx); err != nil {
				return nil, err
			}
		}
	}
	res.manyVsOne = benchutil.Ratios(res.many, res.one) // time ratios: many / one
	if res.today != nil && len(res.one) > 0 {
		res.todayWallVsOne = res.today.out.WallS / res.one[0]
	}
	if o.fanoutGrowRate != "" {
		if res.grow, err = runGrow(ctx, o, l, mirror, url, dir, img); err != nil {
			return nil, fmt.Errorf("growing fleet: %w", err)
		}
	}
	return res, nil
}

// mirrorUp starts (or reshapes) the lab's mirror at rate, serving dir, and
// returns its URL.
func (l lab) mirrorUp(ctx context.Context, rate, dir string) (string, error) {
	if _, err := l.run(ctx, "mirror", "up", "--rate", rate, "--dir", dir); err != nil {
		return "", err
	}
	out, err := l.run(ctx, "env")
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(out, "\n") {
		if v, ok := strings.CutPrefix(line, "export EGRESSPROXY_LAB_MIRROR_URL="); ok {
			return strings.Trim(v, `'"`), nil
		}
	}
	return "", errors.New("scripts/lab env names no mirror after `mirror up`")
}

// cleanupFanout removes every volume of the targets' entries from their
// hosts' pools (untimed).
func cleanupFanout(ctx context.Context, ts []fanoutTarget) {
	ctx = context.WithoutCancel(ctx)
	byHost := map[string][]fanoutTarget{}
	for _, t := range ts {
		byHost[t.Env.SSHAddr] = append(byHost[t.Env.SSHAddr], t)
	}
	for _, group := range byHost {
		deleteEntries(ctx, group[0].Env, group)
	}
}

func deleteEntries(ctx context.Context, env teststack.Env, ts []fanoutTarget) {
	lv, _, closeLink, err := benchutil.Link(env, "")
	if err != nil {
		logf("fanout: cleanup: %v", err)
		return
	}
	defer closeLink()
	err = lv.Do(ctx, func(l *libvirt.Libvirt) error {
		return benchutil.DeleteVolumes(l, env.Pool, func(name string) bool {
			for _, t := range ts {
				if strings.HasPrefix(name, "base-"+t.Entry+"--") || strings.HasPrefix(name, "claim-"+t.Entry+"--") {
					return true
				}
			}
			return false
		})
	})
	if err != nil {
		logf("fanout: cleanup: %v", err)
	}
}

// summary returns the phase's Summary rows: figure, value, target, reading.
func (f *fanoutResult) summary() [][4]string {
	if len(f.one) == 0 { // -fanout-grow-only
		return nil
	}
	size := float64(f.image.Size)
	bytesX := make([]float64, len(f.manyBytes))
	for i, b := range f.manyBytes {
		bytesX[i] = b / size
	}
	wall := med(f.manyVsOne)
	rss := med(f.manyRSSKiB) / 1024
	lateZero := len(f.lateBytes) > 0
	for _, b := range f.lateBytes {
		lateZero = lateZero && b == 0
	}
	img := fmt.Sprintf("%d MiB image", f.mib)
	return [][4]string{
		{fmt.Sprintf("fan-out: mirror bytes, %d hosts needing one cold %s at once (%s mirror, %s hosts)", f.hosts, img, f.mirrorRate, f.rate),
			fmt.Sprintf("%.3f× the image (%s)", med(bytesX), list(bytesX, "%.3f")), fmt.Sprintf("≤ %.2f×", targetFanoutBytes), verdict(med(bytesX) <= targetFanoutBytes)},
		{fmt.Sprintf("fan-out: wall time, %d hosts at once / 1 host's cold fetch", f.hosts),
			fmt.Sprintf("%.2f× (%.1f vs %.1f s)", wall, med(f.many), med(f.one)), fmt.Sprintf("≤ %.1f×", targetFanoutWall), verdict(wall <= targetFanoutWall)},
		{"fan-out: mirror bytes, one more host going cold afterwards (peer path)",
			fmt.Sprintf("%s bytes (sources %s; %.1f s vs %.1f s from the mirror)", list(f.lateBytes, "%.0f"), strings.Join(f.lateSource, ", "), med(f.late), med(f.one)), "0", verdict(lateZero)},
		{fmt.Sprintf("fan-out: peak RSS of the %d-host fan-out process", f.hosts),
			fmt.Sprintf("%.1f MiB", rss), fmt.Sprintf("≤ %.0f MiB", targetFanoutRSS), verdict(rss <= targetFanoutRSS)},
	}
}

// summaryRows are the phase's Summary rows, the growing fleet's included.
func (f *fanoutResult) summaryRows() [][4]string {
	rows := f.summary()
	if f.grow != nil {
		rows = append(rows, f.grow.summary(float64(f.image.Size))...)
	}
	return rows
}

func (r *report) renderFanout(p func(string, ...any), f *fanoutResult) {
	size := float64(f.image.Size)
	p("## 8. Image fan-out across hosts: one download for the fleet")
	p("")
	if len(f.one) == 0 && f.grow != nil { // -fanout-grow-only
		f.grow.render(p, size)
		return
	}
	p("The lab (docs/lab.md) with its **mirror** (`scripts/lab mirror up`: `labmirror` serving the image in a network namespace of its own behind a **%s** link) and **%d + 1 hosts** behind **%s** links; one cold qcow2 of %.0f MB (%d MiB of random data, sha256 %s…). Each process below is a `bench -fanout-child` under `/usr/bin/time -v` with one `basecache.Cache` per host on its own SSH connection, all sharing one `basecache.Fanout` (as kvm2's providers share `basecache.ProcessFanout()` by default). Bytes served are the mirror's own count of body bytes (`/.stats`); the mirror link's byte counter is the cross-check. %d rounds, the first two steps' order alternated; load average at the start: %s.", f.mirrorRate, f.hosts, f.rate, size/1e6, f.mib, f.image.SHA256[:12], len(f.one), f.load)
	p("")
	p("- **1 host**: one host's cold fetch from the mirror, alone.")
	p("- **%d hosts at once**: every host needs the image at the same time; wall time from the common start to the last host's published base.", f.hosts)
	p("- **late joiner**: a new process with the %d hosts' caches (their bases published) and one more host, cold: it copies a peer's published base (source `peer`) instead of downloading; its own read-back digest is what it publishes.", f.hosts)
	if f.today != nil {
		p("- **today** (round 1 only): the %d hosts at once without a Fanout, every one downloading on its own.", f.hosts)
	}
	p("")
	p("| | median | runs |")
	p("| --- | --- | --- |")
	p("| 1 host: cold fetch (s) | %.2f | %s |", med(f.one), list(f.one, "%.2f"))
	p("| 1 host: mirror bytes | %.0f | %s |", med(f.oneBytes), list(f.oneBytes, "%.0f"))
	p("| %d hosts at once: wall (s) | %.2f | %s |", f.hosts, med(f.many), list(f.many, "%.2f"))
	p("| %d hosts at once: mirror bytes | %.0f | %s |", f.hosts, med(f.manyBytes), list(f.manyBytes, "%.0f"))
	p("| %d hosts at once: bytes on the mirror's link | %.0f | %s |", f.hosts, med(f.manyLinkBytes), list(f.manyLinkBytes, "%.0f"))
	p("| %d hosts at once: peak RSS (MiB) | %.1f | %s |", f.hosts, med(f.manyRSSKiB)/1024, list(mib(f.manyRSSKiB), "%.1f"))
	if len(f.manyHeapMiB) > 0 {
		p("| %d hosts at once: largest Go heap allocated / live after a GC (MiB, sampled every 50 ms; diagnostic) | %.1f / %.1f | %s / %s |", f.hosts, med(f.manyHeapMiB), med(f.manyLiveMiB), list(f.manyHeapMiB, "%.1f"), list(f.manyLiveMiB, "%.1f"))
	}
	p("| late joiner: cold fetch (s) | %.2f | %s |", med(f.late), list(f.late, "%.2f"))
	p("| late joiner: mirror bytes | %.0f | %s |", med(f.lateBytes), list(f.lateBytes, "%.0f"))
	p("| late joiner: peak RSS of its process (MiB) | %.1f | %s |", med(f.lateRSSKiB)/1024, list(mib(f.lateRSSKiB), "%.1f"))
	p("| 1 host: peak RSS (MiB) | %.1f | %s |", med(f.oneRSSKiB)/1024, list(mib(f.oneRSSKiB), "%.1f"))
	if t := f.today; t != nil {
		p("| today, %d hosts without fan-out: wall (s), mirror bytes, peak RSS (MiB) | %.2f, %d (%.2f× the image), %.1f | %.2f× one host's wall |", f.hosts, t.out.WallS, t.mirrorBytes, float64(t.mirrorBytes)/size, t.rssKiB/1024, f.todayWallVsOne)
	}
	p("")
	p("Sources of the last round's %d hosts: %s; of the late joiners: %s.", f.hosts, strings.Join(f.manySources, ", "), strings.Join(f.lateSource, ", "))
	p("")
	p("| figure | median (runs) | target | reading |")
	p("| --- | --- | --- | --- |")
	for _, x := range f.summary() {
		p("| %s | %s | %s | %s |", strings.TrimPrefix(x[0], "fan-out: "), x[1], x[2], x[3])
	}
	p("")
	p("Per-round wall ratios (%d hosts / 1 host): %s.", f.hosts, list(f.manyVsOne, "%.2f"))
	p("")
	if f.grow != nil {
		f.grow.render(p, size)
	}
}
