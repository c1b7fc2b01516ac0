// Command bench measures egressproxy on the real test stack (and on a lab of
// several hosts behind shaped links it brings up itself) and writes
// docs/benchmarks.md: image upload (the library's cold fetch vs virsh
// vol-upload over qemu+ssh vs cat | ssh), peak RSS of a cold fetch, the
// control path (libvirt RPCs and wall time per operation, concurrent Gets),
// health probes (in-process proxies and the stack's Squid), how
// Create/Get/List scale with the number of instances, and the image
// fan-out across hosts behind a rate-limited mirror (fanout phase).
//
// Run it through `make bench` (as root: it starts the stack). By hand:
//
//	scripts/teststack up && eval "$(scripts/teststack env)"
//	go build -o /tmp/egressproxy-bench ./cmd/bench && /tmp/egressproxy-bench -out docs/benchmarks.md
//
// Every figure is a median over -runs runs; comparisons are medians of
// per-pair ratios of interleaved runs (A B C, rotated each round) so drift
// of the machine cancels within a pair.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/egressproxy/egressproxy/internal/testing/benchutil"
	"github.com/egressproxy/egressproxy/internal/testing/teststack"
)

func main() {
	var o options
	flag.StringVar(&o.out, "out", "docs/benchmarks.md", "report file to write")
	flag.IntVar(&o.runs, "runs", 5, "runs per figure (median); at least 5 for the report")
	flag.IntVar(&o.imageMiB, "image-mib", 1024, "size of the random data in the test qcow2 (MiB)")
	flag.StringVar(&o.scale, "scale", "1,10,50,100", "instance counts of the scaling table")
	flag.IntVar(&o.gets, "gets", 1000, "concurrent Gets per run")
	flag.IntVar(&o.probes, "probes", 1000, "probes per round through Squid")
	flag.StringVar(&o.phases, "phases", "upload,control,scale,health,rtt,lab,fanout", "phases to run")
	flag.StringVar(&o.analysis, "analysis", "cmd/bench/analysis.md", "hand-written reading appended to the report ('' for none)")
	flag.StringVar(&o.command, "command", "make bench", "command recorded in the report")
	child := flag.Bool("fetch-child", false, "internal: run one cold fetch and print its figures as JSON")
	flag.StringVar(&o.url, "url", "", "internal (-fetch-child): image URL")
	flag.StringVar(&o.sum, "sha256", "", "internal (-fetch-child): image digest")
	flag.StringVar(&o.entry, "entry", "", "internal (-fetch-child): imagecache entry")
	flag.StringVar(&o.targets, "targets", "", "internal (-fetch-child): JSON list of {Env, Entry} to cold-fetch into at once instead of the stack")
	flag.StringVar(&o.cpuprofile, "cpuprofile", "", "internal (-fetch-child): write a CPU profile of the fetch here")
	flag.StringVar(&o.memprofile, "memprofile", "", "internal (-fetch-child): write an allocation profile of the fetch here (after it)")
	flag.DurationVar(&o.heapAt, "heapat", 0, "internal (-fetch-child, with -memprofile): also write the live heap this long into the fetch to <memprofile>.inuse")
	flag.BoolVar(&o.memstats, "memstats", false, "internal (-fetch-child): print the Go heap's peaks (sampled every 5 ms) and totals to stderr as JSON")
	flag.StringVar(&o.labRates, "lab-rates", "1gbit:1024,100mbit:256", "lab phase: link rates and image MiB, rate:MiB,…")
	flag.IntVar(&o.labHosts, "lab-hosts", 4, "lab phase: hosts (the concurrent rows use all of them)")
	flag.BoolVar(&o.keepLab, "keep-lab", false, "lab phase: leave the lab running at the end")
	flag.IntVar(&o.labRuns, "lab-runs", 3, "lab phase: interleaved rounds per figure")
	flag.BoolVar(&o.createsOnly, "creates-only", false, "lab phase, diagnostic: measure only the concurrent Creates rows (at -creates-rate), none of the single-link and 4-fetch rows")
	flag.StringVar(&o.createsRate, "creates-rate", "100mbit", "lab phase: the rate at which 4 hosts x 5 concurrent Creates are measured ('' for none)")
	flag.IntVar(&o.rttMS, "rtt-ms", 50, "rtt phase: round-trip time the delay proxy adds (ms)")
	flag.IntVar(&o.rttList, "rtt-list", 100, "rtt phase: instances to List")
	flag.IntVar(&o.fanoutHosts, "fanout-hosts", 4, "fanout phase: hosts needing the image at once (one more host is the late joiner)")
	flag.IntVar(&o.fanoutMiB, "fanout-mib", 256, "fanout phase: size of the random data in the image (MiB)")
	flag.StringVar(&o.fanoutRate, "fanout-rate", "1gbit", "fanout phase: the hosts' link rate")
	flag.StringVar(&o.fanoutMirrorRate, "fanout-mirror-rate", "100mbit", "fanout phase: the mirror's link rate")
	flag.IntVar(&o.fanoutRuns, "fanout-runs", 3, "fanout phase: interleaved rounds")
	flag.StringVar(&o.fanoutGrowRate, "fanout-grow-rate", "100mbit", "fanout phase, growing fleet: the hosts' link rate ('' to skip it)")
	flag.StringVar(&o.fanoutGrowMirrorRate, "fanout-grow-mirror-rate", "1gbit", "fanout phase, growing fleet: the mirror's link rate (faster than the hosts')")
	flag.BoolVar(&o.fanoutGrowOnly, "fanout-grow-only", false, "fanout phase, diagnostic: measure only the growing fleet, none of the fan-out rows before it")
	growCh := flag.Bool("grow-child", false, "internal: cold-create proxies on a fresh kvm2 entry of every -targets lab host at once beside the -holder cache, and print the outcome as JSON")
	flag.StringVar(&o.holder, "holder", "", "internal (-grow-child): JSON {Env, Entry} of the cache holding the image")
	fanChild := flag.Bool("fanout-child", false, "internal: Ensure the image on every -targets cache at once (sharing a Fanout unless -no-fanout) and print the outcome as JSON")
	flag.BoolVar(&o.noFanout, "no-fanout", false, "internal (-fanout-child): no Fanout, every cache downloads on its own")
	flag.IntVar(&o.lsInstances, "ls-instances", 1000, "libvirtscale phase: stopped instances of the owner")
	flag.IntVar(&o.lsForeign, "ls-foreign", 100, "libvirtscale phase: domains that are not the owner's")
	flag.IntVar(&o.lsOrphans, "ls-orphans", 100, "libvirtscale phase: instances the orphan collection deletes")
	lsCallers := flag.String("ls-callers", "5,20", "libvirtscale phase: concurrent callers of the Create and Delete throughput, one row each")
	flag.IntVar(&o.lsCreates, "ls-creates", 60, "libvirtscale phase: Creates (then Deletes) of the throughput")
	flag.StringVar(&o.lsRTTs, "ls-rtts", "0,50", "libvirtscale phase: round-trip times (ms; 0: loopback)")
	flag.StringVar(&o.lsOut, "ls-out", "docs/scale-libvirt.md", "libvirtscale phase: report file to write")
	flag.BoolVar(&o.merge, "merge", false, "keep the sections of -out for phases this run does not measure")
	reana := flag.Bool("reanalyse", false, "only replace the reading at the end of -out with -analysis (figures untouched)")
	flag.Parse()
	if err := parseCallers(*lsCallers, &o); err != nil {
		fatal(err)
	}
	if *reana {
		if err := reanalyse(o.out, o.analysis); err != nil {
			fatal(err)
		}
		return
	}

	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Minute)
	defer cancel()
	env, err := benchutil.LoadEnv()
	if err != nil {
		fatal(err)
	}
	if run := childOf(*fanChild, *growCh, *child); run != nil {
		if err := run(ctx, env, o); err != nil {
			fatal(err)
		}
		return
	}
	if o.runs < 1 {
		fatal(fmt.Errorf("-runs must be ≥ 1"))
	}
	r := &report{opts: o, started: time.Now().UTC()}
	r.machine = describeMachine(ctx)
	for _, ph := range strings.Split(o.phases, ",") {
		logf("phase %s (load: %s)", ph, loadavg())
		r.loads = append(r.loads, fmt.Sprintf("%s start %s: %s", ph, time.Now().UTC().Format("15:04:05"), loadavg()))
		err := runPhase(ctx, env, o, r, strings.TrimSpace(ph))
		if err != nil {
			fatal(fmt.Errorf("phase %s: %w", ph, err))
		}
	}
	if strings.TrimSpace(strings.ReplaceAll(o.phases, "libvirtscale", "")) == "" {
		return // the libvirtscale phase writes its own report
	}
	r.loads = append(r.loads, fmt.Sprintf("end %s: %s", time.Now().UTC().Format("15:04:05"), loadavg()))
	r.finished = time.Now().UTC()
	doc := r.render()
	if o.merge {
		if old, err := os.ReadFile(o.out); err == nil {
			doc = mergeReports(string(old), doc)
		}
	}
	if err := os.WriteFile(o.out, []byte(doc), 0o644); err != nil {
		fatal(err)
	}
	logf("wrote %s", o.out)
}

