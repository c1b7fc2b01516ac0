package basecache

import (
	"context"
	"strings"
	"sync"
	"time"

	"github.com/digitalocean/go-libvirt"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/obs"
)

// meterName is the instrumentation scope of the cache's metrics, the
// scope of its spans.
const meterName = "github.com/egressproxy/egressproxy/imagecache"

// The sources a transfer's bytes are counted under
// (egressproxy.image.source), indexes of sourceBytes.
const (
	srcMirror   = iota // the mirror, read by this fetch's own download (alone, or the shared one it started)
	srcShared          // the mirror, through a shared download another cache started
	srcPeer            // another cache's published base
	srcDetached        // this fetch's own stream after it was detached from a shared download
	numSources
)

// sourceSwitched is the egressproxy.image.source of a fetch that several
// sources fed in turn (Base.Source "peer+mirror", …).
const sourceSwitched = "switched"

// The checks whose failures egressproxy.image.verify.failures counts
// (egressproxy.image.check).
const (
	// checkDigest: the bytes a fetch received hash to another digest than
	// the image's configured SHA256.
	checkDigest = "digest"
	// checkStored: what the host stored (its size, or the bytes read
	// back) differs from what was sent or copied.
	checkStored = "stored"
	// checkMarker: Verify read a published base whose bytes differ from
	// its marker's digest.
	checkMarker = "marker"
)

// sourceBytes are the bytes of one transfer by the source that fed them,
// indexed by srcMirror…srcDetached.
type sourceBytes [numSources]int64

// sourceName is the attribute value of source index i.
func sourceName(i int) string {
	switch i {
	case srcMirror:
		return imagecache.SourceMirror
	case srcShared:
		return imagecache.SourceShared
	case srcPeer:
		return imagecache.SourcePeer
	}
	return imagecache.SourceDetached
}

// fetchSource is the egressproxy.image.source of a fetch whose Base.Source
// is src: src itself for one source, sourceSwitched for a fetch several
// sources fed in turn, so that the attribute keeps a fixed set of values
// however often a download switches (transfer.size has each source's
// bytes).
func fetchSource(src string) string {
	switch src {
	case imagecache.SourceMirror, imagecache.SourceShared, imagecache.SourcePeer, imagecache.SourceDetached:
		return src
	}
	return sourceSwitched // the only other form: kinds joined by "+"
}

// cacheMeters are a Cache's instruments, each series labelled with the
// cache's entry. A nil *cacheMeters (no MeterProvider) records nothing and
// keeps no inventory, so the cache makes no call for them.
type cacheMeters struct {
	attrs    []attribute.KeyValue // egressproxy.entry
	entryAdd metric.AddOption     // attrs alone
	entryObs metric.ObserveOption

	transfer     metric.Int64Counter
	transferOpts [numSources]metric.AddOption
	fetches      metric.Float64Histogram
	verify       metric.Int64Counter
	evictions    metric.Int64Counter
	count, usage metric.Int64ObservableGauge
	reg          metric.Registration // nil when the meter refused the callback

	inv inventory
}

func newCacheMeters(mp metric.MeterProvider, entry string) *cacheMeters {
	if mp == nil {
		return nil
	}
	m := obs.Meter(mp, meterName)
	cm := &cacheMeters{attrs: obs.Clean([]attribute.KeyValue{obs.KeyEntry.String(entry)})}
	set := attribute.NewSet(cm.attrs...)
	cm.entryAdd, cm.entryObs = metric.WithAttributeSet(set), metric.WithAttributeSet(set)
	cm.transfer, _ = m.Int64Counter(obs.MetricImageTransferSize, metric.WithUnit(obs.UnitBytes),
		metric.WithDescription("Bytes the entry's cold image fetches moved into its pool, by the source that fed them."))
	for i := range numSources {
		kv := append(cm.attrs[:len(cm.attrs):len(cm.attrs)], obs.KeyImageSource.String(sourceName(i)))
		cm.transferOpts[i] = metric.WithAttributeSet(attribute.NewSet(kv...))
	}
	cm.fetches = obs.DurationHistogram(m, obs.MetricImageFetchDuration,
		"Duration of each cold fetch of a base image, from its claim to the base published or the fetch failed.")
	cm.verify, _ = m.Int64Counter(obs.MetricImageVerifyFailures, metric.WithUnit("{failure}"),
		metric.WithDescription("Checks of an image's bytes that found other bytes than expected."))
	cm.evictions, _ = m.Int64Counter(obs.MetricImageEvictions, metric.WithUnit("{base}"),
		metric.WithDescription("Base images removed by Evict."))
	cm.count = obs.Int64Gauge(m, obs.MetricImageBaseCount, "{base}", "The entry's published base images in its pool.")
	cm.usage = obs.Int64Gauge(m, obs.MetricImageBaseUsage, obs.UnitBytes, "Stored size of the entry's published base images.")
	cm.inv.entry = entry
	if reg, err := m.RegisterCallback(cm.observe, cm.count, cm.usage); err == nil {
		cm.reg = reg
	}
	return cm
}

