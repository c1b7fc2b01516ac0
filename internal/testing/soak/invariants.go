package soak

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"
)

// Invariant names, as counted in the report.
const (
	InvBudget       = "call-within-budget"
	InvPermanent    = "no-permanent-from-transient-fault"
	InvSecret       = "no-secret-in-logs-and-errors"
	InvConverged    = "converged-after-quiet"
	InvNoOrphans    = "no-orphans-after-gc"
	InvForeign      = "foreign-objects-untouched"
	InvGoroutines   = "goroutines-flat"
	InvRSS          = "rss-flat"
	InvClassKnown   = "one-known-class-per-error"
	InvDeleteFound  = "delete-notfound-is-done"
	InvDriverAlive  = "driver-ends-only-when-told"
	InvReleased     = "driver-releases-goroutines-on-close"
	InvDebris       = "no-debris-in-pool"
	InvBaseInUse    = "no-base-deleted-under-a-domain"
	InvGuestHealthy = "guest-probed-healthy"
)

// Violation is one broken invariant.
type Violation struct {
	T      time.Time `json:"t"`
	Check  string    `json:"check"`
	Detail string    `json:"detail"`
}

func (v Violation) String() string { return v.Check + ": " + v.Detail }

// Checker counts invariant checks and records violations; each violation
// also goes to the event log, with the seed and the last events printed by
// OnViolation. It is safe for concurrent use.
type Checker struct {
	mu          sync.Mutex
	checks      map[string]int
	violations  []Violation
	secrets     []string
	log         *Log
	OnViolation func(Violation) // optional, e.g. t.Errorf with the seed
}

// NewChecker returns a checker logging to log (may be nil) that treats
// each of secrets (empty ones ignored) as text no log line or error may
// hold.
func NewChecker(log *Log, secrets ...string) *Checker {
	c := &Checker{checks: map[string]int{}, log: log}
	for _, s := range secrets {
		if s != "" {
			c.secrets = append(c.secrets, s)
		}
	}
	return c
}

// Check counts one check of name and, when ok is false, records a
// violation with detail. It returns ok.
func (c *Checker) Check(name string, ok bool, detail string) bool {
	c.mu.Lock()
	c.checks[name]++
	var v *Violation
	if !ok {
		c.violations = append(c.violations, Violation{T: time.Now(), Check: name, Detail: detail})
		v = &c.violations[len(c.violations)-1]
	}
	onv := c.OnViolation
	c.mu.Unlock()
	if v != nil {
		if c.log != nil {
			c.log.Add(Event{Kind: EvViolation, Op: name, Detail: detail})
		}
		if onv != nil {
			onv(*v)
		}
	}
	return ok
}

// Checks returns the number of checks made per invariant.
func (c *Checker) Checks() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	m := make(map[string]int, len(c.checks))
	for k, v := range c.checks {
		m[k] = v
	}
	return m
}

// Violations returns the violations so far.
func (c *Checker) Violations() []Violation {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.violations)
}

// CheckText checks that text (a log line, an error text, a span
// attribute) holds none of the secrets; what names where it came from.
func (c *Checker) CheckText(what, text string) bool {
	for _, s := range c.secrets {
		if strings.Contains(text, s) {
			// The detail must not repeat the secret itself.
			return c.Check(InvSecret, false, fmt.Sprintf("%s holds a planted secret (%d bytes at offset %d)", what, len(s), strings.Index(text, s)))
		}
	}
	return c.Check(InvSecret, true, "")
}

// CheckBudget checks that a call of op that took took returned within
// budget plus grace (the slack a loaded machine needs to return after the
// deadline).
func (c *Checker) CheckBudget(op, instance string, took, budget, grace time.Duration) bool {
	return c.Check(InvBudget, took <= budget+grace,
		fmt.Sprintf("%s %s took %v, budget %v (+%v grace)", op, instance, took.Round(time.Millisecond), budget, grace))
}

// CheckClass checks a call's error class: every class the soak can meet
// is known, and Permanent is never one — each fault the soak injects is
// transient, so a Permanent error is a transient fault misclassified (or
// a reconciler bug). "Refused" is a Permanent error the operation returns
// by design (EvictImage of a base in use), classed so by the driver.
// active names the faults active when the call ran, for the detail.
func (c *Checker) CheckClass(op, instance, class, errText string, active []string) bool {
	switch class {
	case "OK", "Transient", "NotFound", "DeadlineExceeded", "Canceled", "Refused":
		c.Check(InvClassKnown, true, "")
	case "Permanent":
		c.Check(InvClassKnown, true, "")
		return c.Check(InvPermanent, false, fmt.Sprintf("%s %s: Permanent while faults %v: %s", op, instance, active, errText))
	default:
		return c.Check(InvClassKnown, false, fmt.Sprintf("%s %s: class %q: %s", op, instance, class, errText))
	}
	return c.Check(InvPermanent, true, "")
}

// Observed is one instance as the checker compares it: its name, UID and
// state (provider.State as text).
type Observed struct {
	Name, UID, State string
}

// Diff compares what List returned on a host with the desired set (name
// -> UID) and returns what differs, sorted: desired instances missing,
// not up or with another UID, and instances that are not desired. Up
// means in one of the states up (none given: "Running"). Empty means
// converged.
func Diff(desired map[string]string, actual []Observed, up ...string) []string {
	if len(up) == 0 {
		up = []string{"Running"}
	}
	var out []string
	seen := map[string]bool{}
	for _, a := range actual {
		seen[a.Name] = true
		uid, ok := desired[a.Name]
		switch {
		case !ok:
			out = append(out, fmt.Sprintf("undesired %s/%s (%s)", a.Name, a.UID, a.State))
		case uid != a.UID:
			out = append(out, fmt.Sprintf("%s has UID %s, want %s", a.Name, a.UID, uid))
		case !slices.Contains(up, a.State):
			out = append(out, fmt.Sprintf("%s/%s is %s, want %s", a.Name, a.UID, a.State, strings.Join(up, " or ")))
		}
	}
	for name, uid := range desired {
		if !seen[name] {
			out = append(out, fmt.Sprintf("missing %s/%s", name, uid))
		}
	}
	sort.Strings(out)
	return out
}

// VolumeDiff compares the pool's volumes of one entry's instances
// (prefix, e.g. "ep-<entry>--", stripped of nothing) with the desired
// names: every desired instance has its overlay "<prefix><name>.qcow2",
// and no volume with the prefix belongs to a name that is not desired.
func VolumeDiff(prefix string, desired []string, volumes []string) []string {
	var out []string
	want := map[string]bool{}
	for _, n := range desired {
		want[n] = true
		if !slices.Contains(volumes, prefix+n+".qcow2") {
			out = append(out, "missing overlay "+prefix+n+".qcow2")
		}
	}
	for _, v := range volumes {
		rest, ok := strings.CutPrefix(v, prefix)
		if !ok {
			continue
		}
		name := strings.TrimSuffix(strings.TrimSuffix(rest, ".qcow2"), "-seed.iso")
		if !want[name] {
			out = append(out, "orphan volume "+v)
		}
	}
	sort.Strings(out)
	return out
}

// CheckGrowth checks that end is at most limit (e.g. 0.10) above base,
// allowing slack in absolute units (a few goroutines or pages that come
// and go whatever the load).
func (c *Checker) CheckGrowth(name string, base, end int64, limit float64, slack int64) bool {
	bound := int64(float64(base)*(1+limit)) + slack
	return c.Check(name, end <= bound, fmt.Sprintf("%d after warm-up, %d at the end: more than +%.0f%% (+%d)", base, end, limit*100, slack))
}
