package kvm2

import (
	"context"
	"errors"
	"fmt"
	"sync"

	libvirt "github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/libvirterr"
)

// memoryStatsAllCells is VIR_NODE_MEMORY_STATS_ALL_CELLS: the whole host.
const memoryStatsAllCells = -1

// detailCapacity is the Check detail set when libvirtd refused to tell the
// host's capacity (the entry is still Reachable, without a Capacity).
const detailCapacity = "capacity"

// readCapacity reads the host's CPUs (NodeGetInfo), its available memory
// (NodeGetMemoryStats over all cells: free, buffers and page cache) and
// the owner's instances that run (the domains List would return, in a
// state List reports as Running or Provisioning), the three at once on l.
// The pool's free space is Check's to fill in.
func (p *provider) readCapacity(ctx context.Context, l lvAPI) (egressproxy.Capacity, error) {
	var (
		c                    egressproxy.Capacity
		wg                   sync.WaitGroup
		cpuErr, memErr, dErr error
	)
	wg.Add(2)
	go func() {
		defer wg.Done()
		var cpus int32
		if _, _, cpus, _, _, _, _, _, cpuErr = l.NodeGetInfo(); cpuErr != nil {
			cpuErr = fmt.Errorf("get node info: %w", cpuErr)
			return
		}
		c.CPUs = int(cpus)
	}()
	go func() {
		defer wg.Done()
		c.MemoryAvailableBytes, memErr = availableMemory(l)
	}()
	found, dErr := p.listDomains(ctx, l, domainPrefix+p.cfg.Entry+"--")
	wg.Wait()
	if err := errors.Join(cpuErr, memErr, dErr); err != nil {
		return egressproxy.Capacity{}, err
	}
	for _, info := range found {
		if st := mapState(info.state, false); st == egressproxy.StateRunning || st == egressproxy.StateProvisioning {
			c.Instances++
		}
	}
	return c, nil
}

// availableMemory is the host's free memory plus its buffers and page
// cache, in bytes, from NodeGetMemoryStats: first the number of
// parameters, then that many (libvirt wants the exact count).
func availableMemory(l lvAPI) (int64, error) {
	_, n, err := l.NodeGetMemoryStats(0, memoryStatsAllCells, 0)
	if err != nil {
		return 0, fmt.Errorf("get node memory stats: %w", err)
	}
	params, _, err := l.NodeGetMemoryStats(n, memoryStatsAllCells, 0)
	if err != nil {
		return 0, fmt.Errorf("get node memory stats: %w", err)
	}
	var kib uint64
	free := false
	for _, p := range params {
		switch p.Field {
		case "free":
			free = true
			kib += p.Value
		case "buffers", "cached":
			kib += p.Value
		}
	}
	if !free {
		return 0, errNoFreeMemory
	}
	return int64(kib) << 10, nil
}

// errNoFreeMemory: the host's memory stats lack the free memory.
var errNoFreeMemory = errors.New("get node memory stats: no free memory among them")

// capacityRefused reports whether err, from readCapacity, is libvirtd
// refusing to answer (the call is not supported or not allowed there)
// rather than the link failing: the entry can still create instances.
func capacityRefused(err error) bool {
	if errors.Is(err, errNoFreeMemory) {
		return true
	}
	if _, answered := libvirterr.Number(err); !answered && !errors.Is(err, libvirt.ErrUnsupported) {
		return false
	}
	return libvirterr.Of(err).Reason != egressproxy.ReasonUnreachable
}
