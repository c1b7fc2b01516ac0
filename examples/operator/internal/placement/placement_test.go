package placement_test

import (
	"fmt"
	"testing"

	"github.com/egressproxy/egressproxy"
	"github.com/google/go-cmp/cmp"

	"github.com/egressproxy/egressproxy/examples/operator/internal/placement"
)

const gib = 1 << 30

// host returns a reachable entry with memoryGiB of available memory, 8
// CPUs and current children of the pool.
func host(name string, memoryGiB int64, current int) placement.Entry {
	return placement.Entry{Name: name, Reachable: true, Current: current,
		Capacity: &egressproxy.Capacity{MemoryAvailableBytes: memoryGiB * gib, CPUs: 8, Instances: current}}
}

func down(e placement.Entry) placement.Entry {
	e.Reachable, e.Capacity = false, nil
	return e
}

var small = placement.Resources{MemoryBytes: 1 * gib, VCPUs: 1}

func TestPlace(t *testing.T) {
	for _, tc := range []struct {
		name    string
		entries []placement.Entry
		req     placement.Request
		want    placement.Plan
	}{{
		name:    "3 entries, pool of 6",
		entries: []placement.Entry{host("a", 16, 0), host("b", 16, 0), host("c", 16, 0)},
		req:     placement.Request{Want: 6, Need: small},
		want:    placement.Plan{Add: map[string]int{"a": 2, "b": 2, "c": 2}},
	}, {
		name:    "pool of 6, one entry unreachable",
		entries: []placement.Entry{host("a", 16, 0), host("b", 16, 0), down(host("c", 16, 0))},
		req:     placement.Request{Want: 6, Need: small},
		want: placement.Plan{Add: map[string]int{"a": 3, "b": 3},
			Skipped: []placement.Skip{{Entry: "c", Reason: placement.ReasonUnreachable}}},
	}, {
		name:    "2/2/2, the third entry lost: its 2 replaced on the others",
		entries: []placement.Entry{host("a", 14, 2), host("b", 14, 2), down(host("c", 14, 0))},
		req:     placement.Request{Want: 2, Need: small},
		want: placement.Plan{Add: map[string]int{"a": 1, "b": 1},
			Skipped: []placement.Skip{{Entry: "c", Reason: placement.ReasonUnreachable}}},
	}, {
		name:    "3/3/0, the third entry back, nothing wanted: nothing moves",
		entries: []placement.Entry{host("a", 13, 3), host("b", 13, 3), host("c", 16, 0)},
		req:     placement.Request{Want: 0, Need: small},
		want:    placement.Plan{Add: map[string]int{}},
	}, {
		name:    "3/3/0, one surge: the empty entry",
		entries: []placement.Entry{host("a", 13, 3), host("b", 13, 3), host("c", 16, 0)},
		req:     placement.Request{Want: 1, Need: small},
		want:    placement.Plan{Add: map[string]int{"c": 1}},
	}, {
		name:    "equally loaded: more free memory first, then name",
		entries: []placement.Entry{host("a", 4, 0), host("b", 8, 0), host("c", 8, 0)},
		req:     placement.Request{Want: 2, Need: small},
		want:    placement.Plan{Add: map[string]int{"b": 1, "c": 1}},
	}, {
		name:    "free memory the plan takes counts in the next choice",
		entries: []placement.Entry{host("a", 4, 1), host("b", 5, 0)},
		req:     placement.Request{Want: 2, Need: placement.Resources{MemoryBytes: 2 * gib}},
		want:    placement.Plan{Add: map[string]int{"a": 1, "b": 1}},
	}, {
		name:    "unknown capacity limits nothing and ranks below known free memory",
		entries: []placement.Entry{{Name: "a", Reachable: true}, host("b", 1, 0)},
		req:     placement.Request{Want: 3, Need: small},
		want: placement.Plan{Add: map[string]int{"a": 2, "b": 1},
			Skipped: []placement.Skip{{Entry: "b", Reason: placement.ReasonMemoryFull}}},
	}, {
		name:    "memory full: place what fits, report the shortfall",
		entries: []placement.Entry{host("a", 3, 0), host("b", 16, 0), host("c", 1, 0)},
		req:     placement.Request{Want: 5, Need: placement.Resources{MemoryBytes: 2 * gib}, MaxPerEntry: 2},
		want: placement.Plan{Add: map[string]int{"a": 1, "b": 2}, Shortfall: 2,
			Skipped: []placement.Skip{{Entry: "a", Reason: placement.ReasonMemoryFull}, {Entry: "b", Reason: placement.ReasonMaxPerEntry}, {Entry: "c", Reason: placement.ReasonMemoryFull}}},
	}, {
		// 2 CPUs carry 8 vCPUs by default: 4 proxies of 2, 3 running.
		name: "CPUs full",
		entries: []placement.Entry{{Name: "a", Reachable: true,
			Capacity: &egressproxy.Capacity{MemoryAvailableBytes: 64 * gib, CPUs: 2, Instances: 3}}},
		req: placement.Request{Want: 2, Need: placement.Resources{MemoryBytes: gib, VCPUs: 2}},
		want: placement.Plan{Add: map[string]int{"a": 1}, Shortfall: 1,
			Skipped: []placement.Skip{{Entry: "a", Reason: placement.ReasonCPUFull}}},
	}, {
		name: "VCPUsPerCPU 1",
		entries: []placement.Entry{{Name: "a", Reachable: true,
			Capacity: &egressproxy.Capacity{MemoryAvailableBytes: 64 * gib, CPUs: 4, Instances: 1}}},
		req: placement.Request{Want: 5, Need: small, VCPUsPerCPU: 1},
		want: placement.Plan{Add: map[string]int{"a": 3}, Shortfall: 2,
			Skipped: []placement.Skip{{Entry: "a", Reason: placement.ReasonCPUFull}}},
	}, {
		name:    "MaxPerEntry and memory bind together: MaxPerEntry is reported",
		entries: []placement.Entry{host("a", 2, 0)},
		req:     placement.Request{Want: 3, Need: small, MaxPerEntry: 2},
		want: placement.Plan{Add: map[string]int{"a": 2}, Shortfall: 1,
			Skipped: []placement.Skip{{Entry: "a", Reason: placement.ReasonMaxPerEntry}}},
	}, {
		name:    "an entry above MaxPerEntry takes none",
		entries: []placement.Entry{host("a", 16, 4), host("b", 16, 0)},
		req:     placement.Request{Want: 2, Need: small, MaxPerEntry: 3},
		want: placement.Plan{Add: map[string]int{"b": 2},
			Skipped: []placement.Skip{{Entry: "a", Reason: placement.ReasonMaxPerEntry}}},
	}, {
		name: "no entries",
		req:  placement.Request{Want: 2},
		want: placement.Plan{Add: map[string]int{}, Shortfall: 2},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := placement.Place(tc.entries, tc.req)
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("Place (-want +got):\n%s", diff)
			}
		})
	}
}

