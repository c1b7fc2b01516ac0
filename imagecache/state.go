package imagecache

import (
	"slices"
	"time"
)

// action is what the cache does next for one base, decided from one
// snapshot of the pool's volume names.
type action int

const (
	// actHit: base plus exactly one well-formed marker that matches the
	// configured digest (or any, when none is configured): use it.
	actHit action = iota
	// actMismatch: the marker's digest differs from the configured one. A
	// permanent error; nothing is touched (running VMs may use the base).
	actMismatch
	// actAmbiguous: several well-formed markers with different digests. A
	// permanent error; nothing is touched.
	actAmbiguous
	// actWait: no usable base and another writer holds a fresh claim:
	// poll until it publishes or gives up.
	actWait
	// actAcquire: the base must be (re)fetched or debris removed, and we
	// hold no claim yet: take one, then decide again.
	actAcquire
	// actBackOff: we hold a claim but so does someone else: drop ours,
	// wait a random moment and retry (Dekker-style: create, then look).
	actBackOff
	// actFetch: we hold the only fresh claim: remove Remove, then fetch.
	actFetch
)

var actionNames = [...]string{"hit", "mismatch", "ambiguous", "wait", "acquire", "backoff", "fetch"}

func (a action) String() string { return actionNames[a] }

// decision is the outcome of decide.
type decision struct {
	Action action
	// Digest is the marker digest (actHit, actMismatch).
	Digest string
	// Digests are the distinct well-formed marker digests (actAmbiguous).
	Digests []string
	// Reason says why the base is not usable (debris kinds), for logs.
	Reason string
	// Remove lists debris volumes to delete. For actFetch, only the holder
	// of the sole fresh claim may delete them. For every other action it
	// holds only volumes no live writer can own (stale claims, and for a
	// hit, malformed markers beside the good one), which anyone may delete.
	Remove []string
	// Others are fresh claims of other writers.
	Others []string
}

// snapshot is the input of decide: the pool's volume names at one instant.
type snapshot struct {
	Names      []string      // every volume name in the pool
	Base       string        // BaseName(entry, key, format)
	Want       string        // configured sha256, "" when none
	Own        string        // our claim volume name, "" when we hold none
	Now        time.Time     // our clock
	StaleAfter time.Duration // a claim older than this is debris
}

// decide is the cache-state decision table. It is pure.
//
//	base  markers (well-formed / other)  claims        → action
//	yes   1 digest, matches or no want   any           → hit
//	yes   1 digest, differs from want    any           → mismatch (permanent, touch nothing)
//	yes   ≥2 distinct digests            any           → ambiguous (permanent, touch nothing)
//	yes   0 well-formed                  fresh other   → wait
//	yes   0 well-formed                  none / own    → debris: remove base + markers, fetch
//	no    any (debris)                   fresh other   → wait
//	no    any (debris)                   none / own    → remove markers, fetch
//
// "fetch" is actAcquire without a claim, actBackOff when others also hold
// one, actFetch when ours is the only fresh claim.
func decide(s snapshot) decision {
	var (
		hasBase         bool
		valid           []string // distinct well-formed digests
		markers         []string // every marker volume of this base
		invalidMarkers  []string
		others, staleCl []string
	)
	for _, n := range s.Names {
		switch {
		case n == s.Base:
			hasBase = true
		case isMarkerOf(s.Base, n):
			markers = append(markers, n)
			if d, _, ok := markerOf(s.Base, n); ok {
				if !slices.Contains(valid, d) {
					valid = append(valid, d)
				}
			} else {
				invalidMarkers = append(invalidMarkers, n)
			}
		default:
			b, at, ok := parseClaimName(n)
			if !ok || b != s.Base || n == s.Own {
				continue
			}
			if age := s.Now.Sub(at); age > s.StaleAfter || age < -s.StaleAfter {
				staleCl = append(staleCl, n)
			} else {
				others = append(others, n)
			}
		}
	}
	slices.Sort(valid)
	d := decision{Remove: staleCl, Others: others}
	var debris []string

	if hasBase {
		switch len(valid) {
		case 1:
			d.Digest = valid[0]
			if s.Want == "" || s.Want == valid[0] {
				d.Action = actHit
				d.Remove = append(slices.Clip(d.Remove), invalidMarkers...)
				return d
			}
			d.Action = actMismatch
			d.Remove = staleCl
			return d
		case 0:
			d.Reason = "base without marker"
			if len(invalidMarkers) > 0 {
				d.Reason = "marker is not a digest"
			}
			debris = append(append(debris, s.Base), markers...)
		default:
			d.Action = actAmbiguous
			d.Digests = valid
			d.Remove = staleCl
			return d
		}
	} else {
		d.Reason = "no base"
		debris = append(debris, markers...)
	}
	switch {
	case s.Own == "" && len(others) > 0:
		d.Action = actWait
	case s.Own == "":
		d.Action = actAcquire
	case len(others) > 0:
		d.Action = actBackOff
	default:
		d.Action = actFetch
		d.Remove = append(slices.Clip(d.Remove), debris...)
	}
	return d
}

// isMarkerOf reports whether n belongs to base as a marker (well-formed or
// not): it starts with "<base>.sha256" but is not itself a base name and not
// a well-formed marker of another base (a key may contain ".sha256").
func isMarkerOf(base, n string) bool {
	if _, cand, _ := markerOf(base, n); !cand {
		return false
	}
	if _, _, _, ok := ParseBaseName(n); ok {
		return false
	}
	if b, _, ok := ParseMarkerName(n); ok && b != base {
		return false
	}
	return true
}
