package placement

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
)

// DefaultVCPUsPerCPU is how many proxy vCPUs one logical CPU of a host
// carries when Request.VCPUsPerCPU is zero: proxies mostly wait on the
// network, so a host's CPUs are shared among several, though not so many
// that a busy pool starves its neighbours.
const DefaultVCPUsPerCPU = 4

// Entry is one provider entry as the pool sees it.
type Entry struct {
	// Name of the entry; unique among the entries passed.
	Name string
	// Reachable is the entry's last Check's Health.Reachable.
	Reachable bool
	// Capacity is the entry's last Check's Health.Capacity; nil when
	// unknown, which limits nothing. A caller that created children since
	// that Check counts them in, as Place does between its own steps
	// (see Place).
	Capacity *egressproxy.Capacity
	// Current is the number of this pool's children on the entry that are
	// alive; at least zero.
	Current int
}

// Resources is what one proxy of the pool takes from its host.
type Resources struct {
	// MemoryBytes is the proxy's guest memory; zero: memory limits
	// nothing.
	MemoryBytes int64
	// VCPUs is the proxy's virtual CPUs; zero: CPUs limit nothing.
	VCPUs int
}

// Request is what Place is asked to place.
type Request struct {
	// Want is how many new children to place; at least zero.
	Want int
	// MaxPerEntry is the most children of the pool an entry may hold;
	// zero: no limit.
	MaxPerEntry int
	// Need is what each child takes.
	Need Resources
	// VCPUsPerCPU is how many vCPUs one logical CPU of a host may carry;
	// zero means DefaultVCPUsPerCPU.
	VCPUsPerCPU int
}

// Reason says why an entry takes no more children.
type Reason string

// The reasons. When several limits bind at once, Place reports the first
// of them in this order.
const (
	ReasonUnreachable Reason = "Unreachable" // the entry's last Check was not Reachable
	ReasonMaxPerEntry Reason = "MaxPerEntry" // the entry holds Request.MaxPerEntry children or more
	ReasonMemoryFull  Reason = "MemoryFull"  // its available memory is less than Need.MemoryBytes
	ReasonCPUFull     Reason = "CPUFull"     // one more proxy would exceed its CPUs × VCPUsPerCPU
)

// Skip is an entry that takes no more children, and why.
type Skip struct {
	Entry  string // the entry's name
	Reason Reason // the first limit that binds, in the order of the Reasons
}

// Plan is Place's answer.
type Plan struct {
	// Add maps an entry's name to how many new children it gets; entries
	// that get none are absent. Never nil.
	Add map[string]int
	// Shortfall is how many of Request.Want fit nowhere.
	Shortfall int
	// Skipped lists, by entry name, every entry that cannot take one more
	// child once Add is carried out. When Shortfall is not zero, that is
	// every entry.
	Skipped []Skip
}

// Place chooses the entries for req.Want new children: one at a time, each
// on the least loaded entry (Current plus what the plan adds) among those
// that can take one more; equally loaded entries are taken by more free
// memory left (an unknown capacity counts as less than any known), then by
// name. An entry can take one more when it is Reachable, holds fewer than
// req.MaxPerEntry children (when that is not zero), and, when its Capacity
// is known, has MemoryAvailableBytes for all the children the plan puts on
// it and CPUs × VCPUsPerCPU for (Capacity.Instances + those children) ×
// Need.VCPUs, each running instance counted at the pool's size. What fits
// nowhere is the plan's Shortfall.
//
// Place(k) and then, on the entries as that plan leaves them (Current and
// Capacity.Instances up by each entry's Add, MemoryAvailableBytes down by
// Add × Need.MemoryBytes), Place(Want−k), add up to Place(Want): placing
// in steps places as placing at once does. Place takes time proportional
// to Want times the number of entries.
//
// Invalid input (a negative number, an empty or repeated name) is
// reported all at once, each a *egressproxy.FieldError, classed
// Permanent.
func Place(entries []Entry, req Request) (Plan, error) {
	bad := append(checkEntries(entries), checkRequest(req)...)
	if len(bad) > 0 {
		return Plan{}, invalid(bad)
	}
	hosts := make([]host, len(entries))
	for i, e := range entries {
		hosts[i] = newHost(e, req)
	}
	plan := Plan{Add: map[string]int{}}
	for placed := range req.Want {
		best := -1
		for i := range hosts {
			if hosts[i].room() > 0 && (best < 0 || lessLoaded(&hosts[i], &hosts[best])) {
				best = i
			}
		}
		if best < 0 {
			plan.Shortfall = req.Want - placed
			break
		}
		h := &hosts[best]
		h.added++
		if h.free >= 0 {
			h.free -= req.Need.MemoryBytes
		}
		plan.Add[h.name]++
	}
	slices.SortFunc(hosts, func(a, b host) int { return cmp.Compare(a.name, b.name) })
	for _, h := range hosts {
		if h.room() == 0 {
			plan.Skipped = append(plan.Skipped, Skip{Entry: h.name, Reason: h.reason})
		}
	}
	return plan, nil
}