func TestRemove(t *testing.T) {
	for _, tc := range []struct {
		name    string
		entries []placement.Entry
		n       int
		want    map[string]int
	}{{
		name:    "fullest first",
		entries: []placement.Entry{host("a", 16, 1), host("b", 16, 3), host("c", 16, 2)},
		n:       3,
		want:    map[string]int{"b": 2, "c": 1},
	}, {
		name:    "unreachable entries' children first, even from an emptier entry",
		entries: []placement.Entry{host("a", 16, 4), down(host("b", 16, 1)), down(host("c", 16, 2))},
		n:       4,
		want:    map[string]int{"a": 1, "b": 1, "c": 2},
	}, {
		name:    "equally full: less free memory first, unknown least, then name",
		entries: []placement.Entry{host("a", 8, 2), host("b", 4, 2), {Name: "c", Reachable: true, Current: 2}, host("d", 4, 2)},
		n:       3,
		want:    map[string]int{"b": 1, "c": 1, "d": 1},
	}, {
		name:    "3/3/0, nothing to remove",
		entries: []placement.Entry{host("a", 13, 3), host("b", 13, 3), host("c", 16, 0)},
		n:       0,
		want:    map[string]int{},
	}, {
		name:    "more than there are: all",
		entries: []placement.Entry{host("a", 16, 1), down(host("b", 16, 1))},
		n:       5,
		want:    map[string]int{"a": 1, "b": 1},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := placement.Remove(tc.entries, tc.n)
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("Remove (-want +got):\n%s", diff)
			}
		})
	}
}

