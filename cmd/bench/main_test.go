package main

import (
	"strings"
	"testing"

	"github.com/egressproxy/egressproxy/internal/testing/benchutil"

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

// The fanout section's verdicts follow the targets: mirror bytes
// ≤ 1.05× the image, wall ≤ 1.2× one host's, 0 bytes for the late joiner
// (every round), peak RSS ≤ 64 MiB.
func TestRenderFanoutTargets(t *testing.T) {
	f := &fanoutResult{hosts: 4, mib: 256, rate: "1gbit", mirrorRate: "100mbit",
		image: benchutil.Image{Size: 1000, SHA256: strings.Repeat("b", 64)},
		one:   []float64{10, 10, 10}, many: []float64{11, 13, 11},
		oneBytes: []float64{1000, 1000, 1000}, manyBytes: []float64{1000, 1000, 1100},
		late: []float64{3, 3, 3}, lateBytes: []float64{0, 0, 1000}, lateSource: []string{"peer", "peer", "mirror"},
		manyRSSKiB: []float64{60 << 10, 70 << 10, 62 << 10}, manyVsOne: []float64{1.1, 1.3, 1.1},
	}
	r := &report{opts: options{runs: 3, command: "make bench"}, fanout: f}
	out := r.render()
	for _, want := range []string{
		"## 8. Image fan-out across hosts",
		"| fan-out: mirror bytes, 4 hosts needing one cold 256 MiB image at once (100mbit mirror, 1gbit hosts) | 1.000× the image (1.000 / 1.000 / 1.100) | ≤ 1.05× | **met** |",
		"| fan-out: wall time, 4 hosts at once / 1 host's cold fetch | 1.10× (11.0 vs 10.0 s) | ≤ 1.2× | **met** |",
		"| fan-out: mirror bytes, one more host going cold afterwards (peer path) | 0 / 0 / 1000 bytes (sources peer, peer, mirror; 3.0 s vs 10.0 s from the mirror) | 0 | **MISSED** |",
		"| fan-out: peak RSS of the 4-host fan-out process | 62.0 MiB | ≤ 64 MiB | **met** |",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
}
