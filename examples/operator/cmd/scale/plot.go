package main

import (
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// The growth plot beside the report (docs/scale.svg): one panel per figure
// with runs at two N or more, on log-log axes, with the runs, the fitted
// a·N^b, linear growth from the smallest run and the target. It is
// hand-written SVG, and the same runs give the same bytes.

// Geometry, in pixels: panels of panelW × panelH in plotCols columns
// under a header of headH; a panel's plot area is inset by the margins.
const (
	plotCols   = 3
	panelW     = 360
	panelH     = 260
	headH      = 64
	plotLeft   = 58 // the y tick labels
	plotRight  = 16
	plotTop    = 62 // the title (two lines) and the fit
	plotBottom = 40 // the x tick labels and the axis's name
	// logPad is each axis's margin beyond its extremes, as a share of its
	// span in decades.
	logPad = 0.04
	// A panel's title starts titleLeft from its edge, in lines of at most
	// titleChars (13px bold sans-serif is about 8px a character).
	titleLeft  = 14
	titleChars = 40
)

// plotTarget is a figure's limit at N = 5,000 (the targets table of
// renderTargets; TestPlotTargets holds the two to the same values).
type plotTarget struct {
	max   float64
	label string
}

var plotTargets = map[string]plotTarget{
	"converge (all Healthy)":     {120, "target ≤ 120 s"},
	"CPU at rest":                {0.3, "target ≤ 0.3 core"},
	"RSS at rest":                {512, "target ≤ 512 MiB"},
	"apiserver requests at rest": {20, "target ≤ 20/s"},
	"health round":               {10, "target ≤ 10 s"},
	"failover: every status fresh after the Lease expired": {30, "target ≤ 30 s"},
}

// plotPath is the plot's file beside the report: scale.md → scale.svg.
func plotPath(report string) string {
	return strings.TrimSuffix(report, ".md") + ".svg"
}

// writeReport writes the report to path and its growth plot beside it,
// which the report links; with no figure to plot it removes a plot left
// from earlier runs and links none.
func writeReport(path string, r *report) error {
	svgPath := plotPath(path)
	r.LibvirtWall, r.LibvirtVerdict, _ = libvirtList(path)
	r.Plot = ""
	if svg, ok := r.plot(); ok {
		if err := os.WriteFile(svgPath, svg, 0o644); err != nil {
			return err
		}
		r.Plot = filepath.Base(svgPath)
	} else if err := os.Remove(svgPath); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return os.WriteFile(path, []byte(r.render()), 0o644)
}

// renderPlotLink is the report's link to its plot, if it has one.
func (r *report) renderPlotLink(p func(string, ...any)) {
	if r.Plot != "" {
		p("![growth](%s)", r.Plot)
		p("")
	}
}

// logAxis maps a value to a pixel: lo and hi are the range's ends in
// decades (log10), at the pixels p0 and p1.
type logAxis struct{ lo, hi, p0, p1 float64 }

// newLogAxis spans min to max (both positive) with logPad beyond each.
func newLogAxis(min, max, p0, p1 float64) logAxis {
	lo, hi := math.Log10(min), math.Log10(max)
	span := hi - lo
	if span <= 0 {
		span = 1
		lo, hi = lo-0.5, hi+0.5
	}
	return logAxis{lo - logPad*span, hi + logPad*span, p0, p1}
}

func (a logAxis) pos(v float64) float64 {
	return a.p0 + (math.Log10(v)-a.lo)/(a.hi-a.lo)*(a.p1-a.p0)
}

// ticks are the axis's labelled values: 1, 2 and 5 times a power of ten
// in its range; only the powers of ten when those are more than seven;
// every digit when fewer than two; the range's ends when still fewer.
func (a logAxis) ticks() []float64 {
	if math.IsInf(a.lo, 0) || math.IsInf(a.hi, 0) || math.IsNaN(a.lo) || math.IsNaN(a.hi) || a.hi-a.lo > 30 {
		return nil // not an axis of positive values
	}
	for _, ms := range [][]float64{{1, 2, 5}, {1, 2, 3, 4, 5, 6, 7, 8, 9}} {
		var out []float64
		for k := math.Floor(a.lo); k <= math.Ceil(a.hi); k++ {
			for _, m := range ms {
				v := roundSig(m * math.Pow(10, k))
				if l := math.Log10(v); l >= a.lo && l <= a.hi {
					out = append(out, v)
				}
			}
		}
		if len(out) > 7 {
			var tens []float64
			for _, v := range out {
				if m := v / math.Pow(10, math.Floor(math.Log10(v))); math.Abs(m-1) < 1e-9 {
					tens = append(tens, v)
				}
			}
			if len(tens) >= 2 {
				return tens
			}
		}
		if len(out) >= 2 {
			return out
		}
	}
	return []float64{roundSig(math.Pow(10, a.lo)), roundSig(math.Pow(10, a.hi))}
}

// roundSig rounds v to three significant digits (1e-5 · 5 is not 5e-5 in
// floating point).
func roundSig(v float64) float64 {
	r, _ := strconv.ParseFloat(strconv.FormatFloat(v, 'g', 3, 64), 64)
	return r
}

// fmtTick is a tick's label: 0.05, 200, 5000.
func fmtTick(v float64) string { return strconv.FormatFloat(roundSig(v), 'f', -1, 64) }

// px formats a coordinate.
func px(v float64) string { return strconv.FormatFloat(v, 'f', 1, 64) }

// panel is one figure's plot: its runs' positive points and its fit.
type panel struct {
	f      figure
	ns, vs []float64
	a, b   float64
	target *plotTarget
}

// panels are the figures with positive values at two N or more, in the
// order of figures.
func panels(runs []*runResult) []panel {
	var out []panel
	for _, f := range figures {
		a, b, ok := fit(runs, f.get)
		if !ok {
			continue
		}
		pn := panel{f: f, a: a, b: b}
		for _, r := range runs {
			if v := f.get(r); v > 0 {
				pn.ns, pn.vs = append(pn.ns, float64(r.N)), append(pn.vs, v)
			}
		}
		if t, ok := plotTargets[f.name]; ok {
			pn.target = &t
		}
		out = append(out, pn)
	}
	return out
}

// svgWriter collects the SVG's elements.
type svgWriter struct{ strings.Builder }

func (w *svgWriter) el(format string, args ...any) {
	fmt.Fprintf(w, format, args...)
	w.WriteByte('\n')
}

func (w *svgWriter) text(x, y float64, size int, attrs, s string) {
	w.el(`<text x="%s" y="%s" font-size="%d"%s>%s</text>`, px(x), px(y), size, attrs, xmlEscape(s))
}

func (w *svgWriter) line(x1, y1, x2, y2 float64, attrs string) {
	w.el(`<line x1="%s" y1="%s" x2="%s" y2="%s"%s/>`, px(x1), px(y1), px(x2), px(y2), attrs)
}

func xmlEscape(s string) string {
	return strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;", `"`, "&quot;").Replace(s)
}

const (
	styleFit    = ` stroke="#1f5fa8" stroke-width="1.5"`
	styleLinear = ` stroke="#666666" stroke-width="1.2" stroke-dasharray="5 4"`
	styleTarget = ` stroke="#c0392b" stroke-width="1.2"`
	stylePoint  = ` fill="#1f5fa8"`
)

// plot is the growth plot of the report's runs; ok is false when no
// figure has runs at two N.
func (r *report) plot() (svg []byte, ok bool) {
	sortRuns(r.Runs)
	ps := panels(r.Runs)
	if len(ps) == 0 {
		return nil, false
	}
	rows := (len(ps) + plotCols - 1) / plotCols
	width, height := plotCols*panelW, headH+rows*panelH
	var w svgWriter
	w.el(`<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif">`, width, height, width, height)
	w.el(`<rect width="%d" height="%d" fill="#ffffff"/>`, width, height)
	w.text(16, 24, 15, ` font-weight="bold"`, "How each figure grows with N (docs/scale.md's runs; both axes logarithmic)")
	// The legend: a sample and its text, placed at an estimated 0.6em
	// a character.
	lx, ly := 16.0, 48.0
	for _, item := range []struct{ style, text string }{
		{stylePoint, "a run"},
		{styleFit, "a·N^b fitted over the runs (b in each title)"},
		{styleLinear, "linear from the smallest N (b = 1)"},
		{styleTarget, "issue 36's target at N = 5,000"},
	} {
		if item.style == stylePoint {
			w.el(`<circle cx="%s" cy="%s" r="3.5"%s/>`, px(lx+15), px(ly-4), stylePoint)
		} else {
			w.line(lx, ly-4, lx+30, ly-4, item.style)
		}
		w.text(lx+36, ly, 12, "", item.text)
		lx += 36 + 0.6*12*float64(len([]rune(item.text))) + 24
	}
	for i, pn := range ps {
		pn.draw(&w, float64(i%plotCols*panelW), float64(headH+i/plotCols*panelH))
	}
	w.el(`</svg>`)
	return []byte(w.String()), true
}

// span is the N the panel's lines run over: from the smallest run's to
// the largest or 5,000.
func (pn *panel) span() (n0, nMax float64) {
	return pn.ns[0], math.Max(pn.ns[len(pn.ns)-1], 5000)
}

// axes are the panel's axes with its top-left corner at (ox, oy): x over
// span, y over the points, both lines and the target.
func (pn *panel) axes(ox, oy float64) (x, y logAxis) {
	n0, nMax := pn.span()
	v0 := pn.vs[0]
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, v := range append(append([]float64{}, pn.vs...), pn.a*math.Pow(n0, pn.b), pn.a*math.Pow(nMax, pn.b), v0*nMax/n0) {
		lo, hi = math.Min(lo, v), math.Max(hi, v)
	}
	if pn.target != nil {
		lo, hi = math.Min(lo, pn.target.max), math.Max(hi, pn.target.max)
	}
	x = newLogAxis(n0, nMax, ox+plotLeft, ox+panelW-plotRight)
	y = newLogAxis(lo, hi, oy+panelH-plotBottom, oy+plotTop)
	return x, y
}

// draw writes the panel with its top-left corner at (ox, oy).
func (pn *panel) draw(w *svgWriter, ox, oy float64) {
	x, y := pn.axes(ox, oy)
	x0, x1, yb, yt := x.p0, x.p1, y.p0, y.p1
	w.el(`<g>`)
	for i, l := range wrapWords(pn.f.name, titleChars) {
		if i == 2 {
			break
		}
		w.text(ox+titleLeft, oy+18+float64(i)*16, 13, ` font-weight="bold"`, l)
	}
	info := fmt.Sprintf("b = %.2f", pn.b)
	if u := strings.TrimPrefix(pn.f.unit, "/"); u != pn.f.unit {
		info += "; per " + u
	} else if u != "" {
		info += "; in " + u
	}
	w.text(ox+titleLeft, oy+52, 11, ` fill="#333333"`, info)
	for _, t := range x.ticks() {
		p := x.pos(t)
		w.line(p, yt, p, yb, ` stroke="#e3e3e3"`)
		w.text(p, yb+15, 11, ` text-anchor="middle"`, fmtTick(t))
	}
	for _, t := range y.ticks() {
		p := y.pos(t)
		w.line(x0, p, x1, p, ` stroke="#e3e3e3"`)
		w.text(x0-5, p+4, 11, ` text-anchor="end"`, fmtTick(t))
	}
	w.el(`<rect x="%s" y="%s" width="%s" height="%s" fill="none" stroke="#999999"/>`, px(x0), px(yt), px(x1-x0), px(yb-yt))
	w.text((x0+x1)/2, yb+31, 11, ` text-anchor="middle"`, "N (objects)")
	n0, nMax := pn.span()
	v0 := pn.vs[0]
	w.line(x.pos(n0), y.pos(v0), x.pos(nMax), y.pos(v0*nMax/n0), styleLinear)
	w.line(x.pos(n0), y.pos(pn.a*math.Pow(n0, pn.b)), x.pos(nMax), y.pos(pn.a*math.Pow(nMax, pn.b)), styleFit)
	if t := pn.target; t != nil {
		p := y.pos(t.max)
		w.line(x0, p, x1, p, styleTarget)
		ty := p - 4
		if p-yt < 16 {
			ty = p + 14
		}
		w.text(x1-4, ty, 11, ` text-anchor="end" fill="#c0392b"`, t.label)
	}
	for i, n := range pn.ns {
		label := strings.TrimSpace(fmt.Sprintf(pn.f.format, pn.vs[i]) + " " + pn.f.unit)
		w.el(`<circle cx="%s" cy="%s" r="3.5"%s><title>N=%d: %s</title></circle>`,
			px(x.pos(n)), px(y.pos(pn.vs[i])), stylePoint, int(n), xmlEscape(label))
	}
	w.el(`</g>`)
}

// wrapWords breaks s into lines of at most width characters where it can.
func wrapWords(s string, width int) []string {
	var lines []string
	cur := ""
	for _, word := range strings.Fields(s) {
		switch {
		case cur == "":
			cur = word
		case len([]rune(cur))+1+len([]rune(word)) <= width:
			cur += " " + word
		default:
			lines = append(lines, cur)
			cur = word
		}
	}
	return append(lines, cur)
}
