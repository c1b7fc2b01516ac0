package main

import (
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func stats(rpcs, ms float64) opStats {
	return opStats{rpcs: []float64{rpcs, rpcs, rpcs}, wallMS: []float64{ms, ms, ms}}
}

func row(n int, createRPCs, listMS float64) scaleRow {
	return scaleRow{n: n, create: stats(createRPCs, 500), get: stats(3, 2), del: stats(9, 30), list: stats(float64(1+n), listMS)}
}

func TestNotQuadratic(t *testing.T) {
	for _, tc := range []struct {
		name string
		rows []scaleRow
		ok   bool
		why  string
	}{
		{"linear", []scaleRow{row(1, 14, 5), row(10, 14, 12), row(100, 15, 110)}, true, "List ms/instance 1.10 at 100 vs 1.20 at 10"},
		{"create grows", []scaleRow{row(1, 14, 5), row(10, 14, 12), row(100, 30, 110)}, false, "Create/Get/Delete RPCs constant: false"},
		{"list quadratic time", []scaleRow{row(1, 14, 5), row(10, 14, 12), row(100, 14, 1200)}, false, "12.00 at 100"},
		{"list extra RPCs", []scaleRow{row(1, 14, 5), {n: 10, create: stats(14, 1), get: stats(3, 1), del: stats(9, 1), list: stats(21, 12)}}, false, "List RPCs = 1 + n: false"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ok, why := notQuadratic(tc.rows)
			if ok != tc.ok || !strings.Contains(why, tc.why) {
				t.Errorf("notQuadratic = %v, %q; want %v and %q in it", ok, why, tc.ok, tc.why)
			}
		})
	}
}

func TestRenderReadsTargets(t *testing.T) {
	r := &report{opts: options{runs: 3, imageMiB: 8, command: "make bench"},
		upload: &uploadResult{
			libUpload: []float64{300, 310, 320}, libVerify: []float64{500, 500, 500}, libWhole: []float64{150, 150, 150},
			virsh: []float64{300, 300, 300}, ssh: []float64{300, 300, 300}, rssKiB: []float64{20000, 21000, 40000},
			upVsVirsh: []float64{1.0, 1.03, 1.07}, wholeVsSSH: []float64{0.5, 0.5, 0.5},
		}}
	r.upload.image.SHA256 = strings.Repeat("a", 64)
	out := r.render()
	for _, want := range []string{
		"| library upload phase / virsh | 1.03× | 1.00 / 1.03 / 1.07 | ≥ 1.2× | **MISSED** |",
		"| library whole cold fetch / raw ssh | 0.50× | 0.50 / 0.50 / 0.50 | ≥ 0.6× | **MISSED** |",
		"**Median 20.5 MiB**",
		"≤ 32 MiB: **met**",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
}

func TestGetsReading(t *testing.T) {
	for _, tc := range []struct {
		name            string
		ratio, vsDecode float64
		want, notWant   string
	}{
		{"met", 0.93, 0.95, "target **met** at 0.93", "missed"},
		{"decoding", 0.47, 0.93, "the gap is the CPU kvm2 spends decoding", "**met**"},
		{"part decoding", 0.6, 0.8, "decoding explains part of the gap", "**met**"},
		{"not decoding", 0.82, 0.84, "decoding is not what separates them", "**met**"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := getsReading(tc.ratio, tc.vsDecode)
			if !strings.Contains(got, tc.want) || strings.Contains(got, tc.notWant) {
				t.Errorf("getsReading(%v, %v) = %q; want %q in it and not %q", tc.ratio, tc.vsDecode, got, tc.want, tc.notWant)
			}
		})
	}
}

func TestDecodeGap(t *testing.T) {
	for _, tc := range []struct {
		name             string
		directS, decodeS float64
		want             string
	}{
		{"noise", 0.320, 0.279, "below the run-to-run noise"},
		{"equal", 0.3, 0.3, "below the run-to-run noise"},
		{"decoding costs", 0.2, 0.3, "50% slower"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := decodeGap(tc.directS, tc.decodeS); !strings.Contains(got, tc.want) {
				t.Errorf("decodeGap(%v, %v) = %q; want %q in it", tc.directS, tc.decodeS, got, tc.want)
			}
		})
	}
}
