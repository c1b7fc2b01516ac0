package egressproxy

import (
	"crypto/sha256"
	"encoding/base32"
	"encoding/binary"
	"github.com/egressproxy/egressproxy/internal/naming"
	"strings"
)

// nameHashLen is the length of the hash suffix NameFromKubernetes appends:
// 10 base32 characters, 50 bits of SHA-256.
const nameHashLen = 10

// nameDomain starts the hashed encoding of NameFromKubernetes; another
// encoding gets another domain string.
const nameDomain = "egressproxy.dev/k8s-name/v1"

var nameHashEncoding = base32.NewEncoding("abcdefghijklmnopqrstuvwxyz234567").WithPadding(base32.NoPadding)

// NameFromKubernetes derives an instance name (Spec.Name) from the
// namespace and name of a Kubernetes object, for an operator that runs one
// proxy per object. The result always passes ValidateName (1–63 of a–z,
// 0–9, '-', alphanumeric at both ends, no "--"), whatever the input: a
// namespace (a DNS label, up to 63 characters) and a name (a DNS subdomain,
// up to 253 characters with dots) give
//
//	<readable prefix>-<hash>
//
// where the prefix is "namespace-name" lowercased, with '.' and every other
// character outside a–z 0–9 turned into '-', runs of '-' collapsed to one,
// trimmed at both ends and cut to fit (the start is kept), and hash is 10
// base32 characters (a–z, 2–7: 50 bits) of the SHA-256 of the exact inputs,
// length-prefixed so that no two (namespace, name) pairs share an encoding
// ("a-b"/"c" and "a"/"b-c" share a prefix but not a hash). The suffix is
// always there, so the name does not change when the prefix starts to be
// cut. For "prod"/"web" that is "prod-web-" followed by the hash.
//
// The result depends only on the inputs, never on the process, platform or
// release: it is stable across restarts and operator versions, so the
// embedder can derive it again instead of storing it. Two distinct inputs
// collide only with the probability of a 50-bit hash collision (about
// n²/2⁵¹ for n objects: below one in a million for 30,000 objects). Use the
// object's UID as Spec.UID: the name says where the instance comes from,
// the UID which object it belongs to.
func NameFromKubernetes(namespace, name string) string {
	h := sha256.New()
	var n [8]byte
	for _, v := range []string{nameDomain, namespace, name} {
		binary.BigEndian.PutUint64(n[:], uint64(len(v)))
		h.Write(n[:])
		h.Write([]byte(v))
	}
	suffix := nameHashEncoding.EncodeToString(h.Sum(nil))[:nameHashLen]

	prefix := readablePrefix(namespace+"-"+name, naming.MaxNameLen-1-nameHashLen)
	if prefix == "" {
		return suffix
	}
	return prefix + "-" + suffix
}

// readablePrefix maps s to lowercase letters, digits and single '-'
// separators, without a '-' at either end, at most max bytes long.
func readablePrefix(s string, max int) string {
	var b strings.Builder
	dash := true // suppresses a leading '-' and runs of '-'
	for i := 0; i < len(s) && b.Len() < max; i++ {
		c := s[i]
		switch {
		case c >= 'A' && c <= 'Z':
			c += 'a' - 'A'
		case (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'):
		default:
			c = '-'
		}
		if c == '-' {
			if dash {
				continue
			}
			dash = true
		} else {
			dash = false
		}
		b.WriteByte(c)
	}
	return strings.TrimRight(b.String(), "-")
}
