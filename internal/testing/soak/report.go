package soak

import (
	"fmt"
	"io"
	"maps"
	"slices"
	"sort"
	"strings"
	"time"
)

// Meta is what the report says about the run besides its events.
type Meta struct {
	Seed        uint64
	Duration    time.Duration // as asked (SOAK)
	Elapsed     time.Duration // wall time of the whole run
	Hosts       int
	Command     string // how to run it again
	Converged   time.Duration
	Bound       time.Duration // the documented convergence bound
	WarmRSS     int64         // bytes, after warm-up
	EndRSS      int64
	PeakRSS     int64
	WarmGor     int
	EndGor      int
	PeakGor     int
	Notes       []string
	StartedAt   time.Time
	ReplicaNote string
}

// Stats summarise one kind of call.
type Stats struct {
	N        int
	Classes  map[string]int
	P50, P99 time.Duration
	Max      time.Duration
}

// Report is the summary docs/soak.md shows.
type Report struct {
	Meta       Meta
	Ops        map[string]int // scheduled operations applied, per kind
	Faults     map[string]int // faults injected, per kind
	Calls      map[string]*Stats
	TotalCalls int
	Checks     map[string]int
	Violations []Violation
	// Recover is, per fault kind, the time from each fault's end to the
	// next successful call on its host (mirror faults: the next successful
	// create anywhere; driver-sigkill: the restarted driver's first
	// successful call); Unrecovered counts faults with none after them.
	Recover     map[string][]time.Duration
	Unrecovered map[string]int
}

// Percentile returns the p-th percentile (0..100, nearest rank) of ds.
func Percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(float64(len(s))*p/100+0.999999) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// Summarize builds the report of a run from its events and checker.
func Summarize(meta Meta, events []Event, c *Checker) Report {
	r := Report{Meta: meta, Ops: map[string]int{}, Faults: map[string]int{}, Calls: map[string]*Stats{},
		Recover: map[string][]time.Duration{}, Unrecovered: map[string]int{}}
	lat := map[string][]time.Duration{}
	for _, e := range events {
		switch e.Kind {
		case EvStep:
			if Kind(e.Op).IsFault() {
				r.Faults[e.Op]++
			} else {
				r.Ops[e.Op]++
			}
		case EvCall:
			s := r.Calls[e.Op]
			if s == nil {
				s = &Stats{Classes: map[string]int{}}
				r.Calls[e.Op] = s
			}
			s.N++
			s.Classes[e.Result]++
			r.TotalCalls++
			lat[e.Op] = append(lat[e.Op], e.Latency)
		}
	}
	for op, ds := range lat {
		s := r.Calls[op]
		s.P50, s.P99, s.Max = Percentile(ds, 50), Percentile(ds, 99), slices.Max(ds)
	}
	for i, e := range events {
		if e.Kind != EvFaultEnd {
			continue
		}
		found := false
		for _, f := range events[i+1:] {
			if f.Kind != EvCall || f.Result != "OK" || f.Op == "open" || f.Op == "health-round" {
				continue // opening an entry and a round with no address to probe touch no host
			}
			mirrorFault := strings.HasPrefix(e.Op, "mirror-")
			if (e.Host > 0 && f.Host == e.Host) || (mirrorFault && f.Op == "create") || (e.Host == 0 && !mirrorFault) {
				// f.T is when the call returned; it may have started
				// during the fault.
				r.Recover[e.Op] = append(r.Recover[e.Op], max(f.T.Sub(e.T), 0))
				found = true
				break
			}
		}
		if !found {
			r.Unrecovered[e.Op]++
		}
	}
	if c != nil {
		r.Checks = c.Checks()
		r.Violations = c.Violations()
	}
	return r
}

func ms(d time.Duration) string {
	switch {
	case d >= 10*time.Second:
		return d.Round(100 * time.Millisecond).String()
	case d >= time.Millisecond:
		return d.Round(time.Millisecond).String()
	}
	return d.Round(time.Microsecond).String()
}

func mib(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }

