package basecache

import (
	"fmt"
	"maps"
	"slices"
	"testing"
	"time"

	"pgregory.net/rapid"
)

// The claim protocol, modelled: writers create a claim, then look at the
// pool with decide; only actFetch lets a writer into the critical section
// (filling or deleting the base). Whatever the interleaving of writers on a
// shared pool (libvirt's volume create and list are atomic on the pool),
// at most one writer is ever in it, and a base is only used (hit) with a
// marker, never while someone fills it.
func TestPropertyClaimsMutuallyExclude(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		const base = "base-e--k.qcow2"
		now := time.Unix(1_800_000_000, 0)
		pool := map[string]bool{}
		if rapid.Bool().Draw(t, "debris") {
			pool[base] = true // a crashed writer's partial base, its claim gone stale
			pool[claimName(base, now.Add(-time.Hour), "dead")] = true
		}
		type writer struct {
			pc    string // idle, claimed, filling, done
			claim string
		}
		ws := make([]*writer, rapid.IntRange(2, 4).Draw(t, "writers"))
		for i := range ws {
			ws[i] = &writer{pc: "idle"}
		}
		states := func() []string {
			var out []string
			for _, w := range ws {
				out = append(out, w.pc+" "+w.claim)
			}
			return out
		}
		inside := func() int {
			n := 0
			for _, w := range ws {
				if w.pc == "filling" {
					n++
				}
			}
			return n
		}
		seq := 0
		for step := 0; step < 200; step++ {
			i := rapid.IntRange(0, len(ws)-1).Draw(t, "who")
			w := ws[i]
			switch w.pc {
			case "idle":
				seq++
				w.claim = claimName(base, now, fmt.Sprintf("%02x", seq))
				pool[w.claim] = true
				w.pc = "claimed"
			case "claimed":
				d := decide(snapshot{Names: slices.Collect(maps.Keys(pool)), Base: base, Own: w.claim, Now: now, StaleAfter: 40 * time.Minute})
				switch d.Action {
				case actFetch:
					for _, r := range d.Remove {
						delete(pool, r)
					}
					w.pc = "filling"
					pool[base] = true // created, being filled
					if inside() > 1 {
						t.Fatalf("two writers fill the base at once: %q", states())
					}
				case actBackOff:
					delete(pool, w.claim)
					w.pc = "idle"
				case actHit:
					delete(pool, w.claim)
					w.pc = "done"
				default:
					t.Fatalf("unexpected %v while holding a claim", d.Action)
				}
			case "filling":
				if rapid.Bool().Draw(t, "succeeds") {
					pool[MarkerName(base, dA)] = true
					w.pc = "done"
				} else {
					delete(pool, base) // failed: discard the volume
					w.pc = "idle"
				}
				delete(pool, w.claim)
			case "done":
			}
			// A reader never gets a base that a writer is still filling.
			r := decide(snapshot{Names: slices.Collect(maps.Keys(pool)), Base: base, Now: now, StaleAfter: 40 * time.Minute})
			if r.Action == actHit && inside() > 0 {
				t.Fatalf("a reader would use the base while it is being filled: %v", slices.Sorted(maps.Keys(pool)))
			}
		}
	})
}
