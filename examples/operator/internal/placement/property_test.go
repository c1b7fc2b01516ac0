package placement_test

import (
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/egressproxy/egressproxy"
	"github.com/google/go-cmp/cmp"
	"pgregory.net/rapid"

	"github.com/egressproxy/egressproxy/examples/operator/internal/placement"
)

// The properties below check Place and Remove against the rules as their
// docs state them, written again here (fits, whyFull, freeAfter) rather
// than asked of the package.

func genEntry(t *rapid.T) placement.Entry {
	e := placement.Entry{
		Name:      rapid.StringMatching(`[a-f]{1,2}`).Draw(t, "name"),
		Reachable: rapid.IntRange(0, 3).Draw(t, "reachable") > 0,
		Current:   rapid.IntRange(0, 6).Draw(t, "current"),
	}
	if rapid.IntRange(0, 3).Draw(t, "capacityKnown") > 0 {
		e.Capacity = &egressproxy.Capacity{
			MemoryAvailableBytes: rapid.Int64Range(0, 24).Draw(t, "memoryHalfGiB") * gib / 2,
			CPUs:                 rapid.IntRange(0, 8).Draw(t, "cpus"),
			Instances:            rapid.IntRange(0, 12).Draw(t, "instances"),
		}
	}
	return e
}

func genEntries(t *rapid.T) []placement.Entry {
	return rapid.SliceOfNDistinct(rapid.Custom(genEntry), 0, 12, func(e placement.Entry) string { return e.Name }).Draw(t, "entries")
}

func genRequest(t *rapid.T) placement.Request {
	return placement.Request{
		Want:        rapid.IntRange(0, 30).Draw(t, "want"),
		MaxPerEntry: rapid.IntRange(0, 6).Draw(t, "maxPerEntry"),
		Need: placement.Resources{
			MemoryBytes: rapid.SampledFrom([]int64{0, gib / 2, gib, 2 * gib}).Draw(t, "needMemory"),
			VCPUs:       rapid.IntRange(0, 2).Draw(t, "needVCPUs"),
		},
		VCPUsPerCPU: rapid.IntRange(0, 2).Draw(t, "vcpusPerCPU"),
	}
}

// fits reports whether e can hold k new children under req's rules.
func fits(e placement.Entry, req placement.Request, k int) bool {
	return whyFull(e, req, k) == ""
}

// whyFull returns the first rule, in the order of the Reason constants,
// that forbids e to hold k new children; "" when none does.
func whyFull(e placement.Entry, req placement.Request, k int) placement.Reason {
	if !e.Reachable {
		return placement.ReasonUnreachable
	}
	if req.MaxPerEntry > 0 && e.Current+k > req.MaxPerEntry {
		return placement.ReasonMaxPerEntry
	}
	c := e.Capacity
	if c == nil {
		return ""
	}
	if int64(k)*req.Need.MemoryBytes > c.MemoryAvailableBytes {
		return placement.ReasonMemoryFull
	}
	perCPU := req.VCPUsPerCPU
	if perCPU == 0 {
		perCPU = placement.DefaultVCPUsPerCPU
	}
	if req.Need.VCPUs > 0 && c.CPUs > 0 && (c.Instances+k)*req.Need.VCPUs > c.CPUs*perCPU {
		return placement.ReasonCPUFull
	}
	return ""
}

// freeAfter is e's free memory once k children are added; -1 when unknown.
func freeAfter(e placement.Entry, req placement.Request, k int) int64 {
	if e.Capacity == nil {
		return -1
	}
	return e.Capacity.MemoryAvailableBytes - int64(k)*req.Need.MemoryBytes
}

func mustPlace(t *rapid.T, entries []placement.Entry, req placement.Request) placement.Plan {
	plan, err := placement.Place(entries, req)
	if err != nil {
		t.Fatalf("Place: %v", err)
	}
	return plan
}

func mustRemove(t *rapid.T, entries []placement.Entry, n int) map[string]int {
	out, err := placement.Remove(entries, n)
	if err != nil {
		t.Fatalf("Remove: %v", err)
	}
	return out
}

