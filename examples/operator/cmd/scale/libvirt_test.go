package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The real-libvirt target takes its figure and verdict from the libvirt
// report beside the report, and is MISSED without one.
func TestLibvirtTarget(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "scale.md")
	var r report
	r.LibvirtWall, r.LibvirtVerdict, _ = libvirtList(out)
	if got := r.libvirtTarget(); !strings.Contains(got, "| MISSED: not measured") {
		t.Errorf("without %s: %q", libvirtReport, got)
	}
	doc := "# x\n\n| operation | RTT | wall (median) | runs | RPCs | round trips | target |\n| --- |\n" +
		"| List of 1,000 (beside 100 foreign) | 0 ms | 133 ms | 1 / 2 | 1051 | 1 | |\n" +
		"| List of 1,000 (beside 100 foreign) | 50 ms | 376 ms | 337 / 447 | 1051 | 5 (5 / 3) | ≤ 1 s: **met** |\n"
	if err := os.WriteFile(filepath.Join(dir, libvirtReport), []byte(doc), 0o644); err != nil {
		t.Fatal(err)
	}
	wall, verdict, ok := libvirtList(out)
	if !ok || wall != "376 ms" || verdict != "≤ 1 s: **met**" {
		t.Fatalf("libvirtList = %q, %q, %v; want the 50 ms row", wall, verdict, ok)
	}
	r.LibvirtWall, r.LibvirtVerdict = wall, verdict
	if got := r.libvirtTarget(); !strings.Contains(got, "| 376 ms | — | MET: measured by") {
		t.Errorf("met: %q", got)
	}
	r.LibvirtVerdict = "≤ 1 s: **missed**"
	if got := r.libvirtTarget(); !strings.Contains(got, "| 376 ms | — | MISSED: measured by") {
		t.Errorf("missed: %q", got)
	}
}

// The header names each run's at-rest window when they differ.
func TestRestWindows(t *testing.T) {
	r := report{Rest: 5 * time.Minute, Runs: []*runResult{{N: 200, RestS: 60.04}, {N: 5000, RestS: 300.05}}}
	if got, want := r.restWindows(), "1m0s at N=200, 5m0s at N=5000"; got != want {
		t.Errorf("mixed: %q, want %q", got, want)
	}
	r = report{Rest: time.Minute, Runs: []*runResult{{N: 200, RestS: 60}, {N: 500, RestS: 60}}}
	if got := r.restWindows(); got != "1m0s (the issue asks for 5 minutes; these runs used a shorter one)" {
		t.Errorf("all 60 s: %q", got)
	}
}
