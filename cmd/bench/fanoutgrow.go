package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"

	"github.com/digitalocean/go-libvirt"
	"github.com/go-logr/logr/funcr"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/basecache"
	"github.com/egressproxy/egressproxy/internal/testing/benchutil"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
	"github.com/egressproxy/egressproxy/kvm2"
)

// The fleet grows while one host holds the image (part of the fanout
// phase): the lab's -fanout-hosts hosts behind -fanout-grow-rate links, the
// mirror behind a faster -fanout-grow-mirror-rate link, and host 1 holding
// a published base of the image under another entry of the process (a
// cache of the same Fanout). One process (`bench -grow-child`, as an
// operator with an entry per host) cold-creates createsPer proxies on host
// 1 alone, or on every host at once; interleaved over -fanout-runs rounds.
// Each child is a fresh process: the sources are chosen without history.

// Targets of the growing fleet (the issue's).
const (
	targetGrowWall  = 1.3  // every host's Creates / host 1's alone
	targetGrowBytes = 1.05 // mirror bytes / image, every host at once
)

// growResult is the growing fleet's figures; index i is round i.
type growResult struct {
	hosts                int
	rate, mirrorRate     string
	one, many            []float64 // seconds until the last Create returned
	oneBytes, manyBytes  []float64 // bytes the mirror served
	manyVsOne            []float64 // per-round time ratios
	oneRuns, manyRuns    []growChildOut
	holderHost, holderEn string
	load                 string
}

// growTarget is one lab host of a -grow-child.
type growTarget struct {
	N       int
	Env     teststack.Env
	Network string
}

// growChildOut is what a -grow-child prints.
type growChildOut struct {
	WallS       float64
	First, Last []float64 // per host: seconds until its first and last Create returned
	Sources     []string  // per host: the source its base came from
	Switches    int       // source switches logged
}

// growChild is `bench -grow-child`: it opens the holder's cache (-holder,
// its base published) in the process's Fanout, then cold-creates
// createsPer proxies at once on a fresh kvm2 entry of each -targets host
// (createsOnce) and prints a growChildOut.
func growChild(ctx context.Context, o options) error {
	var ts []growTarget
	if err := json.Unmarshal([]byte(o.targets), &ts); err != nil {
		return fmt.Errorf("-targets: %w", err)
	}
	var holder fanoutTarget
	if err := json.Unmarshal([]byte(o.holder), &holder); err != nil {
		return fmt.Errorf("-holder: %w", err)
	}
	lv, _, closeLink, err := benchutil.Link(holder.Env, "")
	if err != nil {
		return err
	}
	defer closeLink()
	hc, err := basecache.New(basecache.SSH(lv), basecache.Config{Entry: holder.Entry, Pool: holder.Env.Pool, Fanout: basecache.ProcessFanout()})
	if err != nil {
		return err
	}
	defer func() { _ = hc.Close() }()
	img := imagecache.Image{Key: "fan", URL: o.url, SHA256: o.sum} // fanoutEnsure's key: the holder's base
	if b, err := hc.Ensure(ctx, img); err != nil || b.Source != imagecache.SourcePool {
		return fmt.Errorf("the holder's base: %+v, %v; want it published before (source pool)", b, err)
	}
	var hosts []labHost
	for _, t := range ts {
		hosts = append(hosts, labHost{n: t.N, env: t.Env, network: t.Network})
	}
	var mu sync.Mutex
	sources := map[string]string{} // entry → source
	switches := 0
	log := funcr.New(func(_, args string) {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case strings.Contains(args, `"msg"="published base"`):
			sources[logField(args, "entry")] = logField(args, "source")
		case strings.Contains(args, `"msg"="switching source"`):
			switches++
		}
	}, funcr.Options{})
	d, first, last, err := createsOnce(ctx, hosts, o.url, benchutil.Image{SHA256: o.sum}, rand.IntN(10), &kvm2.Options{Logger: log})
	if err != nil {
		return err
	}
	out := growChildOut{WallS: d.Seconds(), First: first, Last: last, Switches: switches}
	mu.Lock()
	for _, h := range hosts {
		s := "?"
		for e, src := range sources {
			if strings.HasPrefix(e, fmt.Sprintf("bk%d", h.n)) {
				s = src
			}
		}
		out.Sources = append(out.Sources, s)
	}
	mu.Unlock()
	return json.NewEncoder(os.Stdout).Encode(out)
}

// logField is the value of key in a funcr line ("" when absent).
func logField(line, key string) string {
	_, rest, ok := strings.Cut(line, `"`+key+`"=`)
	if !ok {
		return ""
	}
	if v, ok := strings.CutPrefix(rest, `"`); ok {
		v, _, _ = strings.Cut(v, `"`)
		return v
	}
	v, _, _ := strings.Cut(rest, " ")
	return v
}

