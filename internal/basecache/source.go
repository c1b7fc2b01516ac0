package basecache

import (
	"cmp"
	"fmt"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/egressproxy/egressproxy/imagecache"
)

// A shared download reads one source at a time: the mirror (the image's
// URL) or a peer's published base (see peer.go). It starts from the
// candidate with the best recent rate, measures it for SwitchAfter, and
// when that source is what holds its readers back (they waited for it
// most of the time) it switches to a candidate that is not known to be
// slower, resuming at the byte it has reached (a Range request, a
// StorageVolDownload at that offset): what was read stays read. The next
// measurement decides between the two, and a source that turns out
// clearly slower is left again. Rates are remembered per link (the
// mirror's host, a peer's host), not per image, for the next download's
// first choice.

const (
	// switchMargin: a source is clearly slower than another when its
	// rate times this is below the other's.
	switchMargin = 1.25
	// maxSwitches bounds the switches of one download (no flapping
	// between two sources of about the same rate).
	maxSwitches = 4
	// rateMemory: a link's rate older than this is not known any more
	// (the link, or what else crosses it, may have changed).
	rateMemory = 10 * time.Minute
)

// source is one candidate of a download.
type source struct {
	kind string    // imagecache.SourceMirror or imagecache.SourcePeer
	peer *peerBase // the base copied, for a peer
	link string    // the key its rate is remembered under

	// Under the download's mu:
	opened int     // times the download opened it
	rate   float64 // bytes/s the download measured it at (0: not yet)
	failed bool    // it failed in this download
}

func mirrorSource(rawURL string) *source {
	host := rawURL
	if u, err := url.Parse(rawURL); err == nil {
		host = u.Scheme + "://" + u.Host
	}
	return &source{kind: imagecache.SourceMirror, link: "mirror " + host}
}

func peerSource(pb *peerBase) *source {
	return &source{kind: imagecache.SourcePeer, peer: pb, link: "peer " + uuidString(pb.pool.UUID)}
}

// String names the source for logs: "mirror", or "peer <entry>".
func (s *source) String() string {
	if s.peer != nil {
		return s.kind + " " + s.peer.c.cfg.Entry
	}
	return s.kind
}

// segment: from offset from on, the download's bytes came from src.
type segment struct {
	from int64
	src  *source
}

// linkStats is what a Fanout remembers of one link as a source.
type linkStats struct {
	rate   float64   // bytes/s, last measured
	at     time.Time // when
	failed time.Time // a stream from it last failed
	busy   int       // streams from it in flight
}

func (f *Fanout) linkLocked(link string) *linkStats {
	if f.links == nil {
		f.links = map[string]*linkStats{}
	}
	st := f.links[link]
	if st == nil {
		st = &linkStats{}
		f.links[link] = st
	}
	return st
}

// knownRate is link's recent rate (0: not known).
func (f *Fanout) knownRate(link string) float64 {
	f.pmu.Lock()
	defer f.pmu.Unlock()
	return f.knownRateLocked(link)
}

func (f *Fanout) knownRateLocked(link string) float64 {
	st := f.links[link]
	if st == nil || time.Since(st.at) > rateMemory {
		return 0
	}
	return st.rate
}

// noteRate records a rate measured on link. bound says the source held
// its readers back, so that rate is the link's; otherwise the readers
// were slower and the rate is only a floor of the link's (it raises a
// known rate, never lowers it).
func (f *Fanout) noteRate(link string, rate float64, bound bool) {
	f.pmu.Lock()
	defer f.pmu.Unlock()
	st := f.linkLocked(link)
	if !bound && time.Since(st.at) <= rateMemory && st.rate > rate {
		rate = st.rate
	}
	st.rate, st.at = rate, time.Now()
}

// noteFailed records that a stream from link failed: a peer on it is not
// a candidate for peerBackoff.
func (f *Fanout) noteFailed(link string) {
	f.pmu.Lock()
	defer f.pmu.Unlock()
	f.linkLocked(link).failed = time.Now()
}