// close stops reporting the bases: their series end with the cache.
func (m *cacheMeters) close() {
	if m != nil && m.reg != nil {
		_ = m.reg.Unregister()
	}
}

// observe reports the entry's published bases once the cache has listed
// its pool.
func (m *cacheMeters) observe(_ context.Context, o metric.Observer) error {
	count, usage, ok := m.inv.totals()
	if ok {
		o.ObserveInt64(m.count, count, m.entryObs)
		o.ObserveInt64(m.usage, usage, m.entryObs)
	}
	return nil
}

// fetched records one cold fetch: its source on success, its class on
// failure.
func (m *cacheMeters) fetched(elapsed time.Duration, b Base, err error) {
	if m == nil {
		return
	}
	kv := make([]attribute.KeyValue, 0, len(m.attrs)+1)
	kv = append(kv, m.attrs...)
	if err == nil {
		kv = append(kv, obs.KeyImageSource.String(fetchSource(b.Source)))
	}
	kv = obs.ErrorTypeAttr(kv, err)
	m.fetches.Record(context.Background(), elapsed.Seconds(), metric.WithAttributes(kv...))
}

// verifyFailed counts a failed check; src, when not "", is the Base.Source
// form of where the checked bytes came from.
func (m *cacheMeters) verifyFailed(check, src string) {
	if m == nil {
		return
	}
	kv := make([]attribute.KeyValue, 0, len(m.attrs)+2)
	kv = append(kv, m.attrs...)
	kv = append(kv, obs.KeyImageCheck.String(check))
	if src != "" {
		kv = append(kv, obs.KeyImageSource.String(fetchSource(src)))
	}
	m.verify.Add(context.Background(), 1, metric.WithAttributes(kv...))
}

// transferred counts n bytes fed by source i.
func (m *cacheMeters) transferred(i int, n int64) {
	if m != nil && n > 0 {
		m.transfer.Add(context.Background(), n, m.transferOpts[i])
	}
}

// evicted notes that Evict left the base name unpublished (its markers
// gone), and counts an eviction when it deleted the base's volume.
func (m *cacheMeters) evicted(name string, deleted bool) {
	if m == nil {
		return
	}
	m.inv.unpublished(name)
	if deleted {
		m.evictions.Add(context.Background(), 1, m.entryAdd)
	}
}

// listing notes that a listing of the pool begins and returns what takes
// its volumes once it succeeded (see inventory).
func (m *cacheMeters) listing() func(vols []libvirt.StorageVol) {
	if m == nil {
		return func([]libvirt.StorageVol) {}
	}
	g := m.inv.begin()
	return func(vols []libvirt.StorageVol) { m.inv.listed(g, volNames(vols)) }
}

// published notes base name published with digest, size bytes stored.
func (m *cacheMeters) published(name, digest string, size int64) {
	if m != nil {
		m.inv.published(name, digest, size)
	}
}

// sized notes the stored size of base name, when it is published.
func (m *cacheMeters) sized(name string, size int64) {
	if m != nil {
		m.inv.sized(name, size)
	}
}

// needsSize reports whether base name is published with a size not known
// yet (a base the cache found rather than published).
func (m *cacheMeters) needsSize(name string) bool {
	return m != nil && m.inv.needsSize(name)
}

