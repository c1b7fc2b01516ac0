package teststack

import (
	"os"
	"os/exec"
	"slices"
	"testing"
	"time"
)

// Descendants finds a child and a grandchild of this process, and nothing
// for a process without children.
func TestDescendants(t *testing.T) {
	cmd := exec.Command("sh", "-c", "sleep 30 & wait")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	var got []int
	for range 200 { // sh forks sleep soon after it starts
		if got = Descendants(cmd.Process.Pid); len(got) > 0 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if len(got) != 1 {
		t.Fatalf("Descendants(sh) = %v, want its one sleep", got)
	}
	if d := Descendants(os.Getpid()); !slices.Contains(d, cmd.Process.Pid) || !slices.Contains(d, got[0]) {
		t.Errorf("Descendants(test) = %v, want sh %d and its sleep %d among them", d, cmd.Process.Pid, got[0])
	}
	if d := Descendants(got[0]); len(d) != 0 {
		t.Errorf("Descendants(sleep) = %v, want none", d)
	}
}
