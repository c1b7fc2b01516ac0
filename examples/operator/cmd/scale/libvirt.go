package main

import (
	"os"
	"path/filepath"
	"strings"
)

// libvirtReport is the file cmd/bench -phases libvirtscale writes beside
// this report: issue 36's real-libvirt target is measured there, on the
// real libvirtd through the real sshd, not by this bench.
const libvirtReport = "scale-libvirt.md"

// libvirtList reads the List of 1,000 at 50 ms row of the libvirt report
// beside the report at path: its median wall time and its target cell.
// ok is false when the file or the row is missing.
func libvirtList(path string) (wall, verdict string, ok bool) {
	b, err := os.ReadFile(filepath.Join(filepath.Dir(path), libvirtReport))
	if err != nil {
		return "", "", false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if !strings.HasPrefix(line, "| List of 1,000") {
			continue
		}
		cells := strings.Split(strings.Trim(line, "|"), "|")
		if len(cells) < 7 || strings.TrimSpace(cells[1]) != "50 ms" {
			continue
		}
		return strings.TrimSpace(cells[2]), strings.TrimSpace(cells[len(cells)-1]), true
	}
	return "", "", false
}

// libvirtTarget is the Targets table's row for the real-libvirt target:
// the figure and verdict of the libvirt report, or MISSED when it has
// none.
func (r *report) libvirtTarget() string {
	const head = "| real libvirt: List of 1,000 at 50 ms | ≤ 1 s | "
	if r.LibvirtWall == "" {
		return head + "— | — | MISSED: not measured — `cmd/bench -phases libvirtscale` measures it on the real libvirtd (" + libvirtReport + "), and that report is missing |"
	}
	v := "MISSED"
	if strings.Contains(strings.ToLower(r.LibvirtVerdict), "met") && !strings.Contains(strings.ToLower(r.LibvirtVerdict), "missed") {
		v = "MET"
	}
	return head + r.LibvirtWall + " | — | " + v + ": measured by `cmd/bench -phases libvirtscale` on the real libvirtd through the real sshd ([" + libvirtReport + "](" + libvirtReport + ")) |"
}
