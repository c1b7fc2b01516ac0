package basecache

import (
	"strconv"
	"strings"
	"time"

	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/internal/naming"
)

// Volume names the cache produces in a pool. Every name is built from the
// provider entry name (naming.ValidateName rules), the image key (the
// egressproxy.Spec.ImageKey rules) and the format ("qcow2" or "raw"). Neither an
// entry nor a key may contain "--", so the "--" between them is an injective
// separator (a single '-' would not be: entry "a-b" + key "c" and entry "a" +
// key "b-c" would both give "a-b-c").
//
//	base-<entry>--<key>.<format>                  the published base image
//	base-<entry>--<key>.<format>.sha256-<hex>     its digest marker (0 bytes; the digest is in the name)
//	claim-<entry>--<key>.<format>.<unixnano>.<hex> a writer's claim while it mutates the base (0 bytes)
//
// The older single-entry naming "base-<key>.<format>" (another provider may
// still use it on the same host) can never be produced: such a name has no
// "--" at all, because a key neither contains "--" nor ends with '-', and a
// format contains no '-'. Volumes under that naming are never touched.
const (
	basePrefix   = "base-"
	claimPrefix  = "claim-"
	sep          = "--"
	markerInfix  = ".sha256"
	markerDigSep = "-"
	digestHexLen = 64
)

// Formats the cache stores.
const (
	FormatQCOW2 = "qcow2"
	FormatRaw   = "raw"
)

func validFormat(f string) bool { return f == imagecache.FormatQCOW2 || f == imagecache.FormatRaw }

// validKey applies the one key rule (naming.ValidateKey).
func validKey(k string) error { return naming.ValidateKey("Key", k) }

// BaseName returns the base volume name "base-<entry>--<key>.<format>". It
// does not validate; callers pass validated parts (New and Ensure do).
func BaseName(entry, key, format string) string {
	return basePrefix + entry + sep + key + "." + format
}

// MarkerName returns the digest marker volume name of a base:
// "<base>.sha256-<digest>".
func MarkerName(base, digest string) string {
	return base + markerInfix + markerDigSep + digest
}

// claimName returns a claim volume name for base (without its "base-"
// prefix) taken at t with the random suffix rnd (hex).
func claimName(base string, t time.Time, rnd string) string {
	return claimPrefix + strings.TrimPrefix(base, basePrefix) + "." + strconv.FormatInt(t.UnixNano(), 10) + "." + rnd
}

// ParseBaseName splits a name produced by BaseName. ok is false for any
// other name, including the older "base-<key>.<format>" naming.
func ParseBaseName(name string) (entry, key, format string, ok bool) {
	rest, found := strings.CutPrefix(name, basePrefix)
	if !found {
		return "", "", "", false
	}
	entry, rest, found = strings.Cut(rest, sep)
	if !found {
		return "", "", "", false
	}
	dot := strings.LastIndexByte(rest, '.')
	if dot < 0 {
		return "", "", "", false
	}
	key, format = rest[:dot], rest[dot+1:]
	if naming.ValidateName("entry", entry) != nil || validKey(key) != nil || !validFormat(format) {
		return "", "", "", false
	}
	return entry, key, format, true
}

// markerOf reports whether name is a marker candidate of base (any name
// "<base>.sha256…"), and if so, the digest it carries and whether that is a
// well-formed digest (64 lowercase hex digits).
func markerOf(base, name string) (digest string, candidate, valid bool) {
	rest, found := strings.CutPrefix(name, base+markerInfix)
	if !found {
		return "", false, false
	}
	d, found := strings.CutPrefix(rest, markerDigSep)
	if !found || !validDigest(d) {
		return "", true, false
	}
	return d, true, true
}

// ParseMarkerName splits a marker name into its base name and digest. ok is
// false unless the base parses and the digest is well formed.
func ParseMarkerName(name string) (base, digest string, ok bool) {
	// Keys may contain ".sha256-" too, so try every occurrence; at most one
	// split leaves a well-formed digest (a digest has no '.').
	for i := 0; ; {
		j := strings.Index(name[i:], markerInfix+markerDigSep)
		if j < 0 {
			return "", "", false
		}
		cand := name[:i+j]
		if _, _, _, ok := ParseBaseName(cand); ok {
			if d, _, valid := markerOf(cand, name); valid {
				return cand, d, true
			}
		}
		i += j + 1
	}
}

// parseClaimName returns the base name a claim belongs to and the time it
// was taken (or last refreshed).
func parseClaimName(name string) (base string, at time.Time, ok bool) {
	base, at, _, ok = parseClaim(name)
	return base, at, ok
}

// parseClaim is parseClaimName with the claim's token.
func parseClaim(name string) (base string, at time.Time, token string, ok bool) {
	rest, found := strings.CutPrefix(name, claimPrefix)
	if !found {
		return "", time.Time{}, "", false
	}
	d2 := strings.LastIndexByte(rest, '.')
	if d2 < 0 {
		return "", time.Time{}, "", false
	}
	rnd := rest[d2+1:]
	d1 := strings.LastIndexByte(rest[:d2], '.')
	if d1 < 0 || rnd == "" || !isHex(rnd) {
		return "", time.Time{}, "", false
	}
	digits := rest[d1+1 : d2]
	ns, err := strconv.ParseInt(digits, 10, 64)
	// Only the canonical form claimName writes: no sign, no leading zeros.
	if err != nil || ns < 0 || strconv.FormatInt(ns, 10) != digits {
		return "", time.Time{}, "", false
	}
	base = basePrefix + rest[:d1]
	if _, _, _, ok := ParseBaseName(base); !ok {
		return "", time.Time{}, "", false
	}
	return base, time.Unix(0, ns), rnd, true
}

func validDigest(d string) bool { return len(d) == digestHexLen && isHex(d) }

func isHex(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}