// libvirtScale runs the libvirtscale phase and writes its report to -ls-out.
func libvirtScale(ctx context.Context, env teststack.Env, o options) error {
	started, load := time.Now().UTC(), loadavg()
	res, err := runLibvirtScale(ctx, env, o)
	if err != nil {
		return err
	}
	res.started, res.finished = started, time.Now().UTC()
	res.loads = [2]string{load, loadavg()}
	res.machine = describeMachine(ctx)
	res.command = fmt.Sprintf("scripts/teststack up && eval \"$(scripts/teststack env)\"\ngo run ./cmd/bench -phases libvirtscale -runs %d -ls-instances %d -ls-foreign %d -ls-orphans %d -ls-callers %s -ls-creates %d -ls-rtts %s -ls-out %s",
		o.runs, o.lsInstances, o.lsForeign, o.lsOrphans, joinInts(o.lsCallers), o.lsCreates, o.lsRTTs, o.lsOut)
	if err := writeLibvirtScale(o.lsOut, res); err != nil {
		return err
	}
	logf("wrote %s", o.lsOut)
	return nil
}

// runPhase runs one phase and keeps its figures in r (the libvirtscale
// phase writes its own report).
func runPhase(ctx context.Context, env teststack.Env, o options, r *report, ph string) error {
	var err error
	switch ph {
	case "upload":
		r.upload, err = runUpload(ctx, env, o)
	case "control":
		r.control, err = runControl(ctx, env, o)
	case "scale":
		r.scale, err = runScale(ctx, env, o)
	case "health":
		r.health, err = runHealth(ctx, env, o)
	case "rtt":
		r.rtt, err = runRTT(ctx, env, o)
	case "lab":
		r.lab, err = runLab(ctx, env, o)
	case "fanout":
		r.fanout, err = runFanout(ctx, env, o)
	case "libvirtscale":
		err = libvirtScale(ctx, env, o)
	case "":
	default:
		err = fmt.Errorf("unknown phase %q", ph)
	}
	return err
}