// tally counts one transfer's bytes by source as it goes: at each progress
// report of the upload and once at its end (meter.report), from the count
// of bytes sent and where they came from (origin.bytesBy). A nil *tally
// counts nothing.
type tally struct {
	m       *cacheMeters
	from    origin
	counted sourceBytes
}

// tally returns the tally of a transfer of from's bytes, nil without
// metrics.
func (m *cacheMeters) tally(from origin) *tally {
	if m == nil || from == nil {
		return nil
	}
	return &tally{m: m, from: from}
}

// add counts what the first n bytes of the transfer add to what was
// counted so far.
func (t *tally) add(n int64) {
	if t == nil {
		return
	}
	by := t.from.bytesBy(n)
	for i := range numSources {
		t.m.transferred(i, by[i]-t.counted[i])
	}
	t.counted = by
}

// inventory is what a cache knows of its entry's published bases (a base
// volume with exactly one well-formed marker): the set as its latest
// listing of the pool found it, corrected by what the cache did since
// (publish, Evict), with the stored size of each as the cache learnt it
// (publishing it, List, Verify, a peer's question, or the first hit on a
// base it found). No call is made for it but that one read of a size.
//
// A listing only changes the bases no publish or eviction touched since it
// began (gen), so a listing that raced with one does not undo it.
type inventory struct {
	entry string

	mu    sync.Mutex
	known bool   // a listing succeeded: the set is known
	gen   uint64 // listings begun
	bases map[string]baseFact
}

type baseFact struct {
	published bool
	digest    string
	size      int64  // -1: not known
	at        uint64 // gen when a publish or eviction last set it (0: a listing did)
}

func (v *inventory) begin() uint64 {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.gen++
	return v.gen
}

// listed applies a listing begun at gen g that found names.
func (v *inventory) listed(g uint64, names []string) {
	pub := publishedBases(v.entry, names)
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.bases == nil {
		v.bases = map[string]baseFact{}
	}
	v.known = true
	for n, f := range v.bases {
		if _, ok := pub[n]; !ok && f.at < g {
			delete(v.bases, n)
		}
	}
	for n, digest := range pub {
		f, ok := v.bases[n]
		switch {
		case ok && f.at >= g:
			continue // published or evicted since the listing began
		case ok && f.published && f.digest == digest:
			f.at = 0
		default:
			f = baseFact{digest: digest, size: -1}
		}
		f.published = true
		v.bases[n] = f
	}
}

func (v *inventory) published(name, digest string, size int64) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.bases == nil {
		v.bases = map[string]baseFact{}
	}
	v.bases[name] = baseFact{published: true, digest: digest, size: size, at: v.gen}
}

func (v *inventory) unpublished(name string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.bases == nil {
		v.bases = map[string]baseFact{}
	}
	v.bases[name] = baseFact{size: -1, at: v.gen}
}

func (v *inventory) sized(name string, size int64) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if f, ok := v.bases[name]; ok && f.published {
		f.size = size
		v.bases[name] = f
	}
}

func (v *inventory) needsSize(name string) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	f, ok := v.bases[name]
	return ok && f.published && f.size < 0
}

// totals are the published bases and the sum of their known sizes; ok is
// false before the first listing.
func (v *inventory) totals() (count, usage int64, ok bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	for _, f := range v.bases {
		if f.published {
			count++
			usage += max(f.size, 0)
		}
	}
	return count, usage, v.known
}

// publishedBases maps entry's bases among names that have exactly one
// well-formed marker to that marker's digest.
func publishedBases(entry string, names []string) map[string]string {
	markers := map[string][]string{}
	for _, n := range names {
		if !strings.Contains(n, markerInfix+markerDigSep) {
			continue
		}
		if b, d, ok := ParseMarkerName(n); ok {
			if e, _, _, _ := ParseBaseName(b); e == entry {
				markers[b] = append(markers[b], d)
			}
		}
	}
	out := map[string]string{}
	for _, n := range names {
		if ds := markers[n]; len(ds) == 1 {
			out[n] = ds[0]
		}
	}
	return out
}
