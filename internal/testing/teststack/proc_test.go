package teststack

import (
	"context"
	"os"
	"os/exec"
	"slices"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/internal/testing/eventually"
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
	eventually.Poll(context.Background(), 2*time.Second, func() bool { // sh forks sleep soon after it starts
		got = Descendants(cmd.Process.Pid)
		return len(got) > 0
	})
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
