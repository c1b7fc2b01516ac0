package libvirtfake_test

import (
	"testing"

	"github.com/digitalocean/go-libvirt"
	"github.com/google/go-cmp/cmp"

	"github.com/egressproxy/egressproxy/internal/testing/libvirtfake"
)

// The node calls answer SetNode's figures, and NodeGetMemoryStats follows
// libvirt's protocol on Linux: ask for the count, then that many.
func TestNode(t *testing.T) {
	h, s := newHost(t)
	_, mem, cpus, _, _, _, _, _, err := s.NodeGetInfo()
	if d := libvirtfake.DefaultNode(); err != nil || cpus != d.CPUs || mem != d.TotalKiB {
		t.Fatalf("NodeGetInfo: %d CPUs, %d KiB, %v; want the default node", cpus, mem, err)
	}
	h.SetNode(libvirtfake.Node{CPUs: 3, TotalKiB: 400, FreeKiB: 100, BuffersKiB: 20, CachedKiB: 30})
	if _, n, err := s.NodeGetMemoryStats(0, -1, 0); err != nil || n != 4 {
		t.Fatalf("count: %d, %v", n, err)
	}
	params, _, err := s.NodeGetMemoryStats(4, -1, 0)
	want := []libvirt.NodeGetMemoryStats{{Field: "total", Value: 400}, {Field: "free", Value: 100}, {Field: "buffers", Value: 20}, {Field: "cached", Value: 30}}
	if err != nil || !cmp.Equal(params, want) {
		t.Fatalf("stats %v, %v; want %v", params, err, want)
	}
	if _, _, err := s.NodeGetMemoryStats(2, -1, 0); code(err) != libvirt.ErrInvalidArg {
		t.Errorf("a count other than 4: %v, want invalid argument", err)
	}
	if _, _, cpus, _, _, _, _, _, err := s.NodeGetInfo(); err != nil || cpus != 3 {
		t.Errorf("NodeGetInfo after SetNode: %d CPUs, %v; want 3", cpus, err)
	}
	if got := h.Calls("NodeGetInfo"); got != 2 {
		t.Errorf("%d NodeGetInfo calls logged, want 2", got)
	}
}