func sum(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// Place adds children only where the rules allow them all: a reachable
// entry, within MaxPerEntry, memory and CPUs.
func TestPropertyPlaceOnlyWhereRoom(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		entries, req := genEntries(t), genRequest(t)
		plan := mustPlace(t, entries, req)
		byName := map[string]placement.Entry{}
		for _, e := range entries {
			byName[e.Name] = e
		}
		for name, n := range plan.Add {
			e, ok := byName[name]
			if !ok || n <= 0 {
				t.Fatalf("Add[%q] = %d: want a positive count for an entry passed", name, n)
			}
			if why := whyFull(e, req, n); why != "" {
				t.Fatalf("Add[%q] = %d on %+v (capacity %+v): %s forbids it", name, n, e, e.Capacity, why)
			}
		}
	})
}

// Place places all it can: Want less the shortfall, which is what fits
// nowhere; when anything is short, every entry is skipped; the skipped
// entries are exactly those that cannot take one more, with the first rule
// that forbids it.
func TestPropertyPlaceAllThatFits(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		entries, req := genEntries(t), genRequest(t)
		plan := mustPlace(t, entries, req)
		room := 0
		for _, e := range entries {
			k := 0
			for k < req.Want && fits(e, req, k+1) {
				k++
			}
			room += k
		}
		if got, want := sum(plan.Add), min(req.Want, room); got != want || plan.Shortfall != req.Want-want {
			t.Fatalf("placed %d short %d, want %d short %d (room %d)", got, plan.Shortfall, want, req.Want-want, room)
		}
		var want []placement.Skip
		for _, e := range entries {
			if why := whyFull(e, req, plan.Add[e.Name]+1); why != "" {
				want = append(want, placement.Skip{Entry: e.Name, Reason: why})
			}
		}
		slices.SortFunc(want, func(a, b placement.Skip) int { return strings.Compare(a.Entry, b.Entry) })
		if diff := cmp.Diff(want, plan.Skipped); diff != "" {
			t.Fatalf("Skipped (-want +got):\n%s", diff)
		}
		if plan.Shortfall > 0 && len(plan.Skipped) != len(entries) {
			t.Fatalf("short %d with %d of %d entries skipped", plan.Shortfall, len(plan.Skipped), len(entries))
		}
	})
}

// An entry that got a child holds at most one more than any entry that
// still has room: it was the least loaded when it got its last one. When
// it holds exactly one more, it was preferred then (more free memory, then
// name).
func TestPropertyPlaceSpread(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		entries, req := genEntries(t), genRequest(t)
		checkSpread(t, entries, req, mustPlace(t, entries, req))
	})
}

// The same, where only memory limits and breaks ties: every entry
// reachable with a known capacity and no CPU limit, no MaxPerEntry, so
// the free memory a plan leaves decides more often.
func TestPropertyPlaceSpreadByMemory(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		entries := rapid.SliceOfNDistinct(rapid.Custom(func(t *rapid.T) placement.Entry {
			return placement.Entry{
				Name:      rapid.StringMatching(`[a-f]`).Draw(t, "name"),
				Reachable: true,
				Current:   rapid.IntRange(0, 3).Draw(t, "current"),
				Capacity:  &egressproxy.Capacity{MemoryAvailableBytes: rapid.Int64Range(0, 16).Draw(t, "memoryHalfGiB") * gib / 2},
			}
		}), 2, 6, func(e placement.Entry) string { return e.Name }).Draw(t, "entries")
		req := placement.Request{
			Want: rapid.IntRange(1, 12).Draw(t, "want"),
			Need: placement.Resources{MemoryBytes: rapid.SampledFrom([]int64{gib / 2, gib, 2 * gib}).Draw(t, "needMemory")},
		}
		checkSpread(t, entries, req, mustPlace(t, entries, req))
	})
}

