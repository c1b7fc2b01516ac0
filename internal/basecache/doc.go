// Package basecache keeps verified base images in a libvirt storage pool,
// one per (provider entry, image key, format), for overlays to be backed
// by: the engine behind imagecache and kvm2.
//
// It owns the volume names (BaseName, MarkerName), downloading an image
// over HTTP straight into a volume in constant memory, verifying what
// libvirt stored before publishing it, the claims that keep two writers
// from touching one base at once, single-flight within a Cache, eviction
// that refuses while a domain uses the base, List and Verify. It does not
// own the libvirt connection (Conn; SSH adapts a libvirt session over SSH), the
// overlays and domains that use a base, or retries: every error is
// classed and the caller decides.
//
// # Publish protocol
//
// A base "base-<entry>--<key>.<format>" is usable only together with
// exactly one marker "<base>.sha256-<digest>", a 0-byte volume whose name
// carries the digest. A cold fetch goes through stages, after
// containerd's content store: the GET and its checks (status, the pool's
// free space, the body's first bytes against the format), a staged volume
// that is deleted unless it is committed, the transfer into it with the
// read-back of what the host stored beside it, and the commit, which
// checks the stored size and digest and creates the marker last.
//
// Whoever creates, fills or deletes a base first holds a claim: a uniquely
// named 0-byte volume "claim-<entry>--<key>.<format>.<unixnano>.<token>",
// created before the pool is listed again (create, then look: two writers
// never both proceed). Its holder refreshes it every ClaimTimeout/4 and
// gives its work up when it could not for ClaimTimeout/2; a claim whose
// newest volume is older than ClaimTimeout is stale and anyone may delete
// it. A base without a marker is debris only while nobody holds a fresh
// claim.
//
// # Overlapped verification
//
// The upload goes in segments, one StorageVolUpload at the segment's
// offset each, on a dedicated connection; a second dedicated connection
// reads back every segment whose upload stream has finished and hashes the
// bytes in order while the next segment is uploaded. What decides is the
// sha256 of the bytes read back from the host, the volume's physical size
// and the drain before each segment's end.
//
// # Fan-out
//
// Caches given the same Fanout (ProcessFanout for the whole process)
// share one download of an image among their concurrent cold fetches,
// through a bounded window each host reads at its own pace. For an image
// with a configured SHA256 the download's source may be another cache's
// published base (a peer) as well as the mirror: it starts from the
// source with the best recent rate, measures it, and switches to another
// one, from the byte it reached, when it holds the readers back. A host
// never copies a base of its own host over the network (a raw image's is
// copied inside the host). Any failure of bytes a peer fed falls back to
// the mirror in the same fetch. Only bytes are shared: every host
// uploads, reads back, checks and marks its own base.
//
// Spans (imagecache.Ensure, Fetch, Upload, Verify, Evict, List) and their
// attributes, and the metrics (Config.MeterProvider: bytes fetched by
// source, fetch durations, failed checks, evictions, the entry's bases),
// are listed in docs/observability.md.
package basecache
