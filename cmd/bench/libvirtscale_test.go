package main

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

func TestThousands(t *testing.T) {
	for n, want := range map[int]string{0: "0", 999: "999", 1000: "1,000", 100000: "100,000", 1234567: "1,234,567"} {
		if got := thousands(n); got != want {
			t.Errorf("thousands(%d) = %q, want %q", n, got, want)
		}
	}
}

// TestRenderLibvirtScale: the List target is read at 50 ms with 1,000
// instances, met at 1 s and missed above it.
func TestRenderLibvirtScale(t *testing.T) {
	lsRowAt := func(rtt time.Duration, listMS float64) *lsRow {
		x := time.Second
		return &lsRow{rtt: rtt, list: stats(1051, listMS), get: stats(3, 2),
			gc:     gcRun{total: x, list: x / 4, deletes: []float64{5}, rpcs: 2051, orphans: 100},
			create: []throughput{{n: 60, callers: 20, wall: 20 * x, each: []float64{7000}, rpcs: 420}},
			del:    []throughput{{n: 60, callers: 20, wall: 30 * x, each: []float64{9000}, rpcs: 660}}}
	}
	for _, tc := range []struct {
		listMS float64
		want   string
	}{{1000, "≤ 1 s: **met**"}, {1001, "≤ 1 s: **missed**"}} {
		r := &lsResult{n: 1000, foreign: 100, orphans: 100, runs: 3, command: "go run ./cmd/bench -phases libvirtscale",
			rows: []*lsRow{lsRowAt(0, 200), lsRowAt(50*time.Millisecond, tc.listMS)}}
		out := renderLibvirtScale(r)
		for _, w := range []string{
			"# Real libvirt at scale", fmt.Sprintf("| List of 1,000 (beside 100 foreign) | 50 ms | %.0f ms |", tc.listMS),
			tc.want, "| Create throughput, 20 callers | 0 ms | **3.0 /s** (60 in 20.00 s",
			"| Delete throughput, 20 callers | 50 ms | **2.0 /s**",
		} {
			if !strings.Contains(out, w) {
				t.Errorf("report at %v ms lacks %q:\n%s", tc.listMS, w, out)
			}
		}
		if strings.Count(out, "≤ 1 s:") != 1 {
			t.Errorf("the target is read %d times, want once (the 50 ms row)", strings.Count(out, "≤ 1 s:"))
		}
	}
}