func (f *Fanout) failedLocked(link string) bool {
	st := f.links[link]
	return st != nil && !st.failed.IsZero() && time.Since(st.failed) < peerBackoff
}

// streaming counts a stream from link in flight until the returned func
// runs.
func (f *Fanout) streaming(link string) func() {
	f.pmu.Lock()
	f.linkLocked(link).busy++
	f.pmu.Unlock()
	return func() {
		f.pmu.Lock()
		f.linkLocked(link).busy--
		f.pmu.Unlock()
	}
}

// goingCold notes that c is fetching key (it found no usable base) until
// the returned func runs: no peer on c's host is a candidate of a
// download of key meanwhile (see candidates).
func (f *Fanout) goingCold(c *Cache, key fanKey) func() {
	f.pmu.Lock()
	if f.cold == nil {
		f.cold = map[fanKey]map[*Cache]int{}
	}
	if f.cold[key] == nil {
		f.cold[key] = map[*Cache]int{}
	}
	f.cold[key][c]++
	f.pmu.Unlock()
	return func() {
		f.pmu.Lock()
		defer f.pmu.Unlock()
		if f.cold[key][c]--; f.cold[key][c] == 0 {
			delete(f.cold[key], c)
		}
		if len(f.cold[key]) == 0 {
			delete(f.cold, key)
		}
	}
}

// candidates orders the sources a download of key may read, for c, which
// starts it: the peers (published bases on other hosts) and the mirror.
// Left out are a peer on the host of any cache fetching key now (c
// included: a host never copies from itself over the network, and a host
// receiving the image carries its own read-back on its link, so it would
// be a poor source and would need a second one for its own cache), a
// peer whose stream failed less than peerBackoff ago, and a second base
// on a host already listed. The order: sources whose rate is not known
// first (peers before the mirror, the least busy first), so that a link
// is measured once; then by recent rate, fastest first (peers first among
// equals). The mirror is always a candidate.
func (f *Fanout) candidates(key fanKey, peers []*peerBase) []*source {
	f.pmu.Lock()
	defer f.pmu.Unlock()
	var out []*source
	seen := map[string]bool{}
	for _, pb := range peers {
		s := peerSource(pb)
		if seen[s.link] || f.failedLocked(s.link) || f.hostColdLocked(key, pb) {
			continue
		}
		seen[s.link] = true
		out = append(out, s)
	}
	out = append(out, mirrorSource(key.url))
	rank := func(s *source) (known bool, rate float64, busy int) {
		rate = f.knownRateLocked(s.link)
		if st := f.links[s.link]; st != nil {
			busy = st.busy
		}
		return rate > 0, rate, busy
	}
	slices.SortStableFunc(out, func(a, b *source) int {
		ka, ra, ba := rank(a)
		kb, rb, bb := rank(b)
		switch {
		case ka != kb:
			if !ka {
				return -1
			}
			return 1
		case ra != rb:
			return cmp.Compare(rb, ra)
		case a.kind != b.kind:
			if a.kind == imagecache.SourcePeer {
				return -1
			}
			return 1
		}
		return cmp.Compare(ba, bb)
	})
	return out
}

// hostColdLocked reports whether a cache fetching key now is on pb's host.
func (f *Fanout) hostColdLocked(key fanKey, pb *peerBase) bool {
	for c := range f.cold[key] {
		if c.sameHost(pb.pool.UUID) {
			return true
		}
	}
	return false
}

// gauge measures a download's current source since its first byte, or
// since the last look.
type gauge struct {
	since time.Time // the interval's start (zero: no byte yet)
	bytes int64     // read from the source in the interval
	// starved is the time in the interval the pump waited for the source
	// while a reader waited at the head: the source held them back.
	starved time.Duration
	mark    time.Time // the last change of reading or waiting
	waiting int       // readers waiting at the head
	reading bool      // the pump is in a Read of the source
}

