package basecache

import (
	"maps"
	"slices"
	"strings"
	"time"
)

// claimAt is one claim volume and its time.
type claimAt struct {
	name string
	at   time.Time
}

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
	StaleAfter time.Duration // a claim that is not refreshed and older than this is debris

	// Refreshed claims (a token of tokenLen hex digits, see claim.go).
	OwnToken       string          // token of the claim we hold, "" for none: every claim with it is ours
	HeartbeatStale time.Duration   // a refreshed claim whose newest volume is older than this is debris (0: StaleAfter)
	Instance       string          // our cache instance: a claim with this prefix...
	Live           map[string]bool // ...whose token is not live here is our own orphan: debris at once
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
		refreshed       = map[string][]claimAt{} // token -> its volumes
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
			b, at, tok, ok := parseClaim(n)
			if !ok || b != s.Base || n == s.Own || (s.OwnToken != "" && tok == s.OwnToken) {
				continue
			}
			if heartbeatToken(tok) {
				if s.Instance != "" && strings.HasPrefix(tok, s.Instance) && !s.Live[tok] {
					staleCl = append(staleCl, n) // ours, and we no longer hold it
					continue
				}
				refreshed[tok] = append(refreshed[tok], claimAt{n, at})
				continue
			}
			if age := s.Now.Sub(at); age > s.StaleAfter || age < -s.StaleAfter {
				staleCl = append(staleCl, n)
			} else {
				others = append(others, n)
			}
		}
	}
	// A refreshed claim is as fresh as its newest volume (its holder
	// creates the next one before it deletes the last).
	hbStale := s.HeartbeatStale
	if hbStale <= 0 {
		hbStale = s.StaleAfter
	}
	for _, tok := range slices.Sorted(maps.Keys(refreshed)) {
		vols := refreshed[tok]
		newest := vols[0]
		for _, v := range vols[1:] {
			if v.at.After(newest.at) {
				newest = v
			}
		}
		if age := s.Now.Sub(newest.at); age > hbStale || age < -hbStale {
			for _, v := range vols {
				staleCl = append(staleCl, v.name)
			}
		} else {
			others = append(others, newest.name)
		}
	}
	holding := s.Own != "" || s.OwnToken != ""
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
	case !holding && len(others) > 0:
		d.Action = actWait
	case !holding:
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