func checkSpread(t *rapid.T, entries []placement.Entry, req placement.Request, plan placement.Plan) {
	for _, a := range entries {
		na := plan.Add[a.Name]
		if na == 0 {
			continue
		}
		for _, b := range entries {
			nb := plan.Add[b.Name]
			if a.Name == b.Name || !fits(b, req, nb+1) {
				continue
			}
			fa, fb := a.Current+na, b.Current+nb
			if fa > fb+1 {
				t.Fatalf("%s holds %d after +%d, %s holds %d after +%d and has room", a.Name, fa, na, b.Name, fb, nb)
			}
			freeA, freeB := freeAfter(a, req, na-1), freeAfter(b, req, nb)
			if fa == fb+1 && (freeA < freeB || freeA == freeB && a.Name > b.Name) {
				t.Fatalf("%s got its last child (free %d) before %s (free %d), equally loaded", a.Name, freeA, b.Name, freeB)
			}
		}
	}
}

// When no limit binds (no MaxPerEntry, capacity unknown or ample) and the
// reachable entries start within one of each other, they end within one,
// with all of Want placed when any entry is reachable.
func TestPropertyPlaceEvenWhenNothingBinds(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		base := rapid.IntRange(0, 4).Draw(t, "base")
		entries := rapid.SliceOfNDistinct(rapid.Custom(func(t *rapid.T) placement.Entry {
			e := placement.Entry{
				Name:      rapid.StringMatching(`[a-f]{1,2}`).Draw(t, "name"),
				Reachable: rapid.IntRange(0, 3).Draw(t, "reachable") > 0,
				Current:   base + rapid.IntRange(0, 1).Draw(t, "above"),
			}
			if rapid.Bool().Draw(t, "capacityKnown") {
				e.Capacity = &egressproxy.Capacity{MemoryAvailableBytes: rapid.Int64Range(64, 128).Draw(t, "memoryGiB") * gib, CPUs: 64}
			}
			return e
		}), 0, 12, func(e placement.Entry) string { return e.Name }).Draw(t, "entries")
		req := placement.Request{Want: rapid.IntRange(0, 30).Draw(t, "want"), Need: small}
		plan := mustPlace(t, entries, req)
		var after []int
		for _, e := range entries {
			if e.Reachable {
				after = append(after, e.Current+plan.Add[e.Name])
			}
		}
		if len(after) == 0 {
			return
		}
		if plan.Shortfall != 0 || slices.Max(after)-slices.Min(after) > 1 {
			t.Fatalf("reachable entries end at %v, %d short", after, plan.Shortfall)
		}
	})
}

// The same entries in any order give the same plan, and Place leaves its
// input as it was.
func TestPropertyPlaceDeterministic(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		entries, req := genEntries(t), genRequest(t)
		before := deepCopy(entries)
		plan := mustPlace(t, entries, req)
		if diff := cmp.Diff(before, entries); diff != "" {
			t.Fatalf("Place changed its input (-before +after):\n%s", diff)
		}
		again := mustPlace(t, rapid.Permutation(entries).Draw(t, "order"), req)
		if diff := cmp.Diff(plan, again); diff != "" {
			t.Fatalf("another order (-first +second):\n%s", diff)
		}
	})
}

// Placing k, then Want-k on the entries as the first plan leaves them,
// adds up to placing Want at once.
func TestPropertyPlaceInSteps(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		entries, req := genEntries(t), genRequest(t)
		whole := mustPlace(t, entries, req)
		first, rest := req, req
		first.Want = rapid.IntRange(0, req.Want).Draw(t, "k")
		rest.Want = req.Want - first.Want
		p1 := mustPlace(t, entries, first)
		p2 := mustPlace(t, apply(entries, p1.Add, 1, req.Need), rest)
		added := maps.Clone(p1.Add)
		for name, n := range p2.Add {
			added[name] += n
		}
		if diff := cmp.Diff(whole.Add, added); diff != "" {
			t.Fatalf("Add, at once (-) and in steps (+):\n%s", diff)
		}
		if whole.Shortfall != p1.Shortfall+p2.Shortfall {
			t.Fatalf("short %d at once, %d+%d in steps", whole.Shortfall, p1.Shortfall, p2.Shortfall)
		}
		if diff := cmp.Diff(whole.Skipped, p2.Skipped); diff != "" {
			t.Fatalf("Skipped, at once (-) and in steps (+):\n%s", diff)
		}
	})
}