// account adds the time since the last change to starved, if it was.
func (g *gauge) account(now time.Time) {
	if g.reading && g.waiting > 0 && !g.mark.IsZero() {
		g.starved += now.Sub(g.mark)
	}
	g.mark = now
}

// decideLocked looks at the current source once it has been read for
// SwitchAfter since the last look: it records the source's rate for its
// link and returns the source to switch to, with the reason, or nil. The
// source is kept unless it held the readers back (they waited for it at
// least two thirds of the time: another source might feed them faster).
// Then, when the source before it was measured faster by switchMargin,
// the download goes back to that one; otherwise it tries the next
// candidate that is not known to be slower by switchMargin.
func (d *download) decideLocked(now time.Time) (*source, string) {
	g := &d.g
	cur := d.cur
	if cur == nil || d.switchTo != nil || g.since.IsZero() || now.Sub(g.since) < d.f.opts.SwitchAfter {
		return nil, ""
	}
	g.account(now)
	el := now.Sub(g.since)
	rate := float64(g.bytes) / el.Seconds()
	bound := 3*g.starved >= 2*el
	waited := g.starved.Seconds() / el.Seconds()
	g.since, g.bytes, g.starved = now, 0, 0
	cur.rate = rate
	d.f.noteRate(cur.link, rate, bound)
	prev := d.prev
	d.prev = nil
	if !bound || d.switches >= maxSwitches {
		return nil, ""
	}
	why := fmt.Sprintf("%s gave %.0f bytes/s and the readers waited for it %.0f%% of the time", cur, rate, 100*waited)
	if prev != nil {
		if d.usableLocked(prev) && rate*switchMargin < prev.rate {
			return prev, fmt.Sprintf("%s; %s gave %.0f bytes/s", why, prev, prev.rate)
		}
		return nil, ""
	}
	for _, s := range d.cands {
		if s == cur || !d.usableLocked(s) {
			continue
		}
		known := s.rate
		if known == 0 {
			known = d.f.knownRate(s.link)
		}
		if known == 0 || known > rate*switchMargin {
			d.prev = cur
			if known == 0 {
				return s, why + fmt.Sprintf("; %s is not measured yet", s)
			}
			return s, why + fmt.Sprintf("; %s gave %.0f bytes/s", s, known)
		}
	}
	return nil, ""
}

// usableLocked reports whether the download may (re)open s: it has not
// failed, it was opened at most once (a second time to come back to it),
// and, for a peer, the peer is not on the host of a cache reading this
// download, nor on a link that failed less than peerBackoff ago.
func (d *download) usableLocked(s *source) bool {
	if s.failed || s.opened >= 2 {
		return false
	}
	if s.peer == nil {
		return true
	}
	for _, c := range d.avoid {
		if c.sameHost(s.peer.pool.UUID) {
			return false
		}
	}
	d.f.pmu.Lock()
	defer d.f.pmu.Unlock()
	return !d.f.failedLocked(s.link)
}

// nextUsableLocked is the first usable candidate other than the current
// one, nil when there is none.
func (d *download) nextUsableLocked() *source {
	for _, s := range d.cands {
		if s != d.cur && d.usableLocked(s) {
			return s
		}
	}
	return nil
}

// sourcesLocked names the sources that fed bytes [0, end) in order, a run
// of one kind named once; peer is the entry of the first peer among them
// ("" for none).
func (d *download) sourcesLocked(end int64) (kinds []string, peer string) {
	for _, sg := range d.segs {
		if sg.from >= end && end > 0 {
			break
		}
		if n := len(kinds); n == 0 || kinds[n-1] != sg.src.kind {
			kinds = append(kinds, sg.src.kind)
		}
		if peer == "" && sg.src.peer != nil {
			peer = sg.src.peer.c.cfg.Entry
		}
	}
	return kinds, peer
}

// switchedName is Base.Source for bytes that came from several sources:
// their kinds in order, joined by "+".
func switchedName(kinds []string) string { return strings.Join(kinds, "+") }