// Write writes the report as Markdown (docs/soak.md).
func (r Report) Write(w io.Writer) error {
	var b strings.Builder
	m := r.Meta
	fmt.Fprintf(&b, "# Chaos soak\n\n")
	fmt.Fprintf(&b, "Written by `make soak` (internal/testing/soak, TestSoak) — do not edit by hand.\n\n")
	fmt.Fprintf(&b, "- run: %v asked, %v wall time in all, %d lab hosts, started %s\n", m.Duration, m.Elapsed.Round(time.Second), m.Hosts, m.StartedAt.UTC().Format(time.RFC3339))
	fmt.Fprintf(&b, "- seed: %d — replay: `%s`\n", m.Seed, m.Command)
	fmt.Fprintf(&b, "- calls: %d; operations: %d; faults: %d; violations: **%d**\n", r.TotalCalls, sum(r.Ops), sum(r.Faults), len(r.Violations))
	fmt.Fprintf(&b, "- converged %v after the last fault ended (bound %v)\n", m.Converged.Round(100*time.Millisecond), m.Bound)
	fmt.Fprintf(&b, "- driver RSS: %s after warm-up, %s at the end, peak %s; goroutines: %d after warm-up, %d at the end, peak %d\n",
		mib(m.WarmRSS), mib(m.EndRSS), mib(m.PeakRSS), m.WarmGor, m.EndGor, m.PeakGor)
	for _, n := range m.Notes {
		fmt.Fprintf(&b, "- %s\n", n)
	}
	b.WriteString("\n## Operations (changes of the desired set)\n\n| kind | count |\n| --- | ---: |\n")
	for _, k := range OpKinds {
		fmt.Fprintf(&b, "| %s | %d |\n", k, r.Ops[string(k)])
	}
	b.WriteString("\n## Faults\n\n| kind | injected | time to recover p50 | p99 | max | no success after |\n| --- | ---: | ---: | ---: | ---: | ---: |\n")
	for _, k := range FaultKinds {
		ds := r.Recover[string(k)]
		p50, p99, mx := "-", "-", "-"
		if len(ds) > 0 {
			p50, p99, mx = ms(Percentile(ds, 50)), ms(Percentile(ds, 99)), ms(slices.Max(ds))
		}
		fmt.Fprintf(&b, "| %s | %d | %s | %s | %s | %d |\n", k, r.Faults[string(k)], p50, p99, mx, r.Unrecovered[string(k)])
	}
	b.WriteString("\nTime to recover: from the fault's end to the next successful call on its host (mirror faults: the next successful create on any host; driver-sigkill: from the restart to the new driver's first successful call); \"no success after\" counts faults no such call followed (a mirror fault after the last create of the run).\n")
	b.WriteString("\n## Calls\n\n| call | count | p50 | p99 | max | results |\n| --- | ---: | ---: | ---: | ---: | --- |\n")
	for _, op := range slices.Sorted(maps.Keys(r.Calls)) {
		s := r.Calls[op]
		var cls []string
		for _, k := range slices.Sorted(maps.Keys(s.Classes)) {
			cls = append(cls, fmt.Sprintf("%s %d", k, s.Classes[k]))
		}
		fmt.Fprintf(&b, "| %s | %d | %s | %s | %s | %s |\n", op, s.N, ms(s.P50), ms(s.P99), ms(s.Max), strings.Join(cls, ", "))
	}
	b.WriteString("\n## Invariants\n\n| invariant | checks |\n| --- | ---: |\n")
	names := slices.Sorted(maps.Keys(r.Checks))
	for _, n := range names {
		fmt.Fprintf(&b, "| %s | %d |\n", n, r.Checks[n])
	}
	fmt.Fprintf(&b, "\n## Violations: %d\n\n", len(r.Violations))
	vs := slices.Clone(r.Violations)
	sort.SliceStable(vs, func(i, j int) bool { return vs[i].T.Before(vs[j].T) })
	for _, v := range vs {
		fmt.Fprintf(&b, "- %s `%s`: %s\n", v.T.UTC().Format("15:04:05.000"), v.Check, v.Detail)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func sum(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}