// TestSurgeRestoresSpread replays what the controller does when an entry
// comes back empty: one child placed, then one removed, until a move no
// longer helps.
func TestSurgeRestoresSpread(t *testing.T) {
	entries := []placement.Entry{host("a", 13, 3), host("b", 13, 3), host("c", 16, 0)}
	var steps []string
	for range 10 {
		plan, err := placement.Place(entries, placement.Request{Want: 1, Need: small})
		if err != nil {
			t.Fatal(err)
		}
		if counts(entries)[onlyKey(t, plan.Add)]+2 > maxCount(entries) {
			break // the move would not narrow the spread
		}
		entries = apply(entries, plan.Add, 1, small)
		removed, err := placement.Remove(entries, 1)
		if err != nil {
			t.Fatal(err)
		}
		entries = apply(entries, removed, -1, small)
		steps = append(steps, fmt.Sprint(counts(entries)))
	}
	want := []string{"map[a:2 b:3 c:1]", "map[a:2 b:2 c:2]"}
	if diff := cmp.Diff(want, steps); diff != "" {
		t.Errorf("spread after each surge (-want +got):\n%s", diff)
	}
}

func TestInvalid(t *testing.T) {
	entries := []placement.Entry{
		{Name: "a", Current: -1},
		{Name: "", Reachable: true},
		{Name: "a", Capacity: &egressproxy.Capacity{MemoryAvailableBytes: -1, CPUs: -1, Instances: -1}},
	}
	entryFields := []string{"entries[0].Current", "entries[1].Name", "entries[2].Name",
		"entries[2].Capacity.MemoryAvailableBytes", "entries[2].Capacity.CPUs", "entries[2].Capacity.Instances"}
	req := placement.Request{Want: -1, MaxPerEntry: -1, Need: placement.Resources{MemoryBytes: -1, VCPUs: -1}, VCPUsPerCPU: -1}

	_, err := placement.Place(entries, req)
	checkFields(t, "Place", err, append(entryFields, "Want", "MaxPerEntry", "Need.MemoryBytes", "Need.VCPUs", "VCPUsPerCPU"))
	_, err = placement.Remove(entries, -1)
	checkFields(t, "Remove", err, append(entryFields, "n"))
}

func checkFields(t *testing.T, op string, err error, want []string) {
	t.Helper()
	if got := egressproxy.Code(err); got != egressproxy.Permanent {
		t.Errorf("%s: class %v, want Permanent (err %v)", op, got, err)
	}
	var got []string
	for _, fe := range egressproxy.FieldErrors(err) {
		got = append(got, fe.Field)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("%s: fields (-want +got):\n%s", op, diff)
	}
}

func onlyKey(t *testing.T, m map[string]int) string {
	t.Helper()
	if len(m) != 1 {
		t.Fatalf("want one entry, got %v", m)
	}
	for k := range m {
		return k
	}
	return ""
}

func counts(entries []placement.Entry) map[string]int {
	out := map[string]int{}
	for _, e := range entries {
		out[e.Name] = e.Current
	}
	return out
}

func maxCount(entries []placement.Entry) int {
	m := 0
	for _, e := range entries {
		if e.Reachable {
			m = max(m, e.Current)
		}
	}
	return m
}

// apply returns entries as they are once sign × change[name] children are
// added to each: Current and, when the capacity is known, its Instances
// and available memory follow.
func apply(entries []placement.Entry, change map[string]int, sign int, need placement.Resources) []placement.Entry {
	out := make([]placement.Entry, len(entries))
	for i, e := range entries {
		d := sign * change[e.Name]
		e.Current += d
		if e.Capacity != nil {
			c := *e.Capacity
			c.Instances += d
			c.MemoryAvailableBytes -= int64(d) * need.MemoryBytes
			e.Capacity = &c
		}
		out[i] = e
	}
	return out
}

func ExamplePlace() {
	entries := []placement.Entry{
		{Name: "a", Reachable: true, Capacity: &egressproxy.Capacity{MemoryAvailableBytes: 16 << 30, CPUs: 8}},
		{Name: "b", Reachable: true, Capacity: &egressproxy.Capacity{MemoryAvailableBytes: 16 << 30, CPUs: 8}},
		{Name: "c", Reachable: false},
	}
	plan, err := placement.Place(entries, placement.Request{
		Want: 6,
		Need: placement.Resources{MemoryBytes: 1 << 30, VCPUs: 1},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(plan.Add, plan.Shortfall, plan.Skipped)
	// Output: map[a:3 b:3] 0 [{c Unreachable}]
}

func ExampleRemove() {
	entries := []placement.Entry{
		{Name: "a", Reachable: true, Current: 3},
		{Name: "b", Reachable: true, Current: 2},
		{Name: "c", Reachable: false, Current: 1},
	}
	remove, err := placement.Remove(entries, 2)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(remove)
	// Output: map[a:1 c:1]
}