// runGrowChild runs `bench -grow-child` on hosts beside holder and returns
// its outcome and the bytes the mirror served meanwhile.
func runGrowChild(ctx context.Context, mirror, url string, img benchutil.Image, hosts []labHost, holder fanoutTarget) (growChildOut, int64, error) {
	self, err := os.Executable()
	if err != nil {
		return growChildOut{}, 0, err
	}
	var ts []growTarget
	for _, h := range hosts {
		ts = append(ts, growTarget{N: h.n, Env: h.env, Network: h.network})
	}
	tj, err := json.Marshal(ts)
	if err != nil {
		return growChildOut{}, 0, err
	}
	hj, err := json.Marshal(holder)
	if err != nil {
		return growChildOut{}, 0, err
	}
	_, b0, err := mirrorStats(ctx, mirror)
	if err != nil {
		return growChildOut{}, 0, err
	}
	cmd := exec.CommandContext(ctx, self, "-grow-child", "-url", url, "-sha256", img.SHA256, "-targets", string(tj), "-holder", string(hj))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return growChildOut{}, 0, fmt.Errorf("grow child: %w: %s", err, lastLines(stderr.String(), 20))
	}
	_, b1, err := mirrorStats(ctx, mirror)
	if err != nil {
		return growChildOut{}, 0, err
	}
	var out growChildOut
	if err := json.Unmarshal(bytes.TrimSpace(stdout.Bytes()), &out); err != nil {
		return growChildOut{}, 0, fmt.Errorf("grow child output %q: %w", stdout.String(), err)
	}
	return out, b1 - b0, nil
}

// runGrow measures the growing fleet on lab l (its hosts brought to
// -fanout-hosts at -fanout-grow-rate, the mirror to
// -fanout-grow-mirror-rate serving dir), the image img at url.
func runGrow(ctx context.Context, o options, l lab, mirror, url, dir string, img benchutil.Image) (*growResult, error) {
	hosts, err := l.up(ctx, o.fanoutHosts, o.fanoutGrowRate)
	if err != nil {
		return nil, err
	}
	if _, err := l.mirrorUp(ctx, o.fanoutGrowMirrorRate, dir); err != nil {
		return nil, err
	}
	for _, h := range hosts {
		if err := os.MkdirAll(h.env.Dir, 0o755); err != nil {
			return nil, err
		}
	}
	if err := warmValidation(ctx, hosts); err != nil {
		return nil, err
	}
	holder := fanoutTarget{Env: hosts[0].env, Entry: fmt.Sprintf("fohold%04x", rand.IntN(1<<16))}
	defer cleanupFanout(ctx, []fanoutTarget{holder})
	// The holder's base, published from the mirror (untimed).
	if _, err := runFanoutChild(ctx, mirror, url, img, []fanoutTarget{holder}, true); err != nil {
		return nil, fmt.Errorf("the holder's base: %w", err)
	}
	res := &growResult{hosts: len(hosts), rate: o.fanoutGrowRate, mirrorRate: o.fanoutGrowMirrorRate, holderHost: fmt.Sprint(hosts[0].n), holderEn: holder.Entry, load: loadavg()}
	for round := range o.fanoutRuns {
		order := []bool{false, true}
		if round%2 == 1 {
			order = []bool{true, false}
		}
		for _, many := range order {
			hs := hosts[:1]
			if many {
				hs = hosts
			}
			out, served, err := runGrowChild(ctx, mirror, url, img, hs, holder)
			if err != nil {
				return nil, fmt.Errorf("%d host(s): %w", len(hs), err)
			}
			if many {
				res.many, res.manyBytes, res.manyRuns = append(res.many, out.WallS), append(res.manyBytes, float64(served)), append(res.manyRuns, out)
			} else {
				res.one, res.oneBytes, res.oneRuns = append(res.one, out.WallS), append(res.oneBytes, float64(served)), append(res.oneRuns, out)
			}
			logf("fanout, growing fleet: %d host(s) × %d cold Creates in %.2fs (per host, first at %s s, last at %s s), mirror served %d bytes, sources %v, %d switches",
				len(hs), createsPer, out.WallS, list(out.First, "%.1f"), list(out.Last, "%.1f"), served, out.Sources, out.Switches)
			if err := benchutil.Sync(ctx); err != nil {
				return nil, err
			}
		}
	}
	res.manyVsOne = benchutil.Ratios(res.many, res.one)
	return res, nil
}

