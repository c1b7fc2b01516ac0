package libvirtfake

import "github.com/digitalocean/go-libvirt"

// Node is the host's hardware as NodeGetInfo and NodeGetMemoryStats
// answer it (memory in KiB, as libvirt gives it).
type Node struct {
	CPUs                                     int32
	TotalKiB, FreeKiB, BuffersKiB, CachedKiB uint64
}

// DefaultNode returns a new Host's node: 8 CPUs, 32 GiB of memory of
// which 20 GiB free, 1 GiB buffers and 3 GiB page cache.
func DefaultNode() Node {
	return Node{CPUs: 8, TotalKiB: 32 << 20, FreeKiB: 20 << 20, BuffersKiB: 1 << 20, CachedKiB: 3 << 20}
}

// SetNode sets what NodeGetInfo and NodeGetMemoryStats answer.
func (h *Host) SetNode(n Node) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.node = n
}

func (h *Host) nodeInfo() Node {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.node
}

// memoryStatsCount is the number of parameters a Linux host's
// NodeGetMemoryStats gives.
const memoryStatsCount = 4

// NodeGetInfo answers the node's CPUs and total memory (KiB), as one NUMA
// cell of one socket with a core per CPU.
func (s *Session) NodeGetInfo() (rModel [32]int8, rMemory uint64, rCpus int32, rMhz int32, rNodes int32, rSockets int32, rCores int32, rThreads int32, err error) {
	err = s.run(Call{Method: "NodeGetInfo"}, func() error {
		n := s.h.nodeInfo()
		for i, c := range "x86_64" {
			rModel[i] = int8(c)
		}
		rMemory, rCpus, rMhz, rNodes, rSockets, rCores, rThreads = n.TotalKiB, n.CPUs, 2600, 1, 1, n.CPUs, 1
		return nil
	})
	return
}

// NodeGetMemoryStats answers as libvirt does on Linux: Nparams 0 asks for
// the number of parameters (4); any other count than 4, or a cell other
// than -1 (all cells) or 0, is invalid; otherwise "total", "free",
// "buffers" and "cached", in KiB.
func (s *Session) NodeGetMemoryStats(Nparams int32, CellNum int32, Flags uint32) (rParams []libvirt.NodeGetMemoryStats, rNparams int32, err error) {
	err = s.run(Call{Method: "NodeGetMemoryStats"}, func() error {
		switch {
		case CellNum != -1 && CellNum != 0:
			return Errorf(libvirt.ErrInvalidArg, "invalid argument: Invalid cell number")
		case Nparams == 0:
			rNparams = memoryStatsCount
			return nil
		case Nparams != memoryStatsCount:
			return Errorf(libvirt.ErrInvalidArg, "invalid argument: nparams in virHostMemGetStats must be %d", memoryStatsCount)
		}
		n := s.h.nodeInfo()
		rParams = []libvirt.NodeGetMemoryStats{
			{Field: "total", Value: n.TotalKiB}, {Field: "free", Value: n.FreeKiB},
			{Field: "buffers", Value: n.BuffersKiB}, {Field: "cached", Value: n.CachedKiB},
		}
		rNparams = memoryStatsCount
		return nil
	})
	return
}