// Remove takes what there is, never below zero, up to n; unreachable
// entries' children first; then from the fullest, so an entry that lost
// one holds at most one fewer than any other entry of its kind, and when
// exactly one fewer it was preferred (less free memory, then name).
func TestPropertyRemove(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		entries := genEntries(t)
		n := rapid.IntRange(0, 40).Draw(t, "n")
		before := deepCopy(entries)
		out := mustRemove(t, entries, n)
		if diff := cmp.Diff(before, entries); diff != "" {
			t.Fatalf("Remove changed its input (-before +after):\n%s", diff)
		}
		total, reachableLost, unreachableLeft := 0, false, false
		final := map[string]int{}
		for _, e := range entries {
			total += e.Current
			final[e.Name] = e.Current - out[e.Name]
			reachableLost = reachableLost || e.Reachable && out[e.Name] > 0
			unreachableLeft = unreachableLeft || !e.Reachable && final[e.Name] > 0
		}
		for name, k := range out {
			if _, ok := final[name]; !ok || k <= 0 || final[name] < 0 {
				t.Fatalf("removes %d from %q: want a positive count no greater than an entry's Current", k, name)
			}
		}
		if got := sum(out); got != min(n, total) {
			t.Fatalf("removes %d of %d, want %d", got, total, min(n, total))
		}
		if reachableLost && unreachableLeft {
			t.Fatalf("removes from a reachable entry while an unreachable one keeps children: %v from %+v", out, entries)
		}
		checkFullestFirst(t, entries, out, final)
	})
}

// checkFullestFirst checks that an entry that lost a child holds at most
// one fewer than any other of its kind (reachable or not), and when
// exactly one fewer, was preferred when it lost its last.
func checkFullestFirst(t *rapid.T, entries []placement.Entry, out, final map[string]int) {
	for _, a := range entries {
		if out[a.Name] == 0 {
			continue
		}
		for _, b := range entries {
			if a.Name == b.Name || a.Reachable != b.Reachable {
				continue
			}
			if final[a.Name]+1 < final[b.Name] {
				t.Fatalf("%s left with %d, %s with %d", a.Name, final[a.Name], b.Name, final[b.Name])
			}
			freeA, freeB := freeAfter(a, placement.Request{}, 0), freeAfter(b, placement.Request{}, 0)
			if final[a.Name]+1 == final[b.Name] && (freeA > freeB || freeA == freeB && a.Name > b.Name) {
				t.Fatalf("%s (free %d) lost its last child before %s (free %d), equally full", a.Name, freeA, b.Name, freeB)
			}
		}
	}
}

// Remove gives the same answer in any order of the entries, and removing
// k, then n-k from the entries with their Current lowered by the first
// answer, adds up to removing n at once.
func TestPropertyRemoveDeterministicInSteps(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		entries := genEntries(t)
		n := rapid.IntRange(0, 40).Draw(t, "n")
		whole := mustRemove(t, entries, n)
		if diff := cmp.Diff(whole, mustRemove(t, rapid.Permutation(entries).Draw(t, "order"), n)); diff != "" {
			t.Fatalf("another order (-first +second):\n%s", diff)
		}
		k := rapid.IntRange(0, n).Draw(t, "k")
		first := mustRemove(t, entries, k)
		removed := maps.Clone(first)
		left := slices.Clone(entries)
		for i := range left {
			left[i].Current -= first[left[i].Name]
		}
		for name, m := range mustRemove(t, left, n-k) {
			removed[name] += m
		}
		if diff := cmp.Diff(whole, removed); diff != "" {
			t.Fatalf("at once (-) and in steps (+):\n%s", diff)
		}
	})
}

func deepCopy(entries []placement.Entry) []placement.Entry {
	out := slices.Clone(entries)
	for i := range out {
		if c := out[i].Capacity; c != nil {
			cc := *c
			out[i].Capacity = &cc
		}
	}
	return out
}
