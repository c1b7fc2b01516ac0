package allocprof

import "testing"

var sink [][]byte

//go:noinline
func allocTen() {
	for i := 0; i < 10; i++ {
		sink = append(sink, make([]byte, 1024))
	}
}

//go:noinline
func allocElsewhere() { sink = append(sink, make([]byte, 4096)) }

func TestUnderCountsOnlyTheNamedFunction(t *testing.T) {
	const fn = "github.com/egressproxy/egressproxy/internal/testing/allocprof.allocTen"
	objs, bytes := Under(fn, func() {
		allocTen()
		allocElsewhere()
	})
	sink = nil
	// ten 1 KiB slices (plus the growth of sink, which happens in allocTen too)
	if objs < 10 || bytes < 10*1024 {
		t.Fatalf("Under(allocTen) = %d objects, %d bytes; want at least 10 and 10240", objs, bytes)
	}
	if bytes >= 10*1024+4096+4096 {
		t.Fatalf("Under(allocTen) = %d bytes: counted allocElsewhere's 4 KiB too", bytes)
	}
	if o, _ := Under(fn, func() {}); o != 0 {
		t.Fatalf("nothing ran, yet %d objects counted", o)
	}
}