// warmValidation defines (with validation) and undefines one small domain
// on each host, untimed. A libvirtd that has not validated a domain yet
// parses its RNG schema on the first define, and concurrent first defines
// race in libxml2 ("Unable to parse RNG …: Error type 'unsignedInt' is
// not exported by type library", seen with 5 Creates at once on a fresh
// lab host); the library's Creates are then measured on a warm libvirtd,
// as on a host in service.
func warmValidation(ctx context.Context, hosts []labHost) error {
	const x = `<domain type='qemu'><name>bench-warm-validation</name><memory unit='MiB'>32</memory><os><type>hvm</type></os></domain>`
	for _, h := range hosts {
		lv, _, closeLink, err := benchutil.Link(h.env, "")
		if err != nil {
			return err
		}
		err = lv.Do(ctx, func(l *libvirt.Libvirt) error {
			d, err := l.DomainDefineXMLFlags(x, libvirt.DomainDefineValidate)
			if err != nil {
				return err
			}
			return l.DomainUndefine(d)
		})
		closeLink()
		if err != nil {
			return fmt.Errorf("host %d: a domain defined and undefined before the Creates: %w", h.n, err)
		}
	}
	return nil
}

// summary returns the growing fleet's Summary rows.
func (g *growResult) summary(size float64) [][4]string {
	bytesX := make([]float64, len(g.manyBytes))
	for i, b := range g.manyBytes {
		bytesX[i] = b / size
	}
	wall := med(g.manyVsOne)
	what := fmt.Sprintf("%d hosts × %d cold Creates vs 1 × %d, one host holding the image under another entry (%s hosts, %s mirror)", g.hosts, createsPer, createsPer, g.rate, g.mirrorRate)
	return [][4]string{
		{"fan-out, growing fleet: wall time, " + what,
			fmt.Sprintf("%.2f× (%.1f vs %.1f s)", wall, med(g.many), med(g.one)), fmt.Sprintf("≤ %.1f×", targetGrowWall), verdict(wall <= targetGrowWall)},
		{fmt.Sprintf("fan-out, growing fleet: mirror bytes, %d hosts' cold Creates at once", g.hosts),
			fmt.Sprintf("%.3f× the image (%s)", med(bytesX), list(bytesX, "%.3f")), fmt.Sprintf("≤ %.2f×", targetGrowBytes), verdict(med(bytesX) <= targetGrowBytes)},
	}
}

func (g *growResult) render(p func(string, ...any), size float64) {
	p("### The fleet grows while one host holds the image")
	p("")
	p("The lab's %d hosts behind **%s** links, the mirror behind a faster **%s** link, and host %s holding a published base of the image under another entry (`%s`, a cache of the same Fanout). Each run is a fresh `bench -grow-child` process (as an operator with an entry per host, no history of rates): it opens a fresh kvm2 entry per host and starts %d Creates on each at once; the base of each entry is cold. **1 host**: host %s alone; **%d hosts**: every host at once. Rounds interleaved (order alternated); load average at the start: %s.",
		g.hosts, g.rate, g.mirrorRate, g.holderHost, g.holderEn, createsPer, g.holderHost, g.hosts, g.load)
	p("")
	p("| | median | runs |")
	p("| --- | --- | --- |")
	p("| 1 host × %d cold Creates (s) | %.2f | %s |", createsPer, med(g.one), list(g.one, "%.2f"))
	p("| 1 host: mirror bytes | %.0f | %s |", med(g.oneBytes), list(g.oneBytes, "%.0f"))
	p("| %d hosts × %d cold Creates at once (s) | %.2f | %s |", g.hosts, createsPer, med(g.many), list(g.many, "%.2f"))
	p("| %d hosts: mirror bytes | %.0f | %s |", g.hosts, med(g.manyBytes), list(g.manyBytes, "%.0f"))
	p("")
	var srcs []string
	for i, r := range g.manyRuns {
		srcs = append(srcs, fmt.Sprintf("round %d: %s (%d switches; last Create per host at %s s)", i+1, strings.Join(r.Sources, ", "), r.Switches, list(r.Last, "%.1f")))
	}
	var ones []string
	for _, r := range g.oneRuns {
		ones = append(ones, strings.Join(r.Sources, ", "))
	}
	p("Sources of each host's base, %d hosts at once: %s. Host %s alone: %s.", g.hosts, strings.Join(srcs, "; "), g.holderHost, strings.Join(slices.Compact(ones), ", "))
	p("")
	p("| figure | median (runs) | target | reading |")
	p("| --- | --- | --- | --- |")
	for _, x := range g.summary(size) {
		p("| %s | %s | %s | %s |", strings.TrimPrefix(x[0], "fan-out, growing fleet: "), x[1], x[2], x[3])
	}
	p("")
	p("Per-round ratios (%d hosts / 1 host): %s.", g.hosts, list(g.manyVsOne, "%.2f"))
	p("")
}