// Remove chooses the entries that lose n children: one at a time, first
// from the unreachable entries that hold any, then from the fullest entry
// (Current less what is removed); equally full entries lose by less free
// memory (an unknown capacity counts as less than any known), then by
// name. It returns how many each loses (entries that lose none are
// absent; never nil), in all the fewer of n and the entries' Currents.
// Removing k, then n−k from the entries with Current lowered by the first
// answer, adds up to removing n at once. Invalid input is reported as
// Place reports it.
func Remove(entries []Entry, n int) (map[string]int, error) {
	bad := checkEntries(entries)
	if n < 0 {
		bad = append(bad, &egressproxy.FieldError{Field: "n", Value: strconv.Itoa(n), Rule: "must not be negative"})
	}
	if len(bad) > 0 {
		return nil, invalid(bad)
	}
	left := make([]int, len(entries))
	for i, e := range entries {
		left[i] = e.Current
	}
	out := map[string]int{}
	for range n {
		best := -1
		for i := range entries {
			if left[i] > 0 && (best < 0 || removeFirst(&entries[i], left[i], &entries[best], left[best])) {
				best = i
			}
		}
		if best < 0 {
			break
		}
		left[best]--
		out[entries[best].Name]++
	}
	return out, nil
}

// host is an entry during Place.
type host struct {
	name    string
	current int    // Entry.Current
	added   int    // what the plan puts on it
	limit   int    // the most it can be given; math.MaxInt: no limit
	reason  Reason // what limit stands for
	free    int64  // memory left after added; -1: unknown
}

func newHost(e Entry, req Request) host {
	h := host{name: e.Name, current: e.Current, limit: math.MaxInt, free: -1}
	if !e.Reachable {
		h.limit, h.reason = 0, ReasonUnreachable
		return h
	}
	if req.MaxPerEntry > 0 {
		h.tighten(req.MaxPerEntry-e.Current, ReasonMaxPerEntry)
	}
	c := e.Capacity
	if c == nil {
		return h
	}
	h.free = c.MemoryAvailableBytes
	if req.Need.MemoryBytes > 0 {
		h.tighten(clampInt(c.MemoryAvailableBytes/req.Need.MemoryBytes), ReasonMemoryFull)
	}
	if req.Need.VCPUs > 0 && c.CPUs > 0 {
		perCPU := cmp.Or(req.VCPUsPerCPU, DefaultVCPUsPerCPU)
		slots := math.MaxInt
		if c.CPUs <= math.MaxInt/perCPU {
			slots = c.CPUs * perCPU / req.Need.VCPUs
		}
		h.tighten(slots-c.Instances, ReasonCPUFull)
	}
	return h
}

// tighten lowers h's limit to n (at least zero) for reason; a limit that
// is already as low keeps its reason, so reasons rank in declaration order.
func (h *host) tighten(n int, reason Reason) {
	if n = max(n, 0); n < h.limit {
		h.limit, h.reason = n, reason
	}
}

func (h *host) room() int { return h.limit - h.added }

// lessLoaded reports whether Place prefers a to b.
func lessLoaded(a, b *host) bool {
	if la, lb := a.current+a.added, b.current+b.added; la != lb {
		return la < lb
	}
	if a.free != b.free {
		return a.free > b.free
	}
	return a.name < b.name
}

// removeFirst reports whether Remove prefers a, holding left children, to
// b, holding bLeft.
func removeFirst(a *Entry, left int, b *Entry, bLeft int) bool {
	if a.Reachable != b.Reachable {
		return !a.Reachable
	}
	if left != bLeft {
		return left > bLeft
	}
	if fa, fb := freeMemory(a), freeMemory(b); fa != fb {
		return fa < fb
	}
	return a.Name < b.Name
}

func freeMemory(e *Entry) int64 {
	if e.Capacity == nil {
		return -1
	}
	return e.Capacity.MemoryAvailableBytes
}

func clampInt(n int64) int {
	if n > math.MaxInt {
		return math.MaxInt
	}
	return int(n)
}

func checkEntries(entries []Entry) []error {
	var bad []error
	seen := make(map[string]bool, len(entries))
	for i, e := range entries {
		at := fmt.Sprintf("entries[%d].", i)
		switch {
		case e.Name == "":
			bad = append(bad, &egressproxy.FieldError{Field: at + "Name", Rule: "must not be empty"})
		case seen[e.Name]:
			bad = append(bad, &egressproxy.FieldError{Field: at + "Name", Value: e.Name, Rule: "names an earlier entry"})
		}
		seen[e.Name] = true
		bad = nonNegative(bad, at+"Current", int64(e.Current))
		if c := e.Capacity; c != nil {
			bad = nonNegative(bad, at+"Capacity.MemoryAvailableBytes", c.MemoryAvailableBytes)
			bad = nonNegative(bad, at+"Capacity.CPUs", int64(c.CPUs))
			bad = nonNegative(bad, at+"Capacity.Instances", int64(c.Instances))
		}
	}
	return bad
}

func checkRequest(req Request) []error {
	var bad []error
	bad = nonNegative(bad, "Want", int64(req.Want))
	bad = nonNegative(bad, "MaxPerEntry", int64(req.MaxPerEntry))
	bad = nonNegative(bad, "Need.MemoryBytes", req.Need.MemoryBytes)
	bad = nonNegative(bad, "Need.VCPUs", int64(req.Need.VCPUs))
	return nonNegative(bad, "VCPUsPerCPU", int64(req.VCPUsPerCPU))
}

func nonNegative(bad []error, field string, n int64) []error {
	if n < 0 {
		bad = append(bad, &egressproxy.FieldError{Field: field, Value: strconv.FormatInt(n, 10), Rule: "must not be negative"})
	}
	return bad
}

func invalid(bad []error) error {
	return driver.Errorf(egressproxy.Permanent, "placement: %w", errors.Join(bad...))
}
