package main

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"runtime"
	"sort"
	"strings"
	"time"
)

// report is docs/scale.md: the command, the machine, every run, the
// growth between runs and the targets.
type report struct {
	Command        string
	CallDelay      time.Duration
	Rest           time.Duration
	HealthInterval time.Duration
	Machine        []string
	Note           string
	Analysis       string // hand-written reading, appended
	Runs           []*runResult
	Plot           string // the growth plot's file, beside the report (plot.go); "" for none
	LibvirtWall    string // the libvirt report's List of 1,000 at 50 ms (libvirt.go); "" for none
	LibvirtVerdict string // that row's target cell
}

// add puts res in place of an earlier run of the same N and M.
func (r *report) add(res *runResult) {
	for i, x := range r.Runs {
		if x.N == res.N && x.M == res.M {
			r.Runs[i] = res
			return
		}
	}
	r.Runs = append(r.Runs, res)
	sortRuns(r.Runs)
}

const (
	runsBegin = "<!-- scale-runs (read by cmd/scale -merge)"
	runsEnd   = "-->"
)

// readRuns reads the runs stored at the end of a report.
func readRuns(path string) ([]*runResult, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	_, rest, ok := strings.Cut(string(b), runsBegin)
	if !ok {
		return nil, fmt.Errorf("%s holds no runs", path)
	}
	js, _, ok := strings.Cut(rest, runsEnd)
	if !ok {
		return nil, fmt.Errorf("%s: the runs are not closed", path)
	}
	var runs []*runResult
	if err := json.Unmarshal([]byte(js), &runs); err != nil {
		return nil, fmt.Errorf("%s: the runs: %w", path, err)
	}
	return runs, nil
}

func firstLine(name string, args ...string) string {
	out, err := exec.Command(name, args...).Output()
	if err != nil {
		return "?"
	}
	line, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
	return line
}

func describeMachine() []string {
	cpu := "?"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "model name"); ok {
				cpu = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(v), ":"))
				break
			}
		}
	}
	mem := "?"
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		l, _, _ := strings.Cut(string(b), "\n")
		mem = strings.Join(strings.Fields(strings.TrimPrefix(l, "MemTotal:")), " ")
	}
	return []string{
		fmt.Sprintf("nproc: %d; CPU: %s", runtime.NumCPU(), cpu),
		"memory: " + mem,
		"kernel: " + firstLine("uname", "-sr"),
		"go: " + runtime.Version() + " " + runtime.GOOS + "/" + runtime.GOARCH,
	}
}

// fit is the least-squares power law f = a·N^b through the runs' points
// (positive ones only); ok is false with fewer than two.
func fit(runs []*runResult, f func(*runResult) float64) (a, b float64, ok bool) {
	var xs, ys []float64
	for _, r := range runs {
		if v := f(r); v > 0 {
			xs, ys = append(xs, math.Log(float64(r.N))), append(ys, math.Log(v))
		}
	}
	n := float64(len(xs))
	if n < 2 {
		return 0, 0, false
	}
	var sx, sy, sxx, sxy float64
	for i := range xs {
		sx, sy, sxx, sxy = sx+xs[i], sy+ys[i], sxx+xs[i]*xs[i], sxy+xs[i]*ys[i]
	}
	den := n*sxx - sx*sx
	if den == 0 {
		return 0, 0, false
	}
	b = (n*sxy - sx*sy) / den
	a = math.Exp((sy - b*sx) / n)
	return a, b, true
}

// line is the least-squares straight line f = c + k·N through the runs'
// points, the extrapolation the report gives at 5,000 (a figure with a
// part that does not grow, such as the health intervals in the time to
// converge, and a part that does is what a power law through two points
// misjudges); ok is false with fewer than two runs.
func line(runs []*runResult, f func(*runResult) float64) (c, k float64, ok bool) {
	var n, sx, sy, sxx, sxy float64
	for _, r := range runs {
		x, y := float64(r.N), f(r)
		n, sx, sy, sxx, sxy = n+1, sx+x, sy+y, sxx+x*x, sxy+x*y
	}
	den := n*sxx - sx*sx
	if n < 2 || den == 0 {
		return 0, 0, false
	}
	k = (n*sxy - sx*sy) / den
	return (sy - k*sx) / n, k, true
}

