package main

import (
	"encoding/json"
	"encoding/xml"
	"errors"
	"io"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// plotRuns are four runs with every figure the plot draws.
func plotRuns() []*runResult {
	var runs []*runResult
	for i, n := range []int{200, 500, 2000, 5000} {
		x := float64(n)
		runs = append(runs, &runResult{
			N: n, M: n / 100,
			ConvergeS: 10 + x/60, RunningS: 9 + x/60, CPUCores: 0.0001 * x, RSSMiB: 50 + x/40,
			Goroutines: x + 100, APIPerSTotal: 0.2 + x/1300, CallsPerSEntry: 1.7, RoundS: 0.03 + x/5400,
			FreshAfterExpiry: 14 + float64(i*i)*14, APIPerS: map[string]float64{"GET": 1},
		})
	}
	return runs
}

// checkSVG decodes the plot as XML and checks what makes it readable:
// sans-serif text of at least 11px.
func checkSVG(t *testing.T, svg []byte) {
	t.Helper()
	d := xml.NewDecoder(strings.NewReader(string(svg)))
	texts := 0
	for {
		tok, err := d.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("the plot is not XML: %v", err)
		}
		el, ok := tok.(xml.StartElement)
		if !ok {
			continue
		}
		for _, a := range el.Attr {
			switch a.Name.Local {
			case "font-family":
				if a.Value != "sans-serif" {
					t.Errorf("font-family %q", a.Value)
				}
			case "font-size":
				if v, err := strconv.Atoi(a.Value); err != nil || v < 11 {
					t.Errorf("font-size %q: want 11 or more", a.Value)
				}
			}
		}
		if el.Name.Local == "svg" && (el.Name.Space != "http://www.w3.org/2000/svg" || !strings.Contains(string(svg[:200]), `font-family="sans-serif"`)) {
			t.Errorf("the root: %+v", el)
		}
		if el.Name.Local == "text" {
			texts++
		}
	}
	if texts == 0 {
		t.Error("the plot has no text")
	}
}

// The same runs give the same bytes, whatever their order and after the
// report's JSON round trip; each figure gets a panel, the targets their
// line, and the result is XML.
func TestPlotDeterministic(t *testing.T) {
	r := &report{Runs: plotRuns()}
	svg, ok := r.plot()
	if !ok {
		t.Fatal("no plot of four runs")
	}
	checkSVG(t, svg)
	if again, _ := r.plot(); string(again) != string(svg) {
		t.Error("a second plot of the same runs differs")
	}
	js, err := json.Marshal(r.Runs)
	if err != nil {
		t.Fatal(err)
	}
	var back []*runResult
	if err := json.Unmarshal(js, &back); err != nil {
		t.Fatal(err)
	}
	back[0], back[3] = back[3], back[0]
	if other, _ := (&report{Runs: back}).plot(); string(other) != string(svg) {
		t.Error("the runs read back, in another order, plot differently")
	}
	if got := strings.Count(string(svg), "<g>"); got != len(figures) {
		t.Errorf("%d panels, want one per figure (%d)", got, len(figures))
	}
	if got := strings.Count(string(svg), styleTarget+"/>"); got != len(plotTargets)+1 { // and the legend's
		t.Errorf("%d target lines, want %d", got, len(plotTargets)+1)
	}
	for _, s := range []string{"target ≤ 120 s", "b = 1.00; in cores", "<title>N=5000: 5100</title>", "<title>N=200: 13.3 s</title>"} {
		if !strings.Contains(string(svg), s) {
			t.Errorf("the plot lacks %q", s)
		}
	}
}

// A point lands where its logarithm puts it: runs at N = 100, 1,000 and
// 10,000 of 1, 10 and 100 s span the first panel's plot area (x 58 to
// 344, y 284 to 126) less the 4% margins, with 1,000 at the centre.
func TestPlotPositions(t *testing.T) {
	a := newLogAxis(100, 10000, 0, 216)
	for v, want := range map[float64]float64{100: 8, 1000: 108, 10000: 208} {
		if got := a.pos(v); math.Abs(got-want) > 1e-9 {
			t.Errorf("pos(%v) = %v, want %v", v, got, want)
		}
	}
	r := &report{Runs: []*runResult{{N: 1000, RunningS: 10}, {N: 100, RunningS: 1}, {N: 10000, RunningS: 100}}}
	svg, ok := r.plot()
	if !ok {
		t.Fatal("no plot")
	}
	checkSVG(t, svg)
	// Margins: 0.08/2.16 of the span, 10.6 of 286 px and 5.9 of 158.
	for _, s := range []string{
		`<circle cx="68.6" cy="278.1" r="3.5" fill="#1f5fa8"><title>N=100: 1.0 s</title></circle>`,
		`<circle cx="201.0" cy="205.0" r="3.5" fill="#1f5fa8"><title>N=1000: 10.0 s</title></circle>`,
		`<circle cx="333.4" cy="131.9" r="3.5" fill="#1f5fa8"><title>N=10000: 100.0 s</title></circle>`,
		`<text x="201.0" y="299.0" font-size="11" text-anchor="middle">1000</text>`, // the x tick at 1,000
		`<text x="53.0" y="209.0" font-size="11" text-anchor="end">10</text>`,       // the y tick at 10
		// The fit and the linear reference are both N/100 here.
		`<line x1="68.6" y1="278.1" x2="333.4" y2="131.9"` + styleFit + `/>`,
		`<line x1="68.6" y1="278.1" x2="333.4" y2="131.9"` + styleLinear + `/>`,
	} {
		if !strings.Contains(string(svg), s) {
			t.Errorf("the plot lacks %s", s)
		}
	}
	if got := strings.Count(string(svg), "<g>"); got != 1 {
		t.Errorf("%d panels, want the one figure with values", got)
	}
}

