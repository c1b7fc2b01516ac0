package main

import (
	"encoding/json"
	"os"
	"runtime"
	"runtime/metrics"
	"runtime/pprof"
	"time"
)

// writeAllocProfile writes the heap profile (allocations since the start,
// sampled at the default rate) to path.
func writeAllocProfile(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	runtime.GC()
	if err := pprof.Lookup("allocs").WriteTo(f, 0); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// writeHeapProfile writes the live heap as of the last GC to path.
func writeHeapProfile(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := pprof.Lookup("heap").WriteTo(f, 0); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// memPeaks is what -memstats prints: the Go runtime's view of the fetch
// child's memory, peaks sampled every 5 ms, totals at the end (bytes).
type memPeaks struct {
	HeapGoal     uint64 `json:"heapGoalPeak"`     // the GC's heap target
	HeapLive     uint64 `json:"heapObjectsPeak"`  // bytes in heap objects (live + not yet swept garbage)
	Mapped       uint64 `json:"totalMappedPeak"`  // every byte the runtime has mapped, minus released
	HeapReleased uint64 `json:"heapReleasedLast"` // returned to the OS at the end
	Stacks       uint64 `json:"stacksPeak"`
	Alloc        uint64 `json:"allocTotal"` // allocated over the run
	GCs          uint64 `json:"gcCycles"`
}

// sampleMem samples runtime/metrics until the returned function is called,
// which returns the peaks as JSON.
func sampleMem() func() string {
	names := []string{
		"/gc/heap/goal:bytes",
		"/memory/classes/heap/objects:bytes",
		"/memory/classes/total:bytes",
		"/memory/classes/heap/released:bytes",
		"/memory/classes/heap/stacks:bytes",
		"/gc/heap/allocs:bytes",
		"/gc/cycles/total:gc-cycles",
	}
	s := make([]metrics.Sample, len(names))
	for i, n := range names {
		s[i].Name = n
	}
	var p memPeaks
	read := func() {
		metrics.Read(s)
		v := func(i int) uint64 {
			if s[i].Value.Kind() != metrics.KindUint64 {
				return 0
			}
			return s[i].Value.Uint64()
		}
		p.HeapGoal = max(p.HeapGoal, v(0))
		p.HeapLive = max(p.HeapLive, v(1))
		p.Mapped = max(p.Mapped, v(2)-v(3))
		p.HeapReleased = v(3)
		p.Stacks = max(p.Stacks, v(4))
		p.Alloc, p.GCs = v(5), v(6)
	}
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		t := time.NewTicker(5 * time.Millisecond)
		defer t.Stop()
		for {
			read()
			select {
			case <-done:
				return
			case <-t.C:
			}
		}
	}()
	return func() string {
		close(done)
		<-stopped
		read()
		b, _ := json.Marshal(p)
		return string(b)
	}
}