// parseCallers reads -ls-callers into o.
func parseCallers(s string, o *options) error {
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return fmt.Errorf("-ls-callers %q: bad count %q", s, f)
		}
		o.lsCallers = append(o.lsCallers, n)
	}
	return nil
}

func joinInts(xs []int) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = strconv.Itoa(x)
	}
	return strings.Join(s, ",")
}

// childOf is the internal child the flags ask for (-fanout-child,
// -grow-child, -fetch-child), nil for none.
func childOf(fanout, grow, fetch bool) func(context.Context, teststack.Env, options) error {
	switch {
	case fanout:
		return fanoutChild
	case grow:
		return func(ctx context.Context, _ teststack.Env, o options) error { return growChild(ctx, o) }
	case fetch:
		return fetchChild
	}
	return nil
}

type options struct {
	out, scale, phases, analysis, command string
	runs, imageMiB, gets, probes          int
	url, sum, entry                       string
	targets, cpuprofile, memprofile       string
	memstats                              bool
	heapAt                                time.Duration
	labRates, createsRate                 string
	labHosts, labRuns, rttMS, rttList     int
	keepLab, merge, createsOnly           bool
	fanoutGrowOnly                        bool
	fanoutHosts, fanoutMiB, fanoutRuns    int
	fanoutRate, fanoutMirrorRate          string
	fanoutGrowRate, fanoutGrowMirrorRate  string
	holder                                string
	noFanout                              bool
	lsInstances, lsForeign, lsOrphans     int
	lsCallers                             []int
	lsCreates                             int
	lsRTTs, lsOut                         string
}

// target is one cold fetch of a -fetch-child with -targets.
type target struct {
	Env   teststack.Env
	Entry string
}

// fetchChild runs the cold fetch(es) of a -fetch-child and prints the
// results as JSON: one FetchResult for the stack, a list of them (in the
// order of -targets) with -targets, all fetched at once.
func fetchChild(ctx context.Context, env teststack.Env, o options) error {
	if o.cpuprofile != "" {
		f, err := os.Create(o.cpuprofile)
		if err != nil {
			return err
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			f.Close()
			return err
		}
		defer func() { pprof.StopCPUProfile(); f.Close() }()
	}
	if o.memprofile != "" && o.heapAt > 0 {
		t := time.AfterFunc(o.heapAt, func() {
			if err := writeHeapProfile(o.memprofile + ".inuse"); err != nil {
				logf("fetch child: %v", err)
			}
		})
		defer t.Stop()
	}
	if o.memprofile != "" {
		defer func() {
			if err := writeAllocProfile(o.memprofile); err != nil {
				logf("fetch child: %v", err)
			}
		}()
	}
	if o.memstats {
		stop := sampleMem()
		defer func() { logf("memstats %s", stop()) }()
	}
	if o.targets == "" {
		res, err := benchutil.LibraryFetch(ctx, env, o.entry, "bench", o.url, o.sum, true)
		if err != nil {
			return err
		}
		return json.NewEncoder(os.Stdout).Encode(res)
	}
	var ts []target
	if err := json.Unmarshal([]byte(o.targets), &ts); err != nil {
		return fmt.Errorf("-targets: %w", err)
	}
	res := make([]benchutil.FetchResult, len(ts))
	errs := make([]error, len(ts))
	var wg sync.WaitGroup
	for i, t := range ts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res[i], errs[i] = benchutil.LibraryFetch(ctx, t.Env, t.Entry, "bench", o.url, o.sum, true)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(res)
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "bench: "+format+"\n", args...)
}

func fatal(err error) {
	fmt.Fprintf(os.Stderr, "bench: %v\n", err)
	os.Exit(1)
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}