// A figure measured at one N has no panel; runs at one N have no plot,
// and writeReport then links none and removes an earlier one.
func TestPlotOneN(t *testing.T) {
	runs := plotRuns()[:2]
	runs[0].FreshAfterExpiry = 0
	svg, ok := (&report{Runs: runs}).plot()
	if !ok {
		t.Fatal("no plot")
	}
	if strings.Contains(string(svg), "failover") {
		t.Error("a panel for the failover, measured at one N")
	}
	if !strings.Contains(string(svg), ">converge (all Healthy)<") {
		t.Error("no panel for the time to converge")
	}
	if got := strings.Count(string(svg), "<g>"); got != len(figures)-1 {
		t.Errorf("%d panels, want %d", got, len(figures)-1)
	}
	// Not measured at one N of three: a panel of the other two.
	runs = plotRuns()[:3]
	runs[0].FreshAfterExpiry = 0
	svg, _ = (&report{Runs: runs}).plot()
	if !strings.Contains(string(svg), ">failover: every status fresh after the") || strings.Contains(string(svg), "<title>N=200: 0.0 s</title>") {
		t.Error("the failover measured at two N of three: no panel, or a point at 0")
	}
	if strings.Contains(string(svg), "Inf") || strings.Contains(string(svg), "NaN") {
		t.Error("a coordinate is not a number")
	}
	if _, ok := (&report{Runs: []*runResult{{N: 200, ConvergeS: 9}, {N: 200, M: 2, ConvergeS: 10}}}).plot(); ok {
		t.Error("a plot of runs at one N")
	}

	dir := t.TempDir()
	md := filepath.Join(dir, "scale.md")
	if err := writeReport(md, &report{Runs: plotRuns()}); err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(md)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(doc), "\n\n![growth](scale.svg)\n\n## Targets") {
		t.Error("the report does not link its plot at the end of Growth")
	}
	written, err := os.ReadFile(filepath.Join(dir, "scale.svg"))
	if err != nil {
		t.Fatal(err)
	}
	if want, _ := (&report{Runs: plotRuns()}).plot(); string(written) != string(want) {
		t.Error("writeReport wrote another plot")
	}
	if err := writeReport(md, &report{Runs: plotRuns()[:1]}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "scale.svg")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the plot of earlier runs is left: %v", err)
	}
	if doc, _ := os.ReadFile(md); strings.Contains(string(doc), "![growth]") {
		t.Error("a report of one run links a plot")
	}
}

var missedAt5000 = regexp.MustCompile(`\| MISSED: [^|]* at N=5,000 \|`)

// The plot's targets are the report's: a run at N = 5,000 at a target
// meets it, one 1% over misses it; and each names a figure.
func TestPlotTargets(t *testing.T) {
	byName := map[string]figure{}
	for _, f := range figures {
		byName[f.name] = f
	}
	// The figures' fields, by the figure's getter.
	fields := map[string]string{}
	probe := &runResult{}
	rv := reflect.ValueOf(probe).Elem()
	for name, f := range byName {
		for i := 0; i < rv.NumField(); i++ {
			if fv := rv.Field(i); fv.Kind() == reflect.Float64 {
				fv.SetFloat(1)
				if f.get(probe) == 1 {
					fields[name] = rv.Type().Field(i).Name
				}
				fv.SetFloat(0)
			}
		}
	}
	for name, pt := range plotTargets {
		if _, ok := byName[name]; !ok {
			t.Errorf("target %q names no figure", name)
			continue
		}
		missed := func(v float64) int {
			run := &runResult{N: 5000, M: 50}
			reflect.ValueOf(run).Elem().FieldByName(fields[name]).SetFloat(v)
			return len(missedAt5000.FindAllString((&report{Runs: []*runResult{run}}).render(), -1))
		}
		if got := missed(pt.max); got != 0 {
			t.Errorf("%s at the plot's target %v: %d target(s) missed in the report", name, pt.max, got)
		}
		if got := missed(pt.max * 1.01); got != 1 {
			t.Errorf("%s 1%% over the plot's target %v: %d target(s) missed in the report, want 1", name, pt.max, got)
		}
	}
}

// Ticks: 1, 2 and 5 of each decade; only the decades over a wide range;
// every digit in a narrow one.
func TestPlotTicks(t *testing.T) {
	for _, c := range []struct {
		min, max float64
		want     []float64
	}{
		{200, 5000, []float64{200, 500, 1000, 2000, 5000}},
		{0.01, 1000, []float64{0.01, 0.1, 1, 10, 100, 1000}},
		{3, 4, []float64{3, 4}},
		{0.03, 0.9, []float64{0.05, 0.1, 0.2, 0.5, 1}}, // 0.9 and 4% of the span reach 1
	} {
		if got := newLogAxis(c.min, c.max, 0, 100).ticks(); !reflect.DeepEqual(got, c.want) {
			t.Errorf("ticks(%v, %v) = %v, want %v", c.min, c.max, got, c.want)
		}
	}
	if got := fmtTick(0.1 * 3); got != "0.3" {
		t.Errorf("fmtTick(0.1*3) = %q", got)
	}
	if got := wrapWords("failover: every status fresh after the Lease expired", titleChars); len(got) != 2 {
		t.Errorf("the longest title wraps to %q", got)
	}
}