// at5000 is the straight line's value at N = 5,000.
func at5000(runs []*runResult, f func(*runResult) float64) (float64, bool) {
	c, k, ok := line(runs, f)
	return c + k*5000, ok
}

// pairExponent is the growth exponent between two runs: ln(f(b)/f(a)) /
// ln(N(b)/N(a)); ok is false when a figure is not positive or the N are
// equal.
func pairExponent(a, b *runResult, f func(*runResult) float64) (float64, bool) {
	fa, fb := f(a), f(b)
	if fa <= 0 || fb <= 0 || a.N == b.N {
		return 0, false
	}
	return math.Log(fb/fa) / math.Log(float64(b.N)/float64(a.N)), true
}

// figure is one measured quantity of a run.
type figure struct {
	name, unit string
	get        func(*runResult) float64
	format     string
	// floor is the smallest reference -check judges the figure against:
	// below it, a figure is noise (a scheduler's hiccup doubles a 30 ms
	// round or a CPU share of a few thousandths of a core), not a
	// regression. Zero: none.
	floor float64
}

var figures = []figure{
	{"converge (all Healthy)", "s", func(r *runResult) float64 { return r.ConvergeS }, "%.1f", 0},
	{"all Running", "s", func(r *runResult) float64 { return r.RunningS }, "%.1f", 0},
	{"CPU at rest", "cores", func(r *runResult) float64 { return r.CPUCores }, "%.3f", 0.05},
	{"RSS at rest", "MiB", func(r *runResult) float64 { return r.RSSMiB }, "%.0f", 0},
	{"goroutines at rest", "", func(r *runResult) float64 { return r.Goroutines }, "%.0f", 0},
	{"apiserver requests at rest", "/s", func(r *runResult) float64 { return r.APIPerSTotal }, "%.2f", 0},
	{"library calls at rest, per entry", "/s", func(r *runResult) float64 { return r.CallsPerSEntry }, "%.2f", 0},
	{"health round", "s", func(r *runResult) float64 { return r.RoundS }, "%.3f", 0.25},
	{"failover: every status fresh after the Lease expired", "s", func(r *runResult) float64 { return r.FreshAfterExpiry }, "%.1f", 0},
}

// sinceKill formats a failover figure of x, "—" for a run without it.
func sinceKill(x *runResult, v float64) string {
	if !x.MemoryHost || v == 0 {
		return "—"
	}
	return fmt.Sprintf("%.1f s", v)
}

