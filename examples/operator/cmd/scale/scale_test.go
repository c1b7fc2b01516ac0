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
	if _, err := parseRuns("200:2,5:7"); err == nil {
		t.Error("-runs 5:7 (more entries than objects) accepted")
	}
}
