package basecache

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"pgregory.net/rapid"
)

var (
	dA    = strings.Repeat("a", 64)
	dB    = strings.Repeat("b", 64)
	t0    = time.Unix(1_800_000_000, 0)
	stale = 40 * time.Minute
)

func TestDecideTable(t *testing.T) {
	t.Parallel()
	base := BaseName("e1", "deb", "qcow2")
	other := BaseName("e2", "deb", "qcow2")
	own := claimName(base, t0, "01")
	fresh := claimName(base, t0.Add(-time.Minute), "02")
	old := claimName(base, t0.Add(-stale-time.Second), "03")
	future := claimName(base, t0.Add(stale+time.Second), "04")
	for _, tt := range []struct {
		name  string
		names []string
		want  string
		own   string
		out   decision
	}{
		{"cold, no claim", nil, "", "", decision{Action: actAcquire, Reason: "no base"}},
		{"cold, own claim", []string{own}, "", own, decision{Action: actFetch, Reason: "no base"}},
		{"cold, other writer", []string{fresh}, "", "", decision{Action: actWait, Reason: "no base", Others: []string{fresh}}},
		{"cold, own and other claim", []string{own, fresh}, "", own, decision{Action: actBackOff, Reason: "no base", Others: []string{fresh}}},
		{"hit, none configured", []string{base, MarkerName(base, dA)}, "", "", decision{Action: actHit, Digest: dA}},
		{"hit, configured", []string{base, MarkerName(base, dA), fresh}, dA, "", decision{Action: actHit, Digest: dA, Others: []string{fresh}}},
		{"hit cleans stale claims and bad markers", []string{base, MarkerName(base, dA), base + ".sha256", old}, dA, "", decision{Action: actHit, Digest: dA, Remove: []string{old, base + ".sha256"}}},
		{"mismatch touches nothing", []string{base, MarkerName(base, dA), base + ".sha256-zz"}, dB, "", decision{Action: actMismatch, Digest: dA}},
		{"ambiguous", []string{base, MarkerName(base, dA), MarkerName(base, dB)}, "", own, decision{Action: actAmbiguous, Digests: []string{dA, dB}}},
		{"base without marker, no claim", []string{base}, "", "", decision{Action: actAcquire, Reason: "base without marker"}},
		{"base without marker, held", []string{base, own, old}, "", own, decision{Action: actFetch, Reason: "base without marker", Remove: []string{old, base}}},
		{"base without marker, live writer", []string{base, fresh}, "", "", decision{Action: actWait, Reason: "base without marker", Others: []string{fresh}}},
		{"marker not a digest, held", []string{base, base + ".sha256-xyz", own}, dA, own, decision{Action: actFetch, Reason: "marker is not a digest", Remove: []string{base, base + ".sha256-xyz"}}},
		{"marker without base, held", []string{MarkerName(base, dA), own}, "", own, decision{Action: actFetch, Reason: "no base", Remove: []string{MarkerName(base, dA)}}},
		{"future claim is stale", []string{future}, "", "", decision{Action: actAcquire, Reason: "no base", Remove: []string{future}}},
		{"other entry's volumes ignored", []string{other, MarkerName(other, dA), claimName(other, t0, "05"), "base-deb.qcow2", own}, "", own, decision{Action: actFetch, Reason: "no base"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			got := decide(snapshot{Names: tt.names, Base: base, Want: tt.want, Own: tt.own, Now: t0, StaleAfter: stale})
			if diff := cmp.Diff(tt.out, got, cmpopts.EquateEmpty()); diff != "" {
				t.Fatalf("decide mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

// Invariants of decide over random pool contents.
func TestPropertyDecide(t *testing.T) {
	t.Parallel()
	rapid.Check(t, func(t *rapid.T) {
		entry, key, format := genEntry(t, "entry"), genKey(t, "key"), genFormat(t, "format")
		base := BaseName(entry, key, format)
		digests := []string{dA, dB}
		var names []string
		hasBase := rapid.Bool().Draw(t, "hasBase")
		if hasBase {
			names = append(names, base)
		}
		validSet := map[string]bool{}
		for i := rapid.IntRange(0, 2).Draw(t, "nValid"); i > 0; i-- {
			d := rapid.SampledFrom(digests).Draw(t, "digest")
			validSet[d] = true
			names = append(names, MarkerName(base, d))
		}
		invalid := rapid.IntRange(0, 2).Draw(t, "nInvalid")
		for i := 0; i < invalid; i++ {
			names = append(names, base+".sha256"+rapid.SampledFrom([]string{"", "-", "-xyz", "-" + strings.Repeat("A", 64)}).Draw(t, "bad"))
		}
		fresh := rapid.IntRange(0, 2).Draw(t, "nFresh")
		var freshNames []string
		for i := 0; i < fresh; i++ {
			n := claimName(base, t0.Add(-time.Duration(rapid.IntRange(0, 30).Draw(t, "age"))*time.Minute), "f"+string(rune('0'+i)))
			freshNames = append(freshNames, n)
			names = append(names, n)
		}
		for i := rapid.IntRange(0, 2).Draw(t, "nStale"); i > 0; i-- {
			names = append(names, claimName(base, t0.Add(-stale-time.Hour), "e"+string(rune('0'+i))))
		}
		// Neighbours that must never be touched.
		oe := genEntry(t, "otherEntry")
		ob := BaseName(oe, key, format)
		foreign := []string{"base-" + key + "." + format, "base-" + key + ".qcow2"}
		if ob != base {
			foreign = append(foreign, ob, MarkerName(ob, dA), claimName(ob, t0.Add(-stale-time.Hour), "aa"))
		}
		names = append(names, foreign...)
		own := ""
		if rapid.Bool().Draw(t, "own") {
			own = claimName(base, t0, "00")
			names = append(names, own)
		}
		want := rapid.SampledFrom([]string{"", dA, dB}).Draw(t, "want")
		names = rapid.Permutation(names).Draw(t, "order")

		d := decide(snapshot{Names: names, Base: base, Want: want, Own: own, Now: t0, StaleAfter: stale})

		for _, r := range d.Remove {
			if slices.Contains(foreign, r) || r == own || slices.Contains(freshNames, r) {
				t.Fatalf("removes %q (foreign, own or live claim); decision %+v", r, d)
			}
			if d.Action != actFetch && r == base {
				t.Fatalf("removes the base without holding the only claim: %+v", d)
			}
			if d.Action != actFetch {
				if _, _, ok := ParseMarkerName(r); ok {
					t.Fatalf("removes a well-formed marker %q on %v", r, d.Action)
				}
			}
		}
		isHit := hasBase && len(validSet) == 1 && (want == "" || validSet[want])
		if (d.Action == actHit) != isHit {
			t.Fatalf("hit = %v, want %v: %+v", d.Action == actHit, isHit, d)
		}
		if d.Action == actMismatch && (!hasBase || len(validSet) != 1 || want == "" || validSet[want]) {
			t.Fatalf("mismatch without cause: %+v", d)
		}
		if d.Action == actFetch && (own == "" || fresh > 0) {
			t.Fatalf("fetch without sole claim: %+v", d)
		}
		if d.Action == actFetch && hasBase && !slices.Contains(d.Remove, base) {
			t.Fatalf("fetch over an existing base without removing it: %+v", d)
		}
	})
}

// Refreshed claims (tokens of tokenLen hex digits): fresh while their
// newest volume is younger than HeartbeatStale, whatever the transfer
// budget; our own instance's claims that are not live are orphans, debris
// at once; claims of writers that do not refresh keep the budget rule.
func TestDecideRefreshedClaims(t *testing.T) {
	t.Parallel()
	const hb = 2 * time.Minute
	base := BaseName("e1", "deb", "qcow2")
	me := strings.Repeat("a", 2*instanceBytes)
	them := strings.Repeat("b", 2*instanceBytes)
	tokMine := me + strings.Repeat("1", 2*claimBytes)
	tokMyOther := me + strings.Repeat("2", 2*claimBytes)
	tokTheirs := them + strings.Repeat("3", 2*claimBytes)
	mine := claimName(base, t0, tokMine)
	mineOlder := claimName(base, t0.Add(-time.Minute), tokMine)
	theirsFresh := claimName(base, t0.Add(-time.Minute), tokTheirs)
	theirsPrev := claimName(base, t0.Add(-hb-time.Minute), tokTheirs)
	theirsDead := claimName(base, t0.Add(-hb-time.Second), tokTheirs)
	theirsDead2 := claimName(base, t0.Add(-hb-time.Hour), tokTheirs)
	myOrphan := claimName(base, t0, tokMyOther)
	legacy := claimName(base, t0.Add(-hb-time.Minute), "0f0f")
	for _, tt := range []struct {
		name  string
		names []string
		own   string
		live  []string
		out   decision
	}{
		{"crashed writer's claim is taken over after HeartbeatStale", []string{theirsDead, theirsDead2}, "", nil,
			decision{Action: actAcquire, Reason: "no base", Remove: []string{theirsDead, theirsDead2}}},
		{"a refreshing writer is waited for (its newest volume counts, once)", []string{theirsPrev, theirsFresh}, "", nil,
			decision{Action: actWait, Reason: "no base", Others: []string{theirsFresh}}},
		{"a writer that does not refresh keeps the budget rule", []string{legacy}, "", nil,
			decision{Action: actWait, Reason: "no base", Others: []string{legacy}}},
		{"our own orphan is reclaimed at once", []string{myOrphan}, "", nil,
			decision{Action: actAcquire, Reason: "no base", Remove: []string{myOrphan}}},
		{"our own live claim (another call of this cache) is respected", []string{myOrphan}, "", []string{tokMyOther},
			decision{Action: actWait, Reason: "no base", Others: []string{myOrphan}}},
		{"every volume of our token is ours (refresh in progress)", []string{mine, mineOlder}, tokMine, []string{tokMine},
			decision{Action: actFetch, Reason: "no base"}},
		{"held, and a crashed writer's claim is debris", []string{mine, theirsDead}, tokMine, []string{tokMine},
			decision{Action: actFetch, Reason: "no base", Remove: []string{theirsDead}}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			live := map[string]bool{}
			for _, l := range tt.live {
				live[l] = true
			}
			got := decide(snapshot{Names: tt.names, Base: base, OwnToken: tt.own, Now: t0, StaleAfter: stale,
				HeartbeatStale: hb, Instance: me, Live: live})
			if diff := cmp.Diff(tt.out, got, cmpopts.EquateEmpty()); diff != "" {
				t.Fatalf("decide mismatch (-want +got):\n%s", diff)
			}
		})
	}
}