func (r *report) render() string {
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	sortRuns(r.Runs)
	p("# How the operator scales")
	p("")
	p("Generated by `cmd/scale` (examples/operator/cmd/scale) — do not edit by hand: rerun the command. Each run starts a real")
	p("kube-apiserver and etcd (envtest, the binaries of scripts/kubestack), installs the CRDs and the operator's ClusterRole,")
	p("creates N `EgressProxy` objects spread round-robin over M memory entries, and runs the real operator binary (built as")
	p("its image has it) as a process with the RBAC user of config/rbac. The memory entries are served by a memory host")
	p("(examples/operator/internal/memhost) in the bench's own process: each a memprovider whose every call waits the")
	p("simulated round trip (`memprovider.Options.CallDelay`) and whose VMs are real CONNECT proxies on 127.0.0.1; the")
	p("operator reaches them over HTTP on loopback (`memoryEntries` of its entries file, each with the host's `endpoint`).")
	p("Like a kvm2 entry's VMs on their hypervisors, they outlive the operator, and both replicas see the same ones. The")
	p("operator's own figures (CPU, RSS, goroutines) therefore leave the VMs' proxies out. Issue 36 asks for these figures;")
	p("its targets are for N = 5,000 over M = 50 entries at 50 ms.")
	p("kvm2 itself on a real libvirtd with 1,000 instances (List, Get, orphan collection, Create/Delete throughput): [scale-libvirt.md](scale-libvirt.md).")
	p("")
	p("## Command")
	p("")
	p("```sh")
	p("cd examples/operator && eval \"$(../../scripts/kubestack env)\"")
	p("%s", r.Command)
	p("```")
	p("")
	rest := r.restWindows()
	p("Call delay %v; at-rest window %s; the operator's `--health-interval` %v, its other flags at their", r.CallDelay, rest, r.HealthInterval)
	p("defaults unless the command says otherwise (`--poll-interval` 15s: a Running object is read back every 60s; the")
	p("reconcile workers of each run are in its table). A new proxy needs two successful probes (the tracker's Rise); the")
	p("operator probes a proxy registered anew every second until it is decided (`HealthOptions.NewProxyInterval`).")
	p("")
	p("## CI variant")
	p("")
	p("`make scale-short` (part of `make test`, docs/ci.md) runs `go run ./cmd/scale -check ../../docs/scale.md`: one run of")
	p("N = 200 over M = 2 entries with short windows (`-rest 15s -settle 2s -health-interval 15s`: the window must hold a")
	p("health round, and a shorter interval than the documented runs' adds requests and CPU per round), no failover (at")
	p("N = 200 it alone takes ~30 s, beyond the minute). It prints each other figure of the Growth table beside the stored")
	p("run's figure at the nearest N (by ratio), scaled linearly by 200 / that N (the stricter scaling downward, and the one")
	p("the report extrapolates with; with the N = 200 run stored the factor is 1), and exits non-zero naming every figure more")
	p("than 2× worse, or without a reference or a measurement. A figure whose reference is below its floor is judged against")
	p("the floor instead (health round 0.25 s, CPU at rest 0.05 cores): below those, a scheduler's hiccup doubles a figure. It")
	p("writes nothing.")
	p("")
	p("## Machine")
	p("")
	for _, m := range r.Machine {
		p("- %s", m)
	}
	if r.Note != "" {
		p("- %s", r.Note)
	}
	p("- load average (1/5/15 min) at each run's start and end:")
	for _, x := range r.Runs {
		p("  - N=%d M=%d, %s UTC: %s → %s", x.N, x.M, x.Start.Format("2006-01-02 15:04"), x.Load, x.LoadEnd)
	}
	p("")
	p("## Runs")
	p("")
	hdr := "| figure |"
	sep := "| --- |"
	for _, x := range r.Runs {
		hdr += fmt.Sprintf(" N=%d, M=%d |", x.N, x.M)
		sep += " ---: |"
	}
	p("%s", hdr)
	p("%s", sep)
	row := func(name string, f func(*runResult) string) {
		line := "| " + name + " |"
		for _, x := range r.Runs {
			line += " " + f(x) + " |"
		}
		p("%s", line)
	}
	row("converge: from operator start, every object Running", func(x *runResult) string { return fmt.Sprintf("%.1f s", x.RunningS) })
	row("converge: from operator start, every object Running and Healthy", func(x *runResult) string { return fmt.Sprintf("%.1f s", x.ConvergeS) })
	row("reconcile workers (`controller_runtime_max_concurrent_reconciles`)", func(x *runResult) string {
		if x.Workers == 0 {
			return "not recorded"
		}
		return fmt.Sprintf("%.0f", x.Workers)
	})
	row("at rest: window", func(x *runResult) string { return fmt.Sprintf("%.0f s", x.RestS) })
	row("at rest: operator CPU", func(x *runResult) string { return fmt.Sprintf("%.3f cores", x.CPUCores) })
	row("at rest: operator RSS (largest sample)", func(x *runResult) string { return fmt.Sprintf("%.0f MiB", x.RSSMiB) })
	row("at rest: goroutines (largest sample)", func(x *runResult) string { return fmt.Sprintf("%.0f", x.Goroutines) })
	row("at rest: apiserver requests of the leader", func(x *runResult) string { return fmt.Sprintf("%.2f/s", x.APIPerSTotal) })
	row("… by verb", func(x *runResult) string { return byKey(x.APIPerS, "%.2f") })
	row("at rest: apiserver requests of the standby", func(x *runResult) string { return fmt.Sprintf("%.2f/s", x.StandbyAPIPerS) })
	row("at rest: library calls per entry (mean; busiest)", func(x *runResult) string {
		return fmt.Sprintf("%.2f/s; %.2f/s", x.CallsPerSEntry, x.CallsPerSMax)
	})
	row("… all entries, by operation", func(x *runResult) string { return byKey(x.CallsByOp, "%.2f") })
	row("health round of all proxies: wall time (mean; rounds in the window)", func(x *runResult) string {
		return fmt.Sprintf("%.3f s (%d)", x.RoundS, x.Rounds)
	})
	row("health round: proxies; probes per second", func(x *runResult) string { return fmt.Sprintf("%.0f; %.0f/s", x.RoundProxies, x.ProbesPerS) })
	row("failover: Lease duration", func(x *runResult) string { return fmt.Sprintf("%.0f s", x.LeaseDurationS) })
	row("failover: the Lease expired (after the kill)", func(x *runResult) string { return fmt.Sprintf("%.1f s", x.LeaseExpiryS) })
	row("failover: the standby took the Lease (after the kill)", func(x *runResult) string { return fmt.Sprintf("%.1f s", x.LeaseTakenS) })
	row("failover: the new leader reconciled every object (after the kill)", func(x *runResult) string { return sinceKill(x, x.ReconciledS) })
	row("failover: the new leader decided every proxy healthy (after the kill)", func(x *runResult) string { return sinceKill(x, x.DecidedS) })
	row("failover: every status fresh (after the kill)", func(x *runResult) string { return fmt.Sprintf("%.1f s", x.FreshS) })
	row("failover: every status fresh (after the Lease expired)", func(x *runResult) string { return fmt.Sprintf("%.1f s", x.FreshAfterExpiry) })
	row("failover: the new leader's status writes (PATCH); library Creates", func(x *runResult) string {
		if !x.MemoryHost {
			return "—"
		}
		return fmt.Sprintf("%.0f; %.0f", x.FailoverPatches, x.FailoverCreates)
	})
	p("")
	p("Sources: CPU from `/proc/PID/stat` (utime+stime over the window), RSS from `/proc/PID/status`; goroutines")
	p("(`go_goroutines`), apiserver requests (client-go's `rest_client_requests_total`, by `method`), library calls")
	p("(`egressproxy_client_operation_duration_seconds_count`, by `egressproxy_entry` and `egressproxy_operation`) and health")
	p("rounds (`egressproxy_operator_health_round_duration_seconds`, `…_round_proxies`) from the operator's `/metrics`.")
	p("Fresh after a failover: the standby holds the Lease; it has reconciled every object (its")
	p("`controller_runtime_reconcile_total` of the egressproxy controller has reached N: it reconciles nothing before it")
	p("leads); its own tracker has probed every proxy and decided it healthy (`egressproxy_operator_health_proxies`, state")
	p("healthy, has reached N: two successful probes each, the tracker's Rise); and every object's status is Running and")
	p("Healthy. The VMs survive the killed leader on the memory host, so the new leader finds them (its Creates: 0 when")
	p("every VM was found) and, as its health tracker starts empty, keeps the health in status until it has decided")
	p("(its status writes: 0 when nothing changed).")
	p("")
	p("## Growth")
	p("")
	p("Each figure's growth as the exponent b of a·N^b fitted over the runs (least squares on log-log; b ≤ 1 is at most")
	p("linear), and its value at N = 5,000 on the straight line c + k·N fitted over the runs (the extrapolation the targets")
	p("use: a figure with a constant part, such as the health intervals in the time to converge, is linear plus a constant,")
	p("which the power law misjudges).")
	p("")
	p("The b of each pair of consecutive runs (ln of the ratio of the figures over ln of the ratio of the N) shows where")
	p("a figure grows faster than linearly even when the fit over all runs does not.")
	p("")
	hdr, sep = "| figure | b | c + k·N at N=5,000 |", "| --- | ---: | ---: |"
	for i := 1; i < len(r.Runs); i++ {
		hdr += fmt.Sprintf(" b %d → %d |", r.Runs[i-1].N, r.Runs[i].N)
		sep += " ---: |"
	}
	p("%s", hdr)
	p("%s", sep)
	for _, f := range figures {
		_, bb, ok := fit(r.Runs, f.get)
		v, ok2 := at5000(r.Runs, f.get)
		line := fmt.Sprintf("| %s | — | — |", f.name)
		if ok && ok2 {
			line = fmt.Sprintf("| %s | %.2f | %s %s |", f.name, bb, fmt.Sprintf(f.format, v), f.unit)
		}
		for i := 1; i < len(r.Runs); i++ {
			if b, ok := pairExponent(r.Runs[i-1], r.Runs[i], f.get); ok {
				line += fmt.Sprintf(" %.2f |", b)
			} else {
				line += " — |"
			}
		}
		p("%s", line)
	}
	p("")
	r.renderPlotLink(p)
	r.renderTargets(p)
	if r.Analysis != "" {
		p("")
		p("%s", strings.TrimSpace(r.Analysis))
	}
	p("")
	p("%s", runsBegin)
	js, _ := json.MarshalIndent(r.Runs, "", " ")
	p("%s", js)
	p("%s", runsEnd)
	return b.String()
}

