package allocprof

import (
	"runtime"
	"strings"
)

// Under runs run with every allocation profiled and returns how many
// objects and bytes were allocated with fn (a fully qualified function
// name, e.g. "example.com/pkg.Func"; its closures count too) on the stack.
// It changes runtime.MemProfileRate while it runs; do not call it
// concurrently.
func Under(fn string, run func()) (objects, bytes int64) {
	old := runtime.MemProfileRate
	runtime.MemProfileRate = 1
	defer func() { runtime.MemProfileRate = old }()
	o0, b0 := sum(fn)
	run()
	o1, b1 := sum(fn)
	return o1 - o0, b1 - b0
}

func sum(fn string) (objects, bytes int64) {
	runtime.GC()
	runtime.GC()
	var recs []runtime.MemProfileRecord
	for {
		n, ok := runtime.MemProfile(recs, true)
		if ok {
			recs = recs[:n]
			break
		}
		recs = make([]runtime.MemProfileRecord, n+100)
	}
	for _, r := range recs {
		frames := runtime.CallersFrames(r.Stack())
		for {
			f, more := frames.Next()
			if f.Function == fn || strings.HasPrefix(f.Function, fn+".") {
				objects += r.AllocObjects
				bytes += r.AllocBytes
				break
			}
			if !more {
				break
			}
		}
	}
	return objects, bytes
}
