package main

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The exposition parser reads what the operator's /metrics serves:
// labels with escaped quotes and commas, exponents, no labels.
func TestParseExposition(t *testing.T) {
	const text = `# HELP go_goroutines Number of goroutines.
# TYPE go_goroutines gauge
go_goroutines 78
rest_client_requests_total{code="200",host="127.0.0.1:36789",method="GET"} 12
rest_client_requests_total{code="200",host="127.0.0.1:36789",method="PUT"} 3
egressproxy_client_operation_duration_seconds_count{egressproxy_entry="mem-000",egressproxy_operation="get",x="a\"b,c"} 1.5e+03
`
	ss, err := parseExposition(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	if got := value(ss, "go_goroutines"); got != 78 {
		t.Errorf("go_goroutines = %v, want 78", got)
	}
	if got := sumBy(ss, "rest_client_requests_total", "method"); got["GET"] != 12 || got["PUT"] != 3 || len(got) != 2 {
		t.Errorf("requests by method = %v", got)
	}
	got := sumBy(ss, "egressproxy_client_operation_duration_seconds_count", "x")
	if got[`a"b,c`] != 1500 {
		t.Errorf("escaped label value: %v", got)
	}
	if _, err := parseExposition(strings.NewReader("bad{x=\"1\" 2\n")); err == nil {
		t.Error("an unterminated label value parsed")
	}
}

// The fit finds the exponent of an exact power law, and needs two points.
func TestFit(t *testing.T) {
	runs := []*runResult{{N: 200, ConvergeS: 3 * math.Pow(200, 0.8)}, {N: 500, ConvergeS: 3 * math.Pow(500, 0.8)}, {N: 2000, ConvergeS: 3 * math.Pow(2000, 0.8)}}
	a, b, ok := fit(runs, func(r *runResult) float64 { return r.ConvergeS })
	if !ok || math.Abs(b-0.8) > 1e-9 || math.Abs(a-3) > 1e-6 {
		t.Errorf("fit = %v, %v, %v; want 3, 0.8", a, b, ok)
	}
	if _, _, ok := fit(runs[:1], func(r *runResult) float64 { return r.ConvergeS }); ok {
		t.Error("a fit through one point")
	}
	// The straight line: 60 s of health intervals plus 0.05 s per object.
	for _, r := range runs {
		r.RunningS = 60 + 0.05*float64(r.N)
	}
	if v, ok := at5000(runs, func(r *runResult) float64 { return r.RunningS }); !ok || math.Abs(v-310) > 1e-6 {
		t.Errorf("the line at 5,000 = %v, %v; want 310", v, ok)
	}
	// Between two runs: a figure 4 times larger at 4 times N grows by 1.
	ra, rb := &runResult{N: 500, RoundS: 0.1}, &runResult{N: 2000, RoundS: 0.4}
	if e, ok := pairExponent(ra, rb, func(r *runResult) float64 { return r.RoundS }); !ok || math.Abs(e-1) > 1e-9 {
		t.Errorf("pairExponent = %v, %v; want 1", e, ok)
	}
}

// The report stores its runs, and -merge reads them back; a run of the
// same N and M replaces the stored one.
func TestReportRuns(t *testing.T) {
	r := &report{Command: "go run ./cmd/scale", CallDelay: 50 * time.Millisecond, Rest: time.Minute}
	r.add(&runResult{N: 500, M: 5, ConvergeS: 80, APIPerS: map[string]float64{"GET": 1}})
	r.add(&runResult{N: 200, M: 2, ConvergeS: 60})
	path := filepath.Join(t.TempDir(), "scale.md")
	if err := os.WriteFile(path, []byte(r.render()), 0o644); err != nil {
		t.Fatal(err)
	}
	runs, err := readRuns(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(runs) != 2 || runs[0].N != 200 || runs[1].N != 500 || runs[1].APIPerS["GET"] != 1 {
		t.Fatalf("runs read back: %+v", runs)
	}
	r2 := &report{Runs: runs}
	r2.add(&runResult{N: 200, M: 2, ConvergeS: 61})
	if len(r2.Runs) != 2 || r2.Runs[0].ConvergeS != 61 {
		t.Errorf("after adding a run of the same size: %+v", r2.Runs)
	}
	if !strings.Contains(r.render(), "| converge from operator start | ≤ 120 s | 80.0 s |") {
		t.Errorf("the targets table does not judge the largest run:\n%s", r.render())
	}
	if !strings.Contains(r.render(), "## CI variant") {
		t.Error("the report does not describe its CI variant")
	}
	if _, err := parseRuns("200:2,5:7"); err == nil {
		t.Error("-runs 5:7 (more entries than objects) accepted")
	}
}

// -check fails a figure more than 2× its documented value scaled to the
// run's N, passes one under it, and reports a figure without a reference
// or a measurement instead of passing it.
func TestCompare(t *testing.T) {
	doc := []*runResult{
		{N: 200, CallDelayMS: 50, ConvergeS: 10, CPUCores: 0.01, RoundS: 0.02},
		{N: 2000, CallDelayMS: 50, ConvergeS: 30, CPUCores: 0.05, RoundS: 0.3, RSSMiB: 100},
	}
	figs := []figure{
		{"converge", "s", func(r *runResult) float64 { return r.ConvergeS }, "", 0},
		{"cpu", "cores", func(r *runResult) float64 { return r.CPUCores }, "", 0},
		{"rss", "MiB", func(r *runResult) float64 { return r.RSSMiB }, "", 0},
		{"goroutines", "", func(r *runResult) float64 { return r.Goroutines }, "", 0},
		{"round", "s", func(r *runResult) float64 { return r.RoundS }, "", 0},
	}
	got := &runResult{N: 200, CallDelayMS: 50, ConvergeS: 21, CPUCores: 0.019, RSSMiB: 15, Goroutines: 300}
	rows, failed := compare(doc, got, figs, 2)
	want := map[string]string{
		"converge": "more than 2×", // 2.1× the N=200 run
		"cpu":      "",             // 1.9×
		// The only run with RSS is N=2000: 100 MiB scaled linearly to
		// 10 MiB at N=200; 15 MiB is 1.5×.
		"rss":        "",
		"goroutines": "no documented figure",     // no run measured it
		"round":      "not measured by this run", // 0
	}
	if len(rows) != len(figs) {
		t.Fatalf("rows = %+v", rows)
	}
	for _, r := range rows {
		w := want[r.name]
		if (w == "") != (r.problem == "") || !strings.Contains(r.problem, w) {
			t.Errorf("%s: problem %q, want %q (ratio %.3f, ref %.4g from N=%d)", r.name, r.problem, w, r.ratio, r.ref, r.refN)
		}
	}
	if r := rows[0]; math.Abs(r.ratio-2.1) > 1e-9 || r.refN != 200 {
		t.Errorf("converge: ratio %v against N=%d, want 2.1 against N=200", r.ratio, r.refN)
	}
	if r := rows[2]; math.Abs(r.ref-10) > 1e-9 || r.refN != 2000 {
		t.Errorf("rss: reference %v from N=%d, want 10 from N=2000", r.ref, r.refN)
	}
	// A figure under its floor is judged against the floor: 3× a 20 ms
	// round is 0.24× a 250 ms floor; 0.6 s is more than 2× the floor.
	floored := []figure{{"round", "s", func(r *runResult) float64 { return r.RoundS }, "", 0.25}}
	if _, failed := compare(doc, &runResult{N: 200, CallDelayMS: 50, RoundS: 0.06}, floored, 2); len(failed) != 0 {
		t.Errorf("a round of 3x a reference under the floor failed: %q", failed)
	}
	if _, failed := compare(doc, &runResult{N: 200, CallDelayMS: 50, RoundS: 0.6}, floored, 2); len(failed) != 1 {
		t.Errorf("a round of more than 2x the floor passed")
	}
	if strings.Join(failed, ",") != "converge,goroutines,round" {
		t.Errorf("failed = %q", failed)
	}
	// The printout names every figure, its reference and its ratio.
	var b strings.Builder
	printCheck(&b, 200, 2, rows, 2)
	for _, s := range []string{"converge", "2.10×", "1.90×", "FAIL: no documented figure", "N=2000 run scaled by 200/2000"} {
		if !strings.Contains(b.String(), s) {
			t.Errorf("the printout lacks %q:\n%s", s, b.String())
		}
	}
	// Another call delay is not a reference.
	if _, _, ok := reference(doc, 200, 20, func(r *runResult) float64 { return r.ConvergeS }); ok {
		t.Error("a run at another call delay was taken as the reference")
	}
}

// The CI variant checks every figure of the report but the failover.
func TestCheckFigures(t *testing.T) {
	fs := checkFigures()
	if len(fs) != len(figures)-1 {
		t.Errorf("checkFigures: %d of %d", len(fs), len(figures))
	}
	for _, f := range fs {
		if strings.Contains(f.name, "failover") {
			t.Errorf("checks %s", f.name)
		}
	}
}

// The failover rows of a run on the memory host show how the new leader
// got fresh (reconciled, decided, its writes and Creates); a stored run
// from before the memory host, whose VMs died with the leader, shows "—"
// there rather than zeros that would read as measured.
func TestReportFailoverRows(t *testing.T) {
	r := &report{Command: "go run ./cmd/scale", CallDelay: 50 * time.Millisecond, Rest: time.Minute}
	r.add(&runResult{N: 200, M: 2, Failover: true, FreshS: 28.3})
	r.add(&runResult{N: 500, M: 5, Failover: true, MemoryHost: true, ReconciledS: 20, DecidedS: 22, FreshS: 22.1, FailoverPatches: 0, FailoverCreates: 0})
	out := r.render()
	for _, want := range []string{
		"| failover: the new leader reconciled every object (after the kill) | — | 20.0 s |",
		"| failover: the new leader decided every proxy healthy (after the kill) | — | 22.0 s |",
		"| failover: the new leader's status writes (PATCH); library Creates | — | 0; 0 |",
		"its own tracker has probed every proxy and decided it healthy",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("the report lacks %q:\n%s", want, out)
		}
	}
}