// byKey formats m as "k v, …" sorted by key.
func byKey(m map[string]float64, format string) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, k+" "+fmt.Sprintf(format, m[k]))
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

// target is one row of the table: its limit, and the figure a run
// is judged by (higher is worse).
type target struct {
	name, limit string
	max         float64
	get         func(*runResult) float64
	format      string
}

func (r *report) renderTargets(p func(string, ...any)) {
	p("## Targets (issue 36: N = 5,000 over M = 50 entries at 50 ms)")
	p("")
	var run5000 *runResult
	for _, x := range r.Runs {
		if x.N == 5000 {
			run5000 = x
		}
	}
	largest := r.Runs[len(r.Runs)-1]
	ns := make([]string, len(r.Runs))
	for i, x := range r.Runs {
		ns[i] = fmt.Sprint(x.N)
	}
	p("Runs at N = %s. %s", strings.Join(ns, ", "), func() string {
		if run5000 != nil {
			return "The verdicts are the N=5,000 run's."
		}
		return "No run at N = 5,000 (see the note under Machine for why). " +
			"A target not measured at 5,000 is MISSED for that reason; the row also gives the largest run's figure and what " +
			"the straight line through the runs gives at 5,000, so the next run on a larger machine knows what to expect."
	}())
	p("")
	p("| figure | target | largest run (N=%d) | c + k·N at 5,000 | verdict |", largest.N)
	p("| --- | --- | ---: | ---: | --- |")
	targets := []target{
		{"converge from operator start", "≤ 120 s", 120, func(x *runResult) float64 { return x.ConvergeS }, "%.1f s"},
		{"at rest: operator CPU", "≤ 0.3 core", 0.3, func(x *runResult) float64 { return x.CPUCores }, "%.3f cores"},
		{"at rest: operator RSS", "≤ 512 MiB", 512, func(x *runResult) float64 { return x.RSSMiB }, "%.0f MiB"},
		{"apiserver requests at rest", "≤ 20/s", 20, func(x *runResult) float64 { return x.APIPerSTotal }, "%.2f/s"},
		{"status writes at rest (PATCH)", "none when nothing changed", 0, func(x *runResult) float64 { return x.APIPerS["PATCH"] }, "%.3f/s"},
		{"health round of all", "≤ 10 s", 10, func(x *runResult) float64 { return x.RoundS }, "%.3f s"},
		{"failover to a converged second replica", "≤ 30 s after the Lease expires", 30, func(x *runResult) float64 { return x.FreshAfterExpiry }, "%.1f s"},
	}
	for _, t := range targets {
		v := t.get(largest)
		pred := "—"
		pv, ok := at5000(r.Runs, t.get)
		if ok {
			pred = fmt.Sprintf(t.format, pv)
		}
		var verdict string
		switch {
		case run5000 != nil && t.get(run5000) <= t.max:
			verdict = "MET"
		case run5000 != nil:
			verdict = "MISSED: " + fmt.Sprintf(t.format, t.get(run5000)) + " at N=5,000"
		default:
			verdict = "MISSED: not measured at N=5,000"
			switch {
			case t.max == 0 && v == 0:
				verdict += "; none in any run, whatever N"
			case t.max == 0:
				verdict += fmt.Sprintf("; already %s at N=%d", fmt.Sprintf(t.format, v), largest.N)
			case v > t.max:
				verdict += fmt.Sprintf("; already over at N=%d", largest.N)
			case ok && pv <= t.max:
				verdict += "; the line through the runs says it would be met"
			case ok:
				verdict += "; the line through the runs says it would be missed"
			}
		}
		p("| %s | %s | %s | %s | %s |", t.name, t.limit, fmt.Sprintf(t.format, v), pred, verdict)
	}
	// Growth is judged on every pair of consecutive runs from N=500 on:
	// a figure that grows faster than linearly anywhere in the range
	// misses it, however the fit over all runs comes out.
	growthOK, worst := true, ""
	for _, f := range figures {
		for i := 1; i < len(r.Runs); i++ {
			a, b := r.Runs[i-1], r.Runs[i]
			if a.N < 500 {
				continue
			}
			if e, ok := pairExponent(a, b, f.get); ok && e > 1.15 {
				growthOK = false
				worst += fmt.Sprintf("%s b=%.2f over %d → %d; ", f.name, e, a.N, b.N)
			}
		}
	}
	growth := fmt.Sprintf("MISSED: the runs reach N=%d, not 5,000", largest.N)
	if len(r.Runs) < 2 {
		growth = "MISSED: a single run has no growth"
	} else if growthOK {
		growth += fmt.Sprintf("; over %d → %d no figure grows faster than linearly between two runs (b ≤ 1.15, the noise allowed)", r.Runs[0].N, largest.N)
	} else {
		growth += "; over the runs: " + strings.TrimSuffix(worst, "; ")
	}
	if largest.N >= 5000 && r.Runs[0].N <= 500 && len(r.Runs) >= 2 {
		growth = "MET"
		if !growthOK {
			growth = "MISSED: " + strings.TrimSuffix(worst, "; ")
		}
	}
	p("| growth 500 → 5,000 | no figure grows faster than linearly in N | — | — | %s |", growth)
	p("%s", r.libvirtTarget())
}

// restWindows says which at-rest windows the runs used: one for all, or
// each N's when they differ (a run of -merge may have its own), with a
// word when none is the 5 minutes the issue asks for.
func (r *report) restWindows() string {
	var parts []string
	longest, same := 0.0, true
	for _, x := range r.Runs {
		parts = append(parts, fmt.Sprintf("%v at N=%d", time.Duration(math.Round(x.RestS))*time.Second, x.N))
		longest = max(longest, x.RestS)
		same = same && math.Round(x.RestS) == math.Round(r.Runs[0].RestS)
	}
	var s string
	switch {
	case len(r.Runs) == 0 || same && math.Round(r.Runs[0].RestS) == r.Rest.Seconds():
		s = fmt.Sprint(r.Rest)
		longest = max(longest, r.Rest.Seconds())
	case same:
		s = fmt.Sprint(time.Duration(math.Round(r.Runs[0].RestS)) * time.Second)
	default:
		s = strings.Join(parts, ", ")
	}
	if math.Round(longest) < (5 * time.Minute).Seconds() {
		s += " (the issue asks for 5 minutes; these runs used a shorter one)"
	}
	return s
}
